"""AsyncSpace: the same surface as Space with await (the request shapes are covered in test_sdk)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest

from space.core import errors as core_errors
from space.sdk import AsyncSandbox, AsyncSpace, RateLimited, TransportError
from tests.support.sdk_server import KEY, URL, FakeServer, b64, error_response, ndjson, sandbox_json

T = TypeVar("T")


def run(factory: Callable[[AsyncSpace], Awaitable[T]], server: FakeServer, **kw: Any) -> T:
    async def main() -> T:
        transport = kw.pop("transport", None) or httpx.MockTransport(server)
        async with AsyncSpace(url=URL, api_key=KEY, transport=transport, retry_backoff=0, **kw) as sp:
            return await factory(sp)

    return asyncio.run(main())


@pytest.fixture
def server() -> FakeServer:
    fake = FakeServer()
    fake.on("GET", "/v1/sandboxes/sb-1", httpx.Response(200, json=sandbox_json()))
    return fake


def test_async_lifecycle_surface(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json()))
    server.on("POST", "/v1/sandboxes/sb-1/pause", httpx.Response(200, json=sandbox_json(state="paused")))
    server.on(
        "POST", "/v1/sandboxes/sb-1/fork", httpx.Response(201, json={"sandboxes": [sandbox_json("sb-2")]})
    )
    server.on(
        "POST", "/v1/sandboxes/sb-1/snapshots", httpx.Response(201, json={"id": "snap-1", "kind": "disk"})
    )
    server.on("POST", "/v1/sandboxes/sb-1/rollback", httpx.Response(200, json=sandbox_json()))
    server.on("GET", "/v1/sandboxes", httpx.Response(200, json={"sandboxes": [sandbox_json()]}))
    server.on("DELETE", "/v1/sandboxes/sb-1", httpx.Response(202, json=sandbox_json(state="deleting")))

    async def scenario(sp: AsyncSpace) -> list[str]:
        sb = await sp.sandboxes.create(template="python", env={"K": "V"})
        seen = [sb.state]
        await sb.pause()
        seen.append(sb.state)
        child = await sb.fork()
        assert isinstance(child, AsyncSandbox)
        seen.append(child.id)
        snap = await sb.snapshots.create()
        await sb.rollback(snap)
        seen.append(snap.id)
        seen.extend(s.id for s in await sp.sandboxes.list())
        await sb.delete()
        seen.append(sb.state)
        return seen

    assert run(scenario, server) == ["running", "paused", "sb-2", "snap-1", "sb-1", "deleting"]
    assert server.body(0) == {"template": "python", "env": {"K": "V"}, "wait": True}
    assert server.requests[0].headers["Idempotency-Key"]


def test_async_exec_and_stream(server: FakeServer) -> None:
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/exec",
        httpx.Response(200, json={"exit_code": 0, "stdout_b64": b64(b"hi\n"), "stderr_b64": ""}),
        ndjson(
            {"type": "started", "process_id": "p-1"},
            {"type": "stdout", "data_b64": b64(b"a")},
            {"type": "stderr", "data_b64": b64(b"b")},
            {"type": "exit", "exit_code": 2},
        ),
    )

    async def scenario(sp: AsyncSpace) -> tuple[str, int | None, list[bytes], bytes]:
        sb = await sp.sandboxes.get("sb-1")
        first = await sb.exec("echo hi")
        chunks: list[bytes] = []

        async def on_stdout(chunk: bytes) -> None:
            chunks.append(chunk)

        streamed = await sb.exec_stream(["x"], on_stdout=on_stdout)
        return first.stdout, streamed.exit_code, chunks, streamed.stderr_bytes

    assert run(scenario, server) == ("hi\n", 2, [b"a"], b"b")


def test_async_files_and_processes(server: FakeServer) -> None:
    server.on("PUT", "/v1/sandboxes/sb-1/files", lambda r: httpx.Response(200, json={"size": len(r.content)}))
    server.on("GET", "/v1/sandboxes/sb-1/files", httpx.Response(200, content=b"payload"))
    server.on("GET", "/v1/sandboxes/sb-1/files/list", httpx.Response(200, json={"entries": [{"name": "a"}]}))
    server.on(
        "POST", "/v1/sandboxes/sb-1/processes", httpx.Response(201, json={"process_id": "p-1", "pid": 7})
    )
    server.on(
        "GET",
        "/v1/sandboxes/sb-1/processes/p-1/output",
        ndjson(
            {"type": "attached", "offset": 0},
            {"type": "stdout", "data_b64": b64(b"x")},
            {"type": "exit", "exit_code": 0},
        ),
    )
    server.on("GET", "/v1/sandboxes/sb-1/files/watch", ndjson({"type": "changes", "changes": []}))

    async def chunks() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"cd"

    async def scenario(sp: AsyncSpace) -> list[Any]:
        sb = sp.sandboxes.ref("sb-1")
        out: list[Any] = [await sb.files.write("/w/a", chunks()), await sb.files.write("/w/b", b"xyz")]
        out.append(await sb.files.read("/w/a"))
        out.append(b"".join([c async for c in sb.files.read_stream("/w/a")]))
        out.append(await sb.files.list("/w"))
        proc = await sb.processes.start("sleep 1")
        out.append([e.type async for e in proc.attach()])
        out.append((await proc.wait()).stdout)
        out.append([e["type"] async for e in sb.files.watch("/w")])
        return out

    assert run(scenario, server) == [
        4,
        3,
        b"payload",
        b"payload",
        [{"name": "a"}],
        ["attached", "stdout", "exit"],
        "x",
        ["changes"],
    ]


def test_async_streamed_upload_is_lazy(server: FakeServer) -> None:
    produced: list[int] = []
    seen: list[tuple[int, int]] = []

    class LazyAsyncTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "GET":
                return httpx.Response(200, json=sandbox_json())
            total = 0
            async for chunk in request.stream:  # type: ignore[union-attr]
                total += len(chunk)
                seen.append((len(produced), total))
            return httpx.Response(200, json={"size": total})

    def chunks() -> Any:
        for i in range(3):
            produced.append(i)
            yield b"z" * 100

    async def scenario(sp: AsyncSpace) -> int:
        return await sp.sandboxes.ref("sb-1").files.write("/w/big", chunks())

    assert run(scenario, server, transport=LazyAsyncTransport()) == 300
    assert seen == [(1, 100), (2, 200), (3, 300)]


def test_async_errors_and_retries(server: FakeServer) -> None:
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/resume",
        error_response(409, "invalid_state", "no", state="running"),
    )
    server.on("GET", "/v1/sandboxes/sb-404", error_response(404, "not_found", "gone"))

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    server.on(
        "GET",
        "/v1/sandboxes",
        refused,
        error_response(503, "unavailable", "x"),
        httpx.Response(200, json={"sandboxes": []}),
    )
    rate = error_response(429, "resource_exhausted", "slow")
    server.on("GET", "/v1/projects", rate)
    server.on("POST", "/v1/projects", refused)

    async def scenario(sp: AsyncSpace) -> None:
        with pytest.raises(core_errors.InvalidState) as info:
            await sp.sandboxes.ref("sb-1").resume()
        assert info.value.state == "running"
        with pytest.raises(core_errors.NotFound):
            await sp.sandboxes.get("sb-404")
        assert await sp.sandboxes.list() == []
        with pytest.raises(RateLimited):
            await sp.projects.list()
        with pytest.raises(TransportError):
            await sp.projects.create("p")

    run(scenario, server, max_retries=2)
    posts = [r for r in server.requests if r.method == "POST" and r.url.path == "/v1/projects"]
    assert len(posts) == 3 and len({p.headers["Idempotency-Key"] for p in posts}) == 1
