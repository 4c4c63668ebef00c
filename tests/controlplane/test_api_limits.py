"""Resource bounds of the public API, attacked over real HTTP against real control-plane processes (ADR 0025).

- Heads: an endless request head (header lines that never end) is refused (400) once it passes the
  HTTP/1.1 parser's 16 KiB bound, and the connection closed (ADR 0083: why the servers keep that parser).
- Bodies: an unauthenticated 100 MB body is refused (401) before the server reads it; a Content-Length
  over a route's limit is a 413 at once; an endless chunked body is cut at the limit (413); node-facing
  routes get the size limit without the API-key check.
- Per key: a token bucket of requests (429 + Retry-After, other keys unaffected, the SDK waits and
  retries), a cap on concurrent streams (429 beyond it), a slow reader cut off after the stall timeout.
- Pools: with more than 100 tenant streams open to one node (the old shared pool's size), another tenant's
  exec and a lifecycle call still answer at once; a quiet stream is closed after the data pool's idle
  timeout; a JSON answer over the gateway's cap is refused with a clear error.
- Processes: the control plane and the node agent run with the soft open-file limit raised to the hard one.
- Retention: old idempotency records and audit entries are deleted in bounded batches, new ones kept, on
  SQLite and PostgreSQL.

The shared fake cluster's control plane runs with the default limits; `limited` is a second control-plane
process on the same database and node with small limits (LIMITED_ENV), so that they are reached quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import sqlalchemy as sa

from space.controlplane import retention
from space.controlplane.store.credentials import AuditEntry, CredentialStore
from space.controlplane.store.engine import make_engine, sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.models import Base
from space.controlplane.store.store import Store
from space.sdk import Space
from tests.support import cluster as c
from tests.support import postgres as pg_support

fake_cluster = c.fake_cluster
project = c.project
postgres_url = pg_support.postgres_url

MIB = 1 << 20
DEFAULT_STREAMS_PER_KEY = 32  # limits.LimitSettings.streams_per_key
LIMITED_ENV = {
    "SPACE_API_REQUESTS_PER_S": "2",
    "SPACE_API_REQUEST_BURST": "6",
    "SPACE_API_STREAMS_PER_KEY": "3",
    "SPACE_API_SEND_STALL_S": "2",
    "SPACE_API_UPLOAD_BODY_BYTES": str(4 * MIB),
    "SPACE_NODE_POOL_DATA_IDLE_S": "3",
    "SPACE_NODE_POOL_DATA_MAX_JSON_BYTES": str(64 * 1024),
}


# -- raw HTTP (to see what the server does while a body is still being sent) ---------------------------------
def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, target: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP/1.1 answer with a Content-Length."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    raw_head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the answer"
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def send_until_refused(sock: socket.socket, chunk: bytes, *, limit: int, seconds: float) -> int:
    """Send `chunk` over and over until the server answers (the socket becomes readable) or breaks the
    connection, at most `limit` bytes and `seconds`; the number of bytes sent."""
    sent = 0
    deadline = time.monotonic() + seconds
    sock.setblocking(False)
    try:
        while sent < limit and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 0.5)
            if readable:
                break
            if writable:
                try:
                    sent += sock.send(chunk)
                except BlockingIOError:
                    continue
                except OSError:
                    break
    finally:
        sock.setblocking(True)
    return sent


def error_code(answer: httpx.Response) -> str:
    return str(answer.json()["error"]["code"])


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(fake_cluster: c.Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.ControlPlane]:
    """A second control plane on the shared cluster's database and node, with small limits; started with
    a low soft open-file limit (inherited), which it must raise at start."""
    root = tmp_path_factory.mktemp("limited-cp")
    cp = c.ControlPlane(root, fake_cluster.token_file, database_url=fake_cluster.database_url, name="limited")
    cp.extra_env = dict(LIMITED_ENV)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        cp.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        c.wait_for(cp.healthy, timeout=c.START_TIMEOUT_S, interval=0.1, what="limited control plane healthy")
        yield cp
    finally:
        cp.stop(timeout=5)


def limited_http(cp: c.ControlPlane, key: str | None, **kw: Any) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=cp.url, headers=headers, timeout=kw.pop("timeout", 60.0), verify=False, **kw)


def running_sandbox(made: c.Project) -> str:
    with made.sdk() as sp:
        return sp.sandboxes.create(limits=c.SMALL).id


# -- heads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("server", ["control-plane", "node-rpc"])
def test_an_endless_request_head_is_refused_and_its_connection_closed(
    fake_cluster: c.Cluster, server: str
) -> None:
    url = fake_cluster.url if server == "control-plane" else f"http://127.0.0.1:{fake_cluster.node.port}"
    sock = connect(url)
    with sock:
        sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sent = send_until_refused(sock, b"X-Pad: " + b"a" * 1017 + b"\r\n", limit=256 * MIB, seconds=30)
        status, headers, body = read_answer(sock, timeout=10)
        assert status == 400, body
        assert headers.get("connection") == "close", headers
        more = send_until_refused(sock, b"X-Pad: b\r\n" * 1024, limit=64 * MIB, seconds=10)
    # Bounded by the parser's 16 KiB and the sockets' buffers, not by the attacker.
    assert sent < 8 * MIB, f"the server read {sent} bytes of one request head"
    assert more < 8 * MIB, f"the server accepted {more} more bytes after refusing the head"


# -- bodies --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "target"),
    [("POST", "/v1/sandboxes"), ("PUT", f"/v1/sandboxes/sb-{'a' * 26}/files?path=big")],
    ids=["json-route", "upload-route"],
)
def test_an_unauthenticated_body_is_refused_before_it_is_read(
    fake_cluster: c.Cluster, method: str, target: str
) -> None:
    announced = 100 * MIB
    sock = connect(fake_cluster.url)
    with sock:
        sock.sendall(head(method, target, {"Content-Length": str(announced)}) + b"x" * 1024)
        # The answer comes while 99.99% of the body is still unsent: the server did not wait for it.
        status, headers, body = read_answer(sock, timeout=10)
        assert status == 401, body
        assert headers.get("connection") == "close", headers
        assert b'"unauthenticated"' in body
        # ... and it closes the connection instead of reading (and discarding) the rest.
        more = send_until_refused(sock, b"x" * 65536, limit=announced, seconds=20)
    assert more < 32 * MIB, f"the server accepted {more} more bytes of a refused body"


def test_a_body_over_the_limit_is_refused_by_its_length(fake_cluster: c.Cluster, project: c.Project) -> None:
    sock = connect(fake_cluster.url)
    with sock:
        sock.sendall(
            head("POST", "/v1/sandboxes", {
                "Authorization": f"Bearer {project.key}", "Content-Type": "application/json",
                "Content-Length": str(2 * MIB),
            }) + b'{"template": "'
        )  # fmt: skip
        status, headers, body = read_answer(sock, timeout=10)
    assert status == 413, body
    assert b'"too_large"' in body and headers.get("connection") == "close"
    assert fake_cluster.store.list_sandboxes(project.id) == []
    # The same on a data-plane JSON route (exec), with a valid request's start.
    sandbox_id = running_sandbox(project)
    sock = connect(fake_cluster.url)
    with sock:
        sock.sendall(
            head("POST", f"/v1/sandboxes/{sandbox_id}/exec", {
                "Authorization": f"Bearer {project.key}", "Content-Type": "application/json",
                "Content-Length": str(MIB + 1),
            }) + b'{"cmd": "true", "env": {"BIG": "'
        )  # fmt: skip
        status, _headers, body = read_answer(sock, timeout=10)
    assert status == 413 and b'"too_large"' in body, body


def endless_chunked(url: str, method: str, target: str, headers: dict[str, str]) -> tuple[int, bytes, int]:
    """Send a chunked body that never ends (64 KiB chunks, bounded here at 256 MiB and 60 s) until the
    server answers: (status, body, bytes sent)."""
    sock = connect(url)
    with sock:
        sock.sendall(head(method, target, {**headers, "Transfer-Encoding": "chunked"}))
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"  # 64 KiB (of JSON whitespace)
        sent = send_until_refused(sock, chunk, limit=256 * MIB, seconds=60)
        status, _headers, body = read_answer(sock, timeout=10)
    return status, body, sent


def test_an_endless_chunked_body_is_cut_at_the_limit(fake_cluster: c.Cluster, project: c.Project) -> None:
    status, body, sent = endless_chunked(
        fake_cluster.url, "POST", "/v1/sandboxes",
        {"Authorization": f"Bearer {project.key}", "Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 413 and b'"too_large"' in body, body
    assert sent < 64 * MIB, f"{sent} bytes were taken before the cut"
    assert fake_cluster.store.list_sandboxes(project.id) == []


def test_an_endless_chunked_upload_is_cut_at_the_upload_limit(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    sandbox_id = running_sandbox(project)
    status, body, sent = endless_chunked(
        limited.url, "PUT", f"/v1/sandboxes/{sandbox_id}/files?path=endless",
        {"Authorization": f"Bearer {project.key}", "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert status == 413 and b'"too_large"' in body, body
    assert str(4 * MIB).encode() in body  # the upload limit of the limited control plane
    assert sent < 64 * MIB, f"{sent} bytes were taken before the cut"


def test_node_facing_routes_get_the_size_limit_not_the_key_check(fake_cluster: c.Cluster) -> None:
    sock = connect(fake_cluster.url)
    with sock:
        sock.sendall(
            head(
                "POST",
                "/v1/nodes/register",
                {"Content-Type": "application/json", "Content-Length": str(8 * MIB)},
            )
            + b"{"
        )
        status, _headers, body = read_answer(sock, timeout=10)
    assert status == 413, body
    # Within the limit, the route's own check answers (the bootstrap token, not an API key).
    answer = fake_cluster.http().post("/v1/nodes/register", json={"url": "http://127.0.0.1:1"})
    assert answer.status_code == 401 and "node token" in answer.json()["error"]["message"], answer.text


# -- per-key rate and stream limits --------------------------------------------------------------------------
def test_a_key_over_its_rate_gets_429_with_retry_after(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    _id, noisy = project.new_key("read-only")
    _id, quiet = project.new_key("read-only")
    with limited_http(limited, noisy) as client, limited_http(limited, quiet) as other:
        started = time.monotonic()
        answers = []
        for _ in range(60):
            answers.append(client.get("/v1/sandboxes"))
            if answers[-1].status_code != 200:
                break
        elapsed = time.monotonic() - started
        statuses = [a.status_code for a in answers]
        # The burst (6), plus what refilled at 2/s meanwhile, then a 429.
        assert 6 <= statuses.count(200) <= 6 + 2 * elapsed + 1 and statuses[-1] == 429, (statuses, elapsed)
        refused = answers[-1]
        assert error_code(refused) == "resource_exhausted", refused.text
        assert int(refused.headers["retry-after"]) >= 1, refused.headers
        # Another key of the same project is not affected.
        assert other.get("/v1/sandboxes").status_code == 200
        # After the time the server named, the noisy key works again.
        time.sleep(int(refused.headers["retry-after"]))
        assert client.get("/v1/sandboxes").status_code == 200
    # The SDK waits as told and retries: the caller sees no error.
    with Space(url=limited.url, api_key=noisy, transport=httpx.HTTPTransport(verify=False)) as sp:
        started = time.monotonic()
        for _ in range(12):
            sp.sandboxes.list()
        assert time.monotonic() - started >= 2.0  # 12 requests at 2/s after a burst of 6 cannot be faster


def test_a_key_cannot_hold_more_than_its_streams_and_others_still_get_through(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    """A read-only key asks for 100 output streams: it gets its cap, the rest are 429. Three more keys
    bring the open streams to the node to 104 (more than the single pool shared by everyone used to hold),
    and another tenant's exec and a lifecycle call still answer at once. (Two sandboxes: the node allows
    64 calls per sandbox channel.)"""
    sleepers = []
    with project.sdk() as sp:
        for _ in range(2):
            sb = sp.sandboxes.create(limits=c.SMALL)
            sleepers.append((sb.id, sb.processes.start("sleep 600").id))
    other = c.new_project(fake_cluster)
    victim_id = running_sandbox(other)
    keys = [project.new_key("read-only")[1] for _ in range(4)]
    paths = [f"/v1/sandboxes/{sb_id}/processes/{pid}/output" for sb_id, pid in sleepers]
    path = paths[0]
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    opened: list[httpx.Response] = []
    clients = [project.cluster.http(key, limits=limits, timeout=30) for key in keys]
    try:
        first = clients[0]
        refused = []
        for _ in range(100):
            answer = first.send(first.build_request("GET", path, params={"follow": "true"}), stream=True)
            if answer.status_code == 200:
                opened.append(answer)
            else:
                answer.read()
                answer.close()
                refused.append(answer)
        assert len(opened) == DEFAULT_STREAMS_PER_KEY, [a.status_code for a in refused][:5]
        assert len(refused) == 100 - DEFAULT_STREAMS_PER_KEY
        for answer in refused:
            assert answer.status_code == 429 and error_code(answer) == "resource_exhausted", answer.text
            assert "retry-after" in answer.headers
        for client, count, target in (
            (clients[1], 32, paths[0]),
            (clients[2], 32, paths[1]),
            (clients[3], 8, paths[1]),
        ):
            for _ in range(count):
                request = client.build_request("GET", target, params={"follow": "true"})
                answer = client.send(request, stream=True)
                assert answer.status_code == 200, answer.read()
                opened.append(answer)
        assert len(opened) == 104
        with other.sdk() as victim_sdk:
            victim = victim_sdk.sandboxes.get(victim_id)
            started = time.monotonic()
            assert victim.exec("echo still-here").stdout.strip() == "still-here"
            exec_s = time.monotonic() - started
            started = time.monotonic()
            assert victim.pause().state == "paused"
            assert victim.resume().state == "running"
            lifecycle_s = time.monotonic() - started
        assert exec_s < 5.0, f"another tenant's exec took {exec_s:.1f}s with 104 streams open"
        assert lifecycle_s < 20.0, f"pause + resume took {lifecycle_s:.1f}s with 104 streams open"
    finally:
        for answer in opened:
            answer.close()
    # Closed streams give their slots back.
    c.wait_for(lambda: _opens(clients[0], path), timeout=15, what="a stream slot is free again after closing")
    with project.sdk() as sp:
        for sb_id, pid in sleepers:
            sp.sandboxes.get(sb_id).processes.signal(pid, "SIGKILL")
    c.delete_all(fake_cluster, other)


def _opens(client: httpx.Client, path: str) -> bool:
    with client.stream("GET", path, params={"follow": "false"}) as answer:
        answer.read()
        return answer.status_code == 200


def test_a_slow_reader_is_cut_off_and_does_not_stall_other_tenants(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    size = 48 * MIB
    blob = os.urandom(MIB) * 48
    with project.sdk() as sp:
        slow_sb = sp.sandboxes.create(limits=c.SMALL)
        slow_sb.files.write("big.bin", blob)
    other = c.new_project(fake_cluster)
    try:
        with other.sdk() as sp:
            fast_sb = sp.sandboxes.create(limits=c.SMALL)
            fast_sb.files.write("big.bin", blob)
        _id, slow_key = project.new_key("read-only")
        stalled = []
        for _ in range(3):  # the limited control plane's stream cap
            sock = connect(limited.url)
            sock.sendall(
                head(
                    "GET",
                    f"/v1/sandboxes/{slow_sb.id}/files?path=big.bin",
                    {"Authorization": f"Bearer {slow_key}"},
                )
            )
            stalled.append(sock)  # ... and never read
        try:
            with limited_http(limited, slow_key) as slow:
                c.wait_for(
                    lambda: (
                        slow.get(
                            f"/v1/sandboxes/{slow_sb.id}/files/stat", params={"path": "big.bin"}
                        ).status_code
                        == 200
                    ),
                    timeout=10,
                    interval=0.6,
                    what="the slow key's short calls still work",
                )
                with slow.stream(
                    "GET", f"/v1/sandboxes/{slow_sb.id}/files", params={"path": "big.bin"}
                ) as fourth:
                    fourth.read()
                    assert fourth.status_code == 429, fourth.text
            # Another tenant downloads the whole file at full speed meanwhile.
            with limited_http(limited, other.key) as fast:
                started = time.monotonic()
                with fast.stream(
                    "GET", f"/v1/sandboxes/{fast_sb.id}/files", params={"path": "big.bin"}
                ) as answer:
                    assert answer.status_code == 200
                    got = sum(len(chunk) for chunk in answer.iter_raw())
                took = time.monotonic() - started
            assert got == size
            assert took < 15.0, f"another tenant's 48 MiB download took {took:.1f}s beside a slow reader"
            # The stalled responses are cut after SPACE_API_SEND_STALL_S: their slots come back.
            with limited_http(limited, slow_key) as slow:
                c.wait_for(
                    lambda: _download_starts(slow, f"/v1/sandboxes/{slow_sb.id}/files"),
                    timeout=30,
                    interval=1.0,
                    what="the slow reader's stream slots freed after the stall timeout",
                )
        finally:
            for sock in stalled:
                sock.close()
    finally:
        c.delete_all(fake_cluster, other)


def _download_starts(client: httpx.Client, path: str) -> bool:
    with client.stream("GET", path, params={"path": "big.bin", "length": 16}) as answer:
        answer.read()
        return answer.status_code == 200


def test_a_quiet_stream_is_closed_after_the_idle_timeout(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        process = sb.processes.start("sleep 600")
    with limited_http(limited, project.key, timeout=60) as client:
        started = time.monotonic()
        ended_by: str = "end of stream"
        path = f"/v1/sandboxes/{sb.id}/processes/{process.id}/output"
        with client.stream("GET", path, params={"follow": "true"}) as answer:
            assert answer.status_code == 200
            try:
                for _chunk in answer.iter_raw():
                    pass
            except httpx.HTTPError as exc:
                ended_by = repr(exc)
        took = time.monotonic() - started
    # SPACE_NODE_POOL_DATA_IDLE_S = 3: not before, and not much after (the process still runs).
    assert 2.5 <= took < 20.0, f"the quiet stream ended after {took:.1f}s ({ended_by})"
    with project.sdk() as sp:
        sp.sandboxes.get(sb.id).processes.signal(process.id, "SIGKILL")


def test_a_json_answer_over_the_gateway_cap_is_refused(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.exec("mkdir many && cd many && for i in $(seq 1 3000); do : > file-with-a-long-name-$i; done")
    with limited_http(limited, project.key) as client:
        answer = client.get(f"/v1/sandboxes/{sb.id}/files/list", params={"path": "many"})
        assert answer.status_code == 413 and error_code(answer) == "too_large", answer.text
        assert "JSON answer exceeds 65536 bytes" in answer.json()["error"]["message"]
        # A small answer through the same pool is fine.
        assert client.get(f"/v1/sandboxes/{sb.id}/files/stat", params={"path": "many"}).status_code == 200


# -- processes -----------------------------------------------------------------------------------------------
def _soft_and_hard_nofile(pid: int) -> tuple[str, str]:
    for line in pathlib.Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


def test_the_control_plane_raises_its_open_file_limit(limited: c.ControlPlane) -> None:
    soft, hard = _soft_and_hard_nofile(limited.pid)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[1] == int(hard)
    assert soft == hard, f"started with a soft limit of 256, runs with {soft} (hard {hard})"


def test_the_node_agent_raises_its_open_file_limit(tmp_path: pathlib.Path) -> None:
    port = c.free_port()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    agent = subprocess.Popen(
        ["prlimit", "--nofile=256:", sys.executable, "-m", "space.node.agent.server", "--driver", "fake",
         "--data-dir", str(tmp_path / "node"), "--listen", f"127.0.0.1:{port}", "--log-level", "warning"],
        env=c._child_env(), cwd=c.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def listening() -> bool:
            assert agent.poll() is None, agent.stderr.read() if agent.stderr else b""
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
            return False

        c.wait_for(listening, timeout=60, interval=0.1, what="node agent listening")
        agent_soft, agent_hard = _soft_and_hard_nofile(agent.pid)
        assert agent_soft == agent_hard == str(hard), (agent_soft, agent_hard)
    finally:
        agent.terminate()
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


# -- retention (SQLite and PostgreSQL) -----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> Any:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.root)])
def retention_store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[tuple[Store, Clock]]:
    sqlite = request.param == "sqlite"
    url = sqlite_url(tmp_path) if sqlite else str(request.getfixturevalue("postgres_url"))
    migrate(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            names = [t.name for t in reversed(Base.metadata.sorted_tables)]
            if request.param == "postgresql":
                conn.execute(sa.text(f"TRUNCATE {', '.join(names)}"))
    finally:
        engine.dispose()
    clock = Clock()
    with Store(url, clock=clock) as store:
        yield store, clock


def test_retention_deletes_old_rows_only_in_bounded_batches(retention_store: tuple[Store, Clock]) -> None:
    store, clock = retention_store
    small = retention.RetentionSettings(batch=100)  # small batches, so that a run needs several
    org = store.create_org("acme")
    audit = CredentialStore(store)
    entry = AuditEntry(org_id=org.id, action="credential_used", actor="key:test")
    for i in range(250):
        store.begin_idempotent("key-old", f"k{i}", "h" * 64)
    audit.audit([entry] * 250)
    clock.advance(31 * 24 * 3600)  # older than both retentions
    for i in range(3):
        store.begin_idempotent("key-new", f"k{i}", "h" * 64)
        store.finish_idempotent("key-new", f"k{i}", 201, {"i": i})
    audit.audit([entry] * 3)
    clock.advance(60)

    # One batch at a time: bounded, oldest first.
    assert store.purge_idempotency(24 * 3600, limit=100) == 100
    assert audit.purge_audit(30 * 24 * 3600, limit=100) == 100
    # A housekeeping run works off the rest in batches and keeps the new rows.
    removed = asyncio.run(retention.purge_expired(store, small))
    assert removed == {"idempotency_records": 150, "credential_audit": 150}
    for i in range(3):
        begun = store.begin_idempotent("key-new", f"k{i}", "h" * 64)
        assert (begun.outcome, begun.body) == ("replay", {"i": i})
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM credential_audit")).scalar() == 3
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_records")).scalar() == 3
    # Nothing is old enough now; a day later the records go, the audit entries stay.
    assert asyncio.run(retention.purge_expired(store)) == {"idempotency_records": 0, "credential_audit": 0}
    clock.advance(24 * 3600)
    assert asyncio.run(retention.purge_expired(store)) == {"idempotency_records": 3, "credential_audit": 0}


@pytest.mark.root
def test_the_root_helper_raises_its_open_file_limit(tmp_path: pathlib.Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the node helper runs as root; CI runs as root")
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-helper-", dir="/var/tmp"))
    socket_path = data_dir / "helper.sock"
    helper = subprocess.Popen(
        ["prlimit", "--nofile=256:", sys.executable, "-m", "space.node.helper.server",
         "--data-dir", str(data_dir), "--agent-user", "0", "--socket", str(socket_path), "--network", "none"],
        env=c._child_env(), cwd=c.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def ready() -> bool:
            assert helper.poll() is None, helper.stderr.read() if helper.stderr else b""
            return socket_path.exists()

        c.wait_for(ready, timeout=60, interval=0.1, what="node helper listening")
        soft, hard = _soft_and_hard_nofile(helper.pid)
        assert soft == hard == str(resource.getrlimit(resource.RLIMIT_NOFILE)[1]), (soft, hard)
    finally:
        helper.terminate()
        try:
            helper.wait(20)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait(10)
        shutil.rmtree(data_dir, ignore_errors=True)
    assert not socket_path.exists()


def test_pty_sessions_count_against_the_stream_cap(
    fake_cluster: c.Cluster, project: c.Project, limited: c.ControlPlane
) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    sandbox_id = running_sandbox(project)
    url = limited.url.replace("http://", "ws://") + f"/v1/sandboxes/{sandbox_id}/pty?cmd=/bin/sh"
    headers = {"Authorization": f"Bearer {project.key}"}
    with contextlib.ExitStack() as stack:
        for _ in range(3):  # the limited control plane's stream cap
            stack.enter_context(ws_connect(url, additional_headers=headers, open_timeout=20, close_timeout=2))
            time.sleep(0.5)  # within the key's request rate (2/s)
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(url, additional_headers=headers, open_timeout=20, close_timeout=2)
        answer = refused.value.response
        assert answer.status_code == 429, answer
        assert int(answer.headers["Retry-After"]) >= 1
        assert b"resource_exhausted" in answer.body
    # All closed: a new PTY opens again.
    time.sleep(1.0)
    with ws_connect(url, additional_headers=headers, open_timeout=20, close_timeout=2) as ws:
        ws.send(b"echo pty-$((40+2))\n")
        seen = b""
        deadline = time.monotonic() + 20
        while b"pty-42" not in seen and time.monotonic() < deadline:
            message = ws.recv(timeout=20)
            seen += message if isinstance(message, bytes) else b""
        assert b"pty-42" in seen, seen
