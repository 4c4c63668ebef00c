"""The sync SDK against httpx.MockTransport: request shapes, error mapping, retries, streaming, config."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space.core import errors as core_errors
from space.sdk import (
    ConfigurationError,
    ExecResult,
    RateLimited,
    Sandbox,
    Snapshot,
    Space,
    TransportError,
    resolve_config,
    write_config_file,
)
from space.sdk.errors import error_from_response
from tests.support.sdk_server import (
    KEY,
    URL,
    FakeServer,
    LazyMockTransport,
    b64,
    error_response,
    ndjson,
    sandbox_json,
)


def lazy_client(server: FakeServer) -> Space:
    return Space(url=URL, api_key=KEY, transport=LazyMockTransport(server), retry_backoff=0)


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def sp(server: FakeServer) -> Iterator[Space]:
    client = Space(url=URL, api_key=KEY, transport=httpx.MockTransport(server), retry_backoff=0)
    yield client
    client.close()


def make_sandbox(sp: Space, server: FakeServer, sandbox_id: str = "sb-1") -> Sandbox:
    server.on("GET", f"/v1/sandboxes/{sandbox_id}", httpx.Response(200, json=sandbox_json(sandbox_id)))
    return sp.sandboxes.get(sandbox_id)


# ---- package surface ---------------------------------------------------------------------------------


def test_space_package_imports_the_sdk_lazily() -> None:
    code = (
        "import sys, space\n"
        "assert 'httpx' not in sys.modules and 'space.sdk' not in sys.modules, sorted(sys.modules)\n"
        "from space import Space, AsyncSpace\n"
        "import space.sdk\n"
        "assert Space is space.sdk.Space and AsyncSpace is space.sdk.AsyncSpace\n"
        "try:\n    space.nothing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sdk_errors_are_core_error_classes() -> None:
    assert issubclass(TransportError, core_errors.Unavailable)
    assert issubclass(RateLimited, core_errors.ResourceExhausted)
    assert issubclass(ConfigurationError, core_errors.SpaceError)


# ---- configuration -----------------------------------------------------------------------------------


def test_config_arguments_win_over_environment_and_file(tmp_path: Path) -> None:
    path = write_config_file("http://file:1", "file-key", tmp_path / "config.json")
    env = {"SPACE_URL": "http://env:2", "SPACE_API_KEY": "env-key", "SPACE_CONFIG": str(path)}
    config = resolve_config("http://arg:3/", "arg-key", env=env)
    assert (config.url, config.api_key, config.source) == ("http://arg:3", "arg-key", "arguments")


def test_config_environment_wins_over_file(tmp_path: Path) -> None:
    path = write_config_file("http://file:1", "file-key", tmp_path / "config.json")
    env = {"SPACE_URL": "http://env:2", "SPACE_API_KEY": "env-key", "SPACE_CONFIG": str(path)}
    config = resolve_config(env=env)
    assert (config.url, config.api_key, config.source) == ("http://env:2", "env-key", "environment")


def test_config_file_from_space_config_path(tmp_path: Path) -> None:
    path = write_config_file("http://file:1", "file-key", tmp_path / "elsewhere.json")
    assert path.stat().st_mode & 0o777 == 0o600
    config = resolve_config(env={"SPACE_CONFIG": str(path)})
    assert (config.url, config.api_key, config.source) == ("http://file:1", "file-key", str(path))


def test_config_default_file_under_home(tmp_path: Path) -> None:
    target = tmp_path / ".config" / "space" / "config.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({"url": "http://home:4", "api_key": "home-key"}))
    config = resolve_config(env={"HOME": str(tmp_path)})
    assert (config.url, config.api_key) == ("http://home:4", "home-key")


def test_config_file_key_is_not_sent_to_another_url(tmp_path: Path) -> None:
    path = write_config_file("http://file:1", "file-key", tmp_path / "config.json")
    config = resolve_config(env={"SPACE_URL": "http://other:9", "SPACE_CONFIG": str(path)})
    assert (config.url, config.api_key) == ("http://other:9", None)
    same = resolve_config(env={"SPACE_URL": "http://file:1/", "SPACE_CONFIG": str(path)})
    assert same.api_key == "file-key"


def test_config_missing_or_broken_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        resolve_config(env={"SPACE_CONFIG": str(tmp_path / "missing.json")})
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigurationError):
        resolve_config(env={"SPACE_CONFIG": str(broken)})
    with pytest.raises(ConfigurationError):
        resolve_config("ftp://x", env={})


def test_space_reads_the_environment(monkeypatch: pytest.MonkeyPatch, server: FakeServer) -> None:
    monkeypatch.setenv("SPACE_URL", URL)
    monkeypatch.setenv("SPACE_API_KEY", "from-env")
    server.on("GET", "/v1/sandboxes", httpx.Response(200, json={"sandboxes": []}))
    with Space(transport=httpx.MockTransport(server)) as client:
        assert client.sandboxes.list() == []
    assert server.last().headers["Authorization"] == "Bearer from-env"


# ---- sandboxes ---------------------------------------------------------------------------------------


def test_create_request_shape(sp: Space, server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-new")))
    sb = sp.sandboxes.create(template="python", env={"K": "V"})
    assert (sb.id, sb.state) == ("sb-new", "running")
    request = server.last()
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.headers["Idempotency-Key"]
    assert server.body() == {"template": "python", "env": {"K": "V"}, "wait": True}


def test_create_with_every_option(sp: Space, server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json()))
    sp.sandboxes.create(
        template="node",
        limits={"cpus": 2.0, "memory_mb": 1024},
        idle_timeout_s=60,
        ttl_s=3600,
        allow=["pkg.test", "10.0.0.0/8"],
        credentials=["github"],
        idempotency_key="my-key",
    )
    assert server.last().headers["Idempotency-Key"] == "my-key"
    assert server.body() == {
        "template": "node",
        "env": {},
        "limits": {"cpus": 2.0, "memory_mb": 1024},
        "idle_timeout_s": 60,
        "ttl_s": 3600,
        "allow": ["pkg.test", "10.0.0.0/8"],
        "credentials": ["github"],
        "wait": True,
    }


def test_get_list_refresh_and_data(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    assert sb.data["project_id"] == "prj-1"
    assert "Idempotency-Key" not in server.last().headers
    server.on(
        "GET",
        "/v1/sandboxes",
        httpx.Response(200, json={"sandboxes": [sandbox_json("a"), sandbox_json("b")]}),
    )
    assert [s.id for s in sp.sandboxes.list()] == ["a", "b"]
    server.on("GET", "/v1/sandboxes/sb-1", httpx.Response(200, json=sandbox_json(state="paused")))
    assert sb.refresh() is sb and sb.state == "paused"


@pytest.mark.parametrize("action", ["pause", "resume", "stop", "start", "suspend", "restore"])
def test_lifecycle_actions_wait_and_refresh(sp: Space, server: FakeServer, action: str) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST", f"/v1/sandboxes/sb-1/{action}", httpx.Response(200, json=sandbox_json(state=action + "d"))
    )
    assert getattr(sb, action)() is sb
    assert sb.state == action + "d"
    assert server.last().url.params["wait"] == "true"
    assert server.last().headers["Idempotency-Key"]


def test_delete(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("DELETE", "/v1/sandboxes/sb-1", httpx.Response(202, json=sandbox_json(state="deleting")))
    sb.delete()
    assert sb.state == "deleting"


def test_ids_are_quoted_into_one_path_segment(sp: Space, server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/a%2F..%2Fb", httpx.Response(200, json=sandbox_json("a/../b")))
    sp.sandboxes.get("a/../b")
    assert server.last().url.raw_path == b"/v1/sandboxes/a%2F..%2Fb"


def test_fork_one_and_many(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST", "/v1/sandboxes/sb-1/fork", httpx.Response(201, json={"sandboxes": [sandbox_json("sb-c1")]})
    )
    child = sb.fork()
    assert isinstance(child, Sandbox) and child.id == "sb-c1"
    assert server.body() == {"count": 1}
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/fork",
        httpx.Response(201, json={"sandboxes": [sandbox_json("sb-c2"), sandbox_json("sb-c3")]}),
    )
    children = sb.fork(count=2)
    assert [c.id for c in children] == ["sb-c2", "sb-c3"]
    assert server.body() == {"count": 2}


def test_snapshots_and_rollback(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    snap_json = {"id": "snap-1", "sandbox_id": "sb-1", "kind": "full", "created_at": "t", "size_bytes": 10}
    server.on("POST", "/v1/sandboxes/sb-1/snapshots", httpx.Response(201, json=snap_json))
    snap = sb.snapshots.create(full=True)
    assert isinstance(snap, Snapshot)
    assert (snap.id, snap.kind, snap["size_bytes"], snap.size_bytes) == ("snap-1", "full", 10, 10)
    assert server.body() == {"full": True}
    server.on("GET", "/v1/sandboxes/sb-1/snapshots", httpx.Response(200, json={"snapshots": [snap_json]}))
    assert [s.id for s in sb.snapshots.list()] == ["snap-1"]
    server.on("POST", "/v1/sandboxes/sb-1/rollback", httpx.Response(200, json=sandbox_json(generation=9)))
    assert sb.rollback(snap) is sb
    assert server.body() == {"snapshot_id": "snap-1"}
    sb.rollback("snap-2")
    assert server.body() == {"snapshot_id": "snap-2"}
    assert sb.data["generation"] == 9


# ---- exec --------------------------------------------------------------------------------------------


def exec_answer(exit_code: int = 0, stdout: bytes = b"", stderr: bytes = b"") -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "exit_code": exit_code,
            "stdout_b64": b64(stdout),
            "stderr_b64": b64(stderr),
            "stdout": stdout.decode(errors="replace"),
            "stderr": stderr.decode(errors="replace"),
            "process_id": "p-1",
            "timed_out": False,
        },
    )


def test_exec_shell_string(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_answer(0, b"hi\n", b"\xff oops"))
    result = sb.exec("echo hi")
    assert server.body() == {"cmd": "echo hi", "stream": False}
    assert (result.exit_code, result.stdout, result.stdout_bytes) == (0, "hi\n", b"hi\n")
    assert result.stderr_bytes == b"\xff oops" and result.stderr == "\ufffd oops"
    assert result.ok and result.process_id == "p-1"


def test_exec_argv_and_options(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_answer(3))
    result = sb.exec(["ls", "-la"], env={"A": "1"}, cwd="/work", user="root", timeout=5, stdin=b"in")
    assert result.exit_code == 3 and not result.ok
    assert server.body() == {
        "argv": ["ls", "-la"],
        "env": {"A": "1"},
        "cwd": "/work",
        "user": "root",
        "timeout": 5,
        "stdin_b64": b64(b"in"),
        "stream": False,
    }


def test_exec_rejects_empty_commands(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    with pytest.raises(core_errors.InvalidArgument):
        sb.exec([])
    with pytest.raises(core_errors.InvalidArgument):
        sb.exec("")


def test_exec_result_falls_back_to_text_fields() -> None:
    result = ExecResult.from_wire({"exit_code": 0, "stdout": "text", "stderr": None})
    assert (result.stdout_bytes, result.stderr_bytes) == (b"text", b"")


def test_exec_stream_callbacks(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/exec",
        ndjson(
            {"type": "started", "process_id": "p-9"},
            {"type": "stdout", "data_b64": b64(b"one ")},
            {"type": "stderr", "data_b64": b64(b"warn")},
            {"type": "stdout", "data_b64": b64(b"two")},
            {"type": "exit", "exit_code": 4, "signal": None, "timed_out": False},
        ),
    )
    out: list[bytes] = []
    started: list[str] = []
    result = sb.exec_stream("x", on_stdout=out.append, on_started=started.append)
    assert server.body()["stream"] is True
    assert out == [b"one ", b"two"] and started == ["p-9"]
    assert result.exit_code == 4 and result.process_id == "p-9"
    assert result.stdout_bytes == b"" and result.stderr_bytes == b"warn"


def test_exec_stream_without_exit_is_an_error(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("POST", "/v1/sandboxes/sb-1/exec", ndjson({"type": "started", "process_id": "p"}))
    with pytest.raises(core_errors.SpaceError, match="ended before"):
        sb.exec_stream("x")


def test_stream_error_line_is_typed(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/exec",
        ndjson({"type": "error", "error": {"code": "unavailable", "message": "node gone"}}),
    )
    with pytest.raises(core_errors.Unavailable, match="node gone"):
        sb.exec_stream("x")


# ---- files -------------------------------------------------------------------------------------------


def test_files_write_and_read_bytes(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("PUT", "/v1/sandboxes/sb-1/files", lambda r: httpx.Response(200, json={"size": len(r.content)}))
    assert sb.files.write("/work/a.txt", b"data", mode=0o600) == 4
    request = server.last()
    assert request.url.params["path"] == "/work/a.txt" and request.url.params["mode"] == "384"
    assert request.content == b"data"
    assert sb.files.write("/work/t.txt", "text") == 4
    server.on("GET", "/v1/sandboxes/sb-1/files", httpx.Response(200, content=b"\x00bytes"))
    assert sb.files.read("/work/a.txt") == b"\x00bytes"
    assert server.last().url.params["path"] == "/work/a.txt"


def test_files_write_streams_an_iterator_without_reading_it_up_front(server: FakeServer) -> None:
    sb = make_sandbox(lazy_client(server), server)
    produced: list[int] = []

    def chunks() -> Iterator[bytes]:
        for i in range(5):
            produced.append(i)
            yield bytes([65 + i]) * 1000

    seen: list[tuple[int, int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert "Content-Length" not in request.headers
        assert request.headers["Transfer-Encoding"] == "chunked"
        total = 0
        for chunk in request.stream:  # type: ignore[union-attr]
            total += len(chunk)
            seen.append((len(produced), total))
        return httpx.Response(200, json={"size": total})

    server.on("PUT", "/v1/sandboxes/sb-1/files", handler)
    assert sb.files.write("/work/big", chunks()) == 5000
    # the producer had made only one more chunk than the server had received at each step
    assert seen == [(1, 1000), (2, 2000), (3, 3000), (4, 4000), (5, 5000)]


def test_files_write_from_a_file_object(server: FakeServer, tmp_path: Path) -> None:
    sb = make_sandbox(lazy_client(server), server)
    source = tmp_path / "src.bin"
    source.write_bytes(b"x" * 10_000)
    received: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        for chunk in request.stream:  # type: ignore[union-attr]
            received.append(len(chunk))
        return httpx.Response(200, json={"size": sum(received)})

    server.on("PUT", "/v1/sandboxes/sb-1/files", handler)
    with source.open("rb") as handle:
        assert sb.files.write("/work/src.bin", handle, chunk_size=4096) == 10_000
    assert received == [4096, 4096, 1808]


def test_files_read_stream_yields_chunks(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)

    def body() -> Iterator[bytes]:
        yield b"a" * 10
        yield b"b" * 10

    server.on("GET", "/v1/sandboxes/sb-1/files", lambda r: httpx.Response(200, content=body()))
    assert b"".join(sb.files.read_stream("/work/x", chunk_size=5)) == b"a" * 10 + b"b" * 10


def test_files_metadata_calls(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    entry = {"name": "a.txt", "path": "/work/a.txt", "type": "file", "size": 4, "mode": 420}
    server.on("GET", "/v1/sandboxes/sb-1/files/list", httpx.Response(200, json={"entries": [entry]}))
    server.on("GET", "/v1/sandboxes/sb-1/files/stat", httpx.Response(200, json=entry))
    server.on("POST", "/v1/sandboxes/sb-1/files/mkdir", httpx.Response(200, json={}))
    server.on("DELETE", "/v1/sandboxes/sb-1/files", httpx.Response(200, json={}))
    server.on("POST", "/v1/sandboxes/sb-1/files/rename", httpx.Response(200, json={}))
    assert sb.files.list("/work") == [entry]
    assert server.last().url.params["path"] == "/work"
    assert sb.files.stat("/work/a.txt")["size"] == 4
    assert sb.files.exists("/work/a.txt")
    assert sb.files.mkdir("/work/d") is True  # an older server's {} answer: made
    assert server.body() == {"path": "/work/d", "parents": True, "mode": 0o755}
    sb.files.remove("/work/d", recursive=True)
    assert dict(server.last().url.params) == {"path": "/work/d", "recursive": "true"}
    sb.files.rename("/work/a", "/work/b")
    assert server.body() == {"src": "/work/a", "dst": "/work/b", "parents": False}
    server.on("GET", "/v1/sandboxes/sb-1/files/stat", error_response(404, "not_found", "no such file"))
    assert not sb.files.exists("/work/nope")


def test_files_fidelity_calls(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    entry = {"name": "a", "path": "/work/a", "type": "dir", "size": 0, "mode": 493, "owner": "user"}
    listed = {"entries": [entry], "truncated": True}
    server.on("GET", "/v1/sandboxes/sb-1/files/list", httpx.Response(200, json=listed))
    listing = sb.files.list("/work", depth=3, limit=1, xattrs=True)
    assert listing == [entry] and listing.truncated
    assert dict(server.last().url.params) == {"path": "/work", "depth": "3", "limit": "1", "xattrs": "true"}
    server.on("GET", "/v1/sandboxes/sb-1/files/stat", httpx.Response(200, json=entry))
    sb.files.stat("/work/a", follow=True)
    assert server.last().url.params["follow"] == "true"
    made = {"created": False, "entry": entry}
    server.on("POST", "/v1/sandboxes/sb-1/files/mkdir", httpx.Response(200, json=made))
    assert sb.files.mkdir("/work/a", mode=0o700) is False
    server.on("POST", "/v1/sandboxes/sb-1/files/rename", httpx.Response(200, json={"entry": entry}))
    assert sb.files.rename("/work/x", "/work/y/z", parents=True) == entry
    assert server.body() == {"src": "/work/x", "dst": "/work/y/z", "parents": True}
    server.on("PUT", "/v1/sandboxes/sb-1/files/xattrs", httpx.Response(200, json={}))
    sb.files.set_xattr("/work/a", "user.k", b"\x00v")
    assert server.body() == {"path": "/work/a", "attribute": "user.k", "value_b64": "AHY="}
    value = {"name": "user.k", "value_b64": "AHY="}
    server.on("GET", "/v1/sandboxes/sb-1/files/xattrs/value", httpx.Response(200, json=value))
    assert sb.files.get_xattr("/work/a", "user.k") == b"\x00v"
    assert dict(server.last().url.params) == {"path": "/work/a", "attribute": "user.k"}
    server.on(
        "GET", "/v1/sandboxes/sb-1/files/xattrs", httpx.Response(200, json={"xattrs": {"user.k": "AHY="}})
    )
    assert sb.files.xattrs("/work/a") == {"user.k": b"\x00v"}
    server.on("DELETE", "/v1/sandboxes/sb-1/files/xattrs", httpx.Response(200, json={}))
    sb.files.remove_xattr("/work/a", "user.k")
    assert dict(server.last().url.params) == {"path": "/work/a", "attribute": "user.k"}


def test_process_resize(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    url = "/v1/sandboxes/sb-1/processes/0123456789abcdef/resize"
    server.on("POST", url, httpx.Response(200, json={}))
    sb.processes.resize("0123456789abcdef", 50, 132)
    assert server.body() == {"rows": 50, "cols": 132}
    server.on("POST", url, error_response(409, "invalid_state", "no terminal", state="no_terminal"))
    with pytest.raises(core_errors.InvalidState) as refused:
        sb.processes.resize("0123456789abcdef", 50, 132)
    assert refused.value.state == "no_terminal"


def test_files_watch(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "GET",
        "/v1/sandboxes/sb-1/files/watch",
        ndjson(
            {"type": "watching", "backend": "inotify"},
            {"type": "changes", "changes": [{"path": "/work/a", "kind": "created"}]},
        ),
    )
    events = list(sb.files.watch("/work", recursive=True))
    assert [e["type"] for e in events] == ["watching", "changes"]
    assert events[1]["changes"][0]["path"] == "/work/a"
    assert server.last().url.params["recursive"] == "true"


# ---- processes ---------------------------------------------------------------------------------------


def test_processes(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST", "/v1/sandboxes/sb-1/processes", httpx.Response(201, json={"process_id": "p-1", "pid": 42})
    )
    proc = sb.processes.start(["sleep", "100"], tag="bg", pty=(24, 80), env={"A": "B"})
    assert (proc.id, proc.pid) == ("p-1", 42)
    assert server.body() == {
        "argv": ["sleep", "100"],
        "env": {"A": "B"},
        "tag": "bg",
        "pty": {"rows": 24, "cols": 80},
    }
    server.on(
        "GET",
        "/v1/sandboxes/sb-1/processes",
        httpx.Response(200, json={"processes": [{"process_id": "p-1", "pid": 42, "running": True}]}),
    )
    listed = sb.processes.list()
    assert [(p.id, p.running) for p in listed] == [("p-1", True)]
    server.on(
        "GET",
        "/v1/sandboxes/sb-1/processes/p-1/output",
        ndjson(
            {"type": "attached", "offset": 3, "truncated": True},
            {"type": "stdout", "data_b64": b64(b"later")},
            {"type": "exit", "exit_code": 0, "signal": None, "timed_out": False},
        ),
    )
    events = list(sb.processes.attach("p-1", offset=3))
    assert [e.type for e in events] == ["attached", "stdout", "exit"]
    assert events[0].offset == 3 and events[0].truncated and events[1].data == b"later"
    assert dict(server.last().url.params) == {"offset": "3", "follow": "true"}
    assert proc.wait().stdout == "later"
    server.on("POST", "/v1/sandboxes/sb-1/processes/p-1/signal", httpx.Response(200, json={}))
    proc.signal()
    assert server.body() == {"signal": "SIGTERM"}
    sb.processes.signal(proc, 9)
    assert server.body() == {"signal": "SIGKILL"}
    proc.signal("int")
    assert server.body() == {"signal": "SIGINT"}
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/processes/p-1/stdin",
        lambda r: httpx.Response(200, json={"written": len(r.content)}),
    )
    assert proc.write_stdin(b"abc") == 3
    assert server.last().content == b"abc" and server.last().url.params["eof"] == "false"
    proc.close_stdin()
    assert server.last().url.params["eof"] == "true"


# ---- projects, keys, credentials ---------------------------------------------------------------------


def test_projects_keys_credentials(sp: Space, server: FakeServer) -> None:
    server.on(
        "POST", "/v1/projects", httpx.Response(201, json={"id": "prj-2", "name": "team", "org_id": "org-1"})
    )
    project = sp.projects.create("team")
    assert (project.id, project.name, project["org_id"]) == ("prj-2", "team", "org-1")
    assert server.body() == {"name": "team"}
    server.on(
        "POST",
        "/v1/keys",
        httpx.Response(201, json={"id": "key-1", "key": "sk-secret", "project_id": "prj-2", "role": "admin"}),
    )
    key = sp.keys.create(project="team", role="admin")
    assert key.key == "sk-secret" and key.id == "key-1"
    assert server.body() == {"project": "team", "role": "admin"}
    server.on("DELETE", "/v1/keys/key-1", httpx.Response(204))
    sp.keys.delete("key-1")
    server.on("PUT", "/v1/credentials/gh", httpx.Response(200, json={"id": "cred-1", "name": "gh"}))
    cred = sp.credentials.set("gh", value="v", hosts="code.test", header="Authorization: Bearer {value}")
    assert cred.id == "cred-1"
    # The name is in the path; only given fields are sent (an update keeps the rest).
    assert server.body() == {
        "value": "v",
        "hosts": ["code.test"],
        "header": "Authorization: Bearer {value}",
    }
    sp.credentials.set("gh", rate_per_minute=5, scope="org")
    assert server.body() == {"rate_per_minute": 5, "scope": "org"}
    server.on(
        "GET", "/v1/credentials", httpx.Response(200, json={"credentials": [{"id": "cred-1", "name": "gh"}]})
    )
    assert [c.name for c in sp.credentials.list()] == ["gh"]
    server.on("DELETE", "/v1/credentials/gh", httpx.Response(200, json={"deleted": True}))
    sp.credentials.delete("gh", scope="sandbox", sandbox_id="sb-1")
    assert server.requests[-1].url.params["scope"] == "sandbox"
    assert server.requests[-1].url.params["sandbox_id"] == "sb-1"
    server.on(
        "GET", "/v1/credentials/gh/audit", httpx.Response(200, json={"entries": [{"action": "create"}]})
    )
    assert sp.credentials.audit("gh") == [{"action": "create"}]


# ---- errors ------------------------------------------------------------------------------------------


def test_not_found(sp: Space, server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/sb-x", error_response(404, "not_found", "no sandbox sb-x"))
    with pytest.raises(core_errors.NotFound) as info:
        sp.sandboxes.get("sb-x")
    assert info.value.code == "not_found" and info.value.message == "no sandbox sb-x"


def test_invalid_state_keeps_state(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/resume",
        error_response(409, "invalid_state", "cannot resume", state="running", event="resume"),
    )
    with pytest.raises(core_errors.InvalidState) as info:
        sb.resume()
    assert info.value.state == "running" and info.value.event == "resume"


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "invalid_argument", core_errors.InvalidArgument),
        (401, "unauthenticated", core_errors.Unauthenticated),
        (403, "permission_denied", core_errors.PermissionDenied),
        (409, "conflict", core_errors.Conflict),
        (409, "already_exists", core_errors.AlreadyExists),
        (413, "too_large", core_errors.TooLarge),
        (500, "internal", core_errors.Internal),
        (504, "timeout", core_errors.Timeout),
        (507, "resource_exhausted", core_errors.ResourceExhausted),
    ],
)
def test_error_codes_map_to_classes(
    sp: Space, server: FakeServer, status: int, code: str, cls: type[core_errors.SpaceError]
) -> None:
    server.on("POST", "/v1/projects", error_response(status, code, "nope"))
    with pytest.raises(cls) as info:
        sp.projects.create("x")
    assert info.value.code == code


def test_validation_error_is_invalid_argument(sp: Space, server: FakeServer) -> None:
    server.on("POST", "/v1/projects", error_response(422, "validation_error", "bad body", fields=["name"]))
    with pytest.raises(core_errors.InvalidArgument) as info:
        sp.projects.create("x")
    assert info.value.code == "validation_error" and info.value.details["fields"] == ["name"]


def rate_limited(retry_after: str | None = "7") -> httpx.Response:
    answer = error_response(429, "resource_exhausted", "slow down")
    if retry_after is not None:
        answer.headers["Retry-After"] = retry_after
    return answer


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr("space.sdk._backend.time.sleep", waits.append)
    return waits


def test_rate_limited_is_retried_after_the_time_the_server_names(
    sp: Space, server: FakeServer, slept: list[float]
) -> None:
    ok = httpx.Response(200, json={"sandboxes": []})
    server.on("GET", "/v1/sandboxes", rate_limited(), rate_limited(), ok)
    assert sp.sandboxes.list() == []
    assert slept == [7.0, 7.0] and len(server.requests) == 3


def test_rate_limited_gives_up_after_max_retries(sp: Space, server: FakeServer, slept: list[float]) -> None:
    server.on("GET", "/v1/sandboxes", rate_limited())
    with pytest.raises(RateLimited) as info:
        sp.sandboxes.list()
    assert info.value.retry_after == 7.0
    assert len(server.requests) == 4 and slept == [7.0] * 3


def test_rate_limited_mutation_is_retried_with_the_same_idempotency_key(
    sp: Space, server: FakeServer, slept: list[float]
) -> None:
    server.on("POST", "/v1/sandboxes", rate_limited("1"), httpx.Response(201, json=sandbox_json()))
    sp.sandboxes.create()
    assert slept == [1.0] and len(server.requests) == 2
    assert len({request.headers["Idempotency-Key"] for request in server.requests}) == 1


def test_429_without_retry_after_or_with_a_one_shot_body_is_not_retried(
    sp: Space, server: FakeServer, slept: list[float]
) -> None:
    server.on("GET", "/v1/sandboxes", rate_limited(None))
    with pytest.raises(RateLimited):
        sp.sandboxes.list()  # a quota or a full disk: waiting does not help
    sb = make_sandbox(sp, server)
    server.on("PUT", "/v1/sandboxes/sb-1/files", rate_limited())
    with pytest.raises(RateLimited):
        sb.files.write("/work/x", iter([b"a", b"b"]))  # the stream cannot be sent again
    assert slept == [] and len(server.requests) == 3


def test_error_bodies_of_other_shapes() -> None:
    error = error_from_response(404, b'{"detail": "Not Found"}')
    assert isinstance(error, core_errors.NotFound) and error.message == "Not Found"
    error = error_from_response(502, b"<html>bad gateway</html>")
    assert isinstance(error, core_errors.Internal) and "502" in error.message
    error = error_from_response(503, b"")
    assert isinstance(error, core_errors.Unavailable)
    error = error_from_response(400, b'{"error": {"code": "something_new", "message": "m"}}')
    assert type(error) is core_errors.SpaceError and error.code == "something_new"


# ---- retries -----------------------------------------------------------------------------------------


def connect_error(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def read_timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def test_get_is_retried_on_503_and_transport_errors(sp: Space, server: FakeServer) -> None:
    server.on(
        "GET",
        "/v1/sandboxes",
        error_response(503, "unavailable", "busy"),
        connect_error,
        httpx.Response(200, json={"sandboxes": [sandbox_json()]}),
    )
    assert [s.id for s in sp.sandboxes.list()] == ["sb-1"]
    assert len(server.requests) == 3


def test_get_gives_up_after_max_retries(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes", connect_error)
    client = Space(url=URL, transport=httpx.MockTransport(server), retry_backoff=0, max_retries=2)
    with client, pytest.raises(TransportError) as info:
        client.sandboxes.list()
    assert isinstance(info.value, core_errors.Unavailable)
    assert len(server.requests) == 3


def test_mutation_retried_after_transport_error_with_the_same_idempotency_key(
    sp: Space, server: FakeServer
) -> None:
    server.on("POST", "/v1/sandboxes", read_timeout, httpx.Response(201, json=sandbox_json()))
    sp.sandboxes.create()
    assert len(server.requests) == 2
    keys = {request.headers["Idempotency-Key"] for request in server.requests}
    assert len(keys) == 1 and all(keys)
    assert server.requests[0].content == server.requests[1].content


def test_each_call_gets_its_own_idempotency_key(sp: Space, server: FakeServer) -> None:
    server.on("POST", "/v1/projects", httpx.Response(201, json={"id": "p"}))
    sp.projects.create("a")
    sp.projects.create("a")
    assert server.requests[0].headers["Idempotency-Key"] != server.requests[1].headers["Idempotency-Key"]


def test_mutation_not_retried_on_503(sp: Space, server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", error_response(503, "unavailable", "no node"))
    with pytest.raises(core_errors.Unavailable):
        sp.sandboxes.create()
    assert len(server.requests) == 1


def test_streamed_upload_is_not_retried(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)
    server.on("PUT", "/v1/sandboxes/sb-1/files", connect_error)
    with pytest.raises(TransportError):
        sb.files.write("/work/x", iter([b"a", b"b"]))
    assert len(server.requests) == 2  # the GET of make_sandbox, then one PUT


def test_mid_stream_failure_is_a_transport_error(sp: Space, server: FakeServer) -> None:
    sb = make_sandbox(sp, server)

    def broken() -> Iterator[bytes]:
        yield b"start"
        raise httpx.ReadError("reset")

    server.on("GET", "/v1/sandboxes/sb-1/files", lambda r: httpx.Response(200, content=broken()))
    chunks: list[bytes] = []
    with pytest.raises(TransportError):
        for chunk in sb.files.read_stream("/work/x"):
            chunks.append(chunk)
    assert chunks == [b"start"]
