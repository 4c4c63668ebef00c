"""The pieces of the API limits without a server (ADR 0025): route classes, token buckets, stream slots,
Retry-After, settings from the environment, and the bounded node connection pools over a mock transport.
Over real HTTP: tests/controlplane/test_api_limits.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from space.controlplane import retention
from space.controlplane.api import limits
from space.controlplane.node_pools import BoundedTransport, PoolSettings, traffic_owner
from space.controlplane.settings import ControlPlaneSettings
from space.core import errors
from space.rest import errors as rest_errors

SB = "/v1/sandboxes/sb-" + "a" * 26


@pytest.mark.parametrize(
    ("method", "path", "public", "long_lived", "data_plane"),
    [
        ("POST", "/v1/sandboxes", True, False, False),
        ("GET", "/v1/credentials", True, False, False),
        ("POST", f"{SB}/exec", True, True, True),
        ("GET", f"{SB}/files", True, True, True),
        ("PUT", f"{SB}/files", True, True, True),
        ("DELETE", f"{SB}/files", True, False, True),
        ("GET", f"{SB}/files/watch", True, True, True),
        ("GET", f"{SB}/files/list", True, False, True),
        ("GET", f"{SB}/processes/p-1/output", True, True, True),
        ("POST", f"{SB}/processes/p-1/stdin", True, True, True),
        ("POST", f"{SB}/processes/p-1/signal", True, False, True),
        ("WEBSOCKET", f"{SB}/pty", True, True, True),
        ("POST", f"{SB}/pause", True, False, False),
        ("POST", "/v1/nodes/register", False, False, False),
        ("POST", "/v1/nodes/node-1/heartbeat", False, False, False),
        ("GET", "/healthz", False, False, False),
        ("GET", "/v1", True, False, False),
        ("GET", "/v1nodes", False, False, False),
    ],
)
def test_route_classes(method: str, path: str, public: bool, long_lived: bool, data_plane: bool) -> None:
    assert limits.is_public(path) is public
    assert limits.is_long_lived(method, path) is long_lived
    assert limits.is_data_plane(path) is data_plane


def test_body_limits_by_route() -> None:
    settings = limits.LimitSettings(json_body_bytes=10, upload_body_bytes=1000, node_body_bytes=100)
    assert limits.body_limit(settings, "POST", "/v1/sandboxes") == 10
    assert limits.body_limit(settings, "POST", f"{SB}/exec") == 10
    assert limits.body_limit(settings, "PUT", f"{SB}/files") == 1000
    assert limits.body_limit(settings, "POST", f"{SB}/processes/p-1/stdin") == 1000
    assert limits.body_limit(settings, "POST", f"{SB}/files/mkdir") == 10
    assert limits.body_limit(settings, "POST", "/v1/nodes/n/audit") == 100


def test_token_bucket_per_key() -> None:
    buckets = limits.TokenBuckets(rate=2.0, burst=3, max_keys=10)
    assert [buckets.take("a", now=100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a", now=100.0) == pytest.approx(0.5)
    assert buckets.take("b", now=100.0) == 0.0  # another key has its own bucket
    assert buckets.take("a", now=100.6) == 0.0  # refilled at 2/s
    assert buckets.take("a", now=100.6) > 0.0


def test_token_buckets_are_bounded_in_number() -> None:
    buckets = limits.TokenBuckets(rate=1.0, burst=1, max_keys=3)
    for key in "abcdef":
        buckets.take(key, now=0.0)
    assert len(buckets._buckets) == 3


def test_stream_slots() -> None:
    slots = limits.StreamSlots(per_key=2)
    assert slots.acquire("a") and slots.acquire("a") and not slots.acquire("a")
    assert slots.acquire("b")
    slots.release("a")
    assert slots.open("a") == 1 and slots.acquire("a")
    slots.release("a")
    slots.release("a")
    slots.release("b")
    assert slots.open("a") == slots.open("b") == 0


def test_retry_after_comes_from_the_error() -> None:
    response = rest_errors.error_response(errors.ResourceExhausted("slow down", retry_after_s=2.2))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert (
        rest_errors.error_response(errors.ResourceExhausted("x", retry_after_s=0)).headers["retry-after"]
        == "1"
    )
    assert "retry-after" not in rest_errors.error_response(errors.ResourceExhausted("disk full")).headers
    assert "retry-after" not in rest_errors.error_response(errors.TooLarge("x", retry_after_s="soon")).headers


def test_settings_from_the_environment() -> None:
    settings = limits.LimitSettings.from_env(
        {"SPACE_API_REQUESTS_PER_S": "2.5", "SPACE_API_STREAMS_PER_KEY": "3"}
    )
    assert (settings.requests_per_s, settings.streams_per_key) == (2.5, 3)
    assert settings.json_body_bytes == limits.LimitSettings().json_body_bytes
    assert PoolSettings.from_env({"SPACE_NODE_POOL_DATA_IDLE_S": "7"}).data_idle_s == 7.0
    for bad in ("x", "0", "-1"):
        with pytest.raises(errors.InvalidArgument):
            limits.LimitSettings.from_env({"SPACE_API_STREAMS_PER_KEY": bad})
    with pytest.raises(errors.InvalidArgument):
        PoolSettings.from_env({"SPACE_NODE_POOL_DATA_PER_OWNER": "1.5"})


def test_one_settings_object_names_every_variable() -> None:
    """ControlPlaneSettings (ADR 0030): every field documented and read from its own SPACE_ variable,
    exactly (case-sensitive); blank numbers are defaults; the groups the parts take come from it."""
    fields = ControlPlaneSettings.model_fields
    aliases = [ControlPlaneSettings.env_name(name) for name in fields]
    assert all(alias.startswith("SPACE_") for alias in aliases) and len(set(aliases)) == len(aliases)
    assert all(info.description for info in fields.values())
    environ = {
        "SPACE_API_STREAMS_PER_KEY": "3",
        "SPACE_NODE_POOL_DATA_WAIT_S": "2.5",
        "SPACE_RETENTION_AUDIT_S": " ",
        "space_api_request_burst": "1",
        "SPACE_STORE_URL": "file:///srv/objects",
    }
    settings = ControlPlaneSettings.from_env(environ)
    assert settings.api_streams_per_key == 3 and settings.pool_data_wait_s == 2.5
    assert settings.retention_audit_s == retention.RetentionSettings().audit_s  # blank: the default
    assert settings.api_request_burst == limits.LimitSettings().request_burst  # another name entirely
    assert settings.store_url == "file:///srv/objects"
    assert limits.LimitSettings.of(settings).streams_per_key == 3
    assert PoolSettings.of(settings).data_wait_s == 2.5
    only = ControlPlaneSettings.from_env({**environ, "SPACE_API_JSON_BODY_BYTES": "x"}, only="store_url")
    assert only.store_url == "file:///srv/objects" and only.api_streams_per_key == 32
    with pytest.raises(errors.InvalidArgument, match="SPACE_RETENTION_IDEMPOTENCY_S"):
        retention.RetentionSettings.from_env({"SPACE_RETENTION_IDEMPOTENCY_S": "-5"})


# -- bounded pools over a mock transport ---------------------------------------------------------------------
class Endless(httpx.AsyncByteStream):
    """A response body that sends one line and then nothing (a quiet stream)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"first\n"
        await asyncio.sleep(3600)


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


JSON = {"content-type": "application/json"}


def streaming(_request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=Endless(), headers={"content-type": "application/x-ndjson"})


def test_one_owner_cannot_take_more_than_its_calls_in_flight() -> None:
    asyncio.run(_one_owner_cannot_take_more_than_its_calls_in_flight())


async def _one_owner_cannot_take_more_than_its_calls_in_flight() -> None:
    pool = BoundedTransport(
        connections=10, per_owner=2, wait_s=0.2, max_json_bytes=1000, inner=httpx.MockTransport(streaming)
    )
    async with httpx.AsyncClient(transport=pool, base_url="http://node") as client:
        token = traffic_owner.set("key-a")
        try:
            held = [await client.send(client.build_request("GET", "/s"), stream=True) for _ in range(2)]
            with pytest.raises(errors.ResourceExhausted) as info:
                await client.send(client.build_request("GET", "/s"), stream=True)
            assert info.value.details["retry_after_s"] == 1
        finally:
            traffic_owner.reset(token)
        # Another owner, and control traffic (no owner), are not affected.
        token = traffic_owner.set("key-b")
        try:
            other = await client.send(client.build_request("GET", "/s"), stream=True)
        finally:
            traffic_owner.reset(token)
        control = await client.send(client.build_request("GET", "/s"), stream=True)
        # Closing a stream gives its slot back.
        await held[0].aclose()
        token = traffic_owner.set("key-a")
        try:
            again = await client.send(client.build_request("GET", "/s"), stream=True)
        finally:
            traffic_owner.reset(token)
        for response in (held[1], other, control, again):
            await response.aclose()
    assert pool._owners == {}


def test_a_json_answer_over_the_cap_is_refused() -> None:
    asyncio.run(_a_json_answer_over_the_cap_is_refused())


async def _a_json_answer_over_the_cap_is_refused() -> None:
    def big(_request: httpx.Request) -> httpx.Response:
        # A streamed body, as from a real connection (a Response made with json= is read at once).
        return httpx.Response(200, stream=Chunks([b'{"x": "', b"y" * 5000, b'"}']), headers=JSON)

    pool = BoundedTransport(connections=10, max_json_bytes=1000, inner=httpx.MockTransport(big))
    async with httpx.AsyncClient(transport=pool, base_url="http://node") as client:
        with pytest.raises(errors.TooLarge) as info:
            await client.get("/list")
    assert info.value.details["limit_bytes"] == 1000

    def big_file(_request: httpx.Request) -> httpx.Response:
        octets = {"content-type": "application/octet-stream"}
        return httpx.Response(200, stream=Chunks([b"z" * 2500, b"z" * 2500]), headers=octets)

    pool = BoundedTransport(connections=10, max_json_bytes=1000, inner=httpx.MockTransport(big_file))
    async with httpx.AsyncClient(transport=pool, base_url="http://node") as client:
        assert len((await client.get("/file")).content) == 5000  # streams are not capped


def test_a_control_call_is_answered_whole_within_its_total_time() -> None:
    asyncio.run(_a_control_call_is_answered_whole_within_its_total_time())


async def _a_control_call_is_answered_whole_within_its_total_time() -> None:
    pool = BoundedTransport(
        connections=10, total_s=0.3, max_json_bytes=1000, inner=httpx.MockTransport(streaming)
    )
    async with httpx.AsyncClient(transport=pool, base_url="http://node") as client:
        started = asyncio.get_running_loop().time()
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/slow")
        assert asyncio.get_running_loop().time() - started < 2.0


def test_data_calls_get_the_pool_wait_and_idle_read_timeouts() -> None:
    asyncio.run(_data_calls_get_the_pool_wait_and_idle_read_timeouts())


async def _data_calls_get_the_pool_wait_and_idle_read_timeouts() -> None:
    seen: list[dict[str, float | None]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.extensions["timeout"]))
        return httpx.Response(200, json={})

    pool = BoundedTransport(
        connections=10,
        per_owner=4,
        wait_s=5.0,
        idle_s=30.0,
        max_json_bytes=1000,
        inner=httpx.MockTransport(record),
    )
    async with httpx.AsyncClient(
        transport=pool, base_url="http://node", timeout=httpx.Timeout(None)
    ) as client:
        await client.get("/a")
        await client.get("/b", timeout=httpx.Timeout(10.0))
    assert seen[0]["read"] == 30.0 and seen[0]["pool"] == 5.0
    assert seen[1]["read"] == 10.0 and seen[1]["pool"] == 5.0


def test_pooled_node_connections_expire_before_the_node_closes_them() -> None:
    """The pool must drop an idle connection before the node agent's server does, or a request sent on a
    connection the node is closing fails (found by the load benchmark)."""
    from space.controlplane.node_pools import KEEPALIVE_EXPIRY_S
    from space.node.agent.rpc_listen import KEEPALIVE_S

    server_keep_alive = KEEPALIVE_S  # what the agent's uvicorn runs with (space.node.agent.launch, ADR 0044)
    assert 0 < KEEPALIVE_EXPIRY_S < server_keep_alive


def refusal_events(declared: int, chunk_count: int) -> list[str]:
    """What the middleware does, in order, with a node-facing POST whose declared body is over the limit:
    `read` for each body message it takes, then the answer's message types."""
    settings = limits.LimitSettings.from_env({"SPACE_API_NODE_BODY_BYTES": str(1024 * 1024)})
    middleware = limits.RequestLimits(app=None, services=None, settings=settings)  # type: ignore[arg-type]
    chunks = [b"x" * (declared // chunk_count)] * chunk_count
    events: list[str] = []

    async def receive() -> dict[str, object]:
        events.append("read")
        if not chunks:
            return {"type": "http.disconnect"}
        chunks.pop()
        return {"type": "http.request", "body": b"x", "more_body": bool(chunks)}

    async def send(message: dict[str, object]) -> None:
        events.append(str(message["type"]))

    headers = [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/nodes/node-1/heartbeat", "headers": headers}
    asyncio.run(middleware(scope, receive, send))  # type: ignore[arg-type]
    return events


def test_a_refused_body_of_moderate_size_is_read_before_the_answer() -> None:
    # Closing with the body unread makes the kernel reset the connection, and the reset can discard the
    # answer not yet delivered (a 413 seen as "connection reset by peer" in CI); a declared body up to
    # REFUSAL_DRAIN_BYTES is read and dropped first, ...
    assert limits.REFUSAL_DRAIN_BYTES >= 3 * 1024 * 1024
    events = refusal_events(declared=3 * 1024 * 1024, chunk_count=48)
    assert events == ["read"] * 48 + ["http.response.start", "http.response.body"], events
    # ... a bigger one is not read at all: refused at once, as before.
    events = refusal_events(declared=limits.REFUSAL_DRAIN_BYTES + 1, chunk_count=48)
    assert events == ["http.response.start", "http.response.body"], events
