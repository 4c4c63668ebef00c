"""`e2b.Sandbox` (E2B's own SDK, unchanged) end to end against a real installation: the E2B control API and
in-sandbox API that `space up` serves, on real runsc sandboxes. Commands with streaming callbacks,
background processes, connect and kill, a PTY, files and directory watches."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEvent,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxNotRunningException,
)
from e2b.connection_config import ConnectionConfig
from e2b.envd.client_sync import create_rpc_client
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessClientSync

from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture
from tests.support.e2b_cluster import e2b_sandbox

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def sbx(real_cluster: RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    with e2b_sandbox(real_cluster) as made:
        yield made


def test_commands_stream_and_fail(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        "echo one; echo two >&2; echo three", on_stdout=out.append, on_stderr=err.append
    )
    assert (result.exit_code, result.stdout, result.stderr) == (0, "one\nthree\n", "two\n")
    assert "".join(out) == "one\nthree\n" and "".join(err) == "two\n"
    assert sbx.commands.run("echo $X", envs={"X": "per-call"}).stdout == "per-call\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo bad >&2; exit 7")
    assert failed.value.exit_code == 7 and failed.value.stderr == "bad\n"


def test_background_connect_and_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 300", background=True, timeout=0)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(handle.pid, timeout=0)
    assert again.pid == handle.pid
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert sbx.commands.kill(999_999) is False
    deadline = time.monotonic() + 30
    while handle.pid in [p.pid for p in sbx.commands.list()]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_stdin_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True, timeout=0)
    sbx.commands.send_stdin(handle.pid, "piped\n")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert (result.exit_code, result.stdout) == (0, "piped\n")


def test_stream_input(sbx: Sandbox) -> None:
    """StreamInput (a client stream: the request body is a stream of Connect envelopes) keeps its order."""
    handle = sbx.commands.run("cat", background=True, stdin=True, timeout=0)
    sbx.commands.stream_input(handle.pid, (f"line {i}\n" for i in range(100)))
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "".join(f"line {i}\n" for i in range(100))
    with pytest.raises(NotFoundException):
        sbx.commands.stream_input(999_999, ["x"])


def test_pty_create_send_resize(sbx: Sandbox) -> None:
    data = bytearray()
    handle = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "}, timeout=60)
    sbx.pty.resize(handle.pid, PtySize(rows=33, cols=111))
    sbx.pty.send_stdin(handle.pid, b"stty size; exit 0\n")
    result = handle.wait(on_pty=data.extend)
    assert result.exit_code == 0
    assert b"33 111" in bytes(data)


def test_files(sbx: Sandbox) -> None:
    base = f"/tmp/sdk-{secrets.token_hex(4)}"
    info = sbx.files.write(f"{base}/a.txt", "hello")
    assert info.path == f"{base}/a.txt"
    assert sbx.files.read(f"{base}/a.txt") == "hello"
    assert bytes(sbx.files.read(f"{base}/a.txt", format="bytes")) == b"hello"
    payload = secrets.token_bytes(200_000)
    sbx.files.write(f"{base}/bin/b.bin", payload)
    assert bytes(sbx.files.read(f"{base}/bin/b.bin", format="bytes")) == payload
    assert sbx.files.make_dir(f"{base}/d/e") is True
    assert sbx.files.make_dir(f"{base}/d/e") is False
    assert [e.name for e in sbx.files.list(base)] == ["a.txt", "bin", "d"]
    assert [e.path for e in sbx.files.list(base, depth=2)] == [
        f"{base}/a.txt", f"{base}/bin", f"{base}/bin/b.bin", f"{base}/d", f"{base}/d/e",
    ]  # fmt: skip
    moved = sbx.files.rename(f"{base}/a.txt", f"{base}/d/e/a2.txt")
    assert moved.path == f"{base}/d/e/a2.txt"
    assert sbx.files.exists(f"{base}/a.txt") is False
    assert sbx.files.get_info(f"{base}/d/e/a2.txt").size == 5
    sbx.files.remove(f"{base}/d")
    assert sbx.files.exists(f"{base}/d") is False


def test_watch_dir(sbx: Sandbox) -> None:
    base = f"/tmp/watch-{secrets.token_hex(4)}"
    sbx.files.make_dir(base)
    handle = sbx.files.watch_dir(base)
    try:
        sbx.files.write(f"{base}/new.txt", "x")
        events = []
        deadline = time.monotonic() + 30
        while not any(e.name == "new.txt" for e in events) and time.monotonic() < deadline:
            events += handle.get_new_events()
            time.sleep(0.1)
        assert next(e.type for e in events if e.name == "new.txt") == FilesystemEventType.CREATE
    finally:
        handle.stop()


def test_is_running_and_signed_urls(sbx: Sandbox) -> None:
    assert sbx.is_running() is True
    path = f"/tmp/url-{secrets.token_hex(4)}.txt"
    with httpx.Client(timeout=60) as http:
        uploaded = http.post(sbx.upload_url(path), files={"file": (path, b"via url")})
        assert uploaded.status_code == 200, uploaded.text
        assert http.get(sbx.download_url(path)).content == b"via url"
        expired = http.get(sbx.download_url(path, use_signature_expiration=-10))
        assert expired.status_code == 401
        tampered = sbx.download_url(path).replace("url-", "xrl-")
        assert http.get(tampered).status_code == 401


def test_sandbox_killed_mid_command(real_cluster: RealCluster) -> None:  # noqa: F811
    """A command whose sandbox is killed while it runs ends with the SDK's SandboxNotRunningException (its
    stream ends unavailable and /health then answers 502), not a hang or an unrelated error."""
    doomed = Sandbox.create(
        api_key=real_cluster.api_key, api_url=real_cluster.e2b_api_url,
        sandbox_url=real_cluster.e2b_sandbox_url, domain="space.invalid",
    )  # fmt: skip
    url = real_cluster.e2b_sandbox_url
    headers = {"E2b-Sandbox-Id": doomed.sandbox_id, "X-Access-Token": str(doomed._envd_access_token)}
    rpc = create_rpc_client(
        ProcessClientSync,
        url,
        ConnectionConfig(api_key="unused", sandbox_url=url, extra_sandbox_headers=headers),
    )
    try:
        handle = doomed.commands.run("sleep 300", background=True, timeout=0)
        start = pb.StartRequest(process=pb.ProcessConfig(cmd="sleep", args=["300"]), stdin=False)
        raw = iter(rpc.start(start, timeout_ms=120_000))
        assert next(raw).event.event.field == "start"
        assert doomed.kill() is True
        with pytest.raises(SandboxNotRunningException):
            handle.wait()
        # The stream ends `unavailable` (which E2B's SDK checks against /health), not with a hang.
        with pytest.raises(ConnectError) as cut:
            list(raw)
        assert cut.value.code == Code.UNAVAILABLE, cut.value
        assert doomed.is_running() is False
    finally:
        doomed.kill()


def test_paused_sandbox_is_not_running_until_used(real_cluster: RealCluster) -> None:  # noqa: F811
    """/health never wakes a paused sandbox (E2B's is_running is False), while a command resumes it as
    SPACE's data plane does, with its files and processes kept."""
    paused = Sandbox.create(
        api_key=real_cluster.api_key, api_url=real_cluster.e2b_api_url,
        sandbox_url=real_cluster.e2b_sandbox_url, domain="space.invalid",
    )  # fmt: skip
    try:
        paused.files.write("/tmp/kept.txt", "kept")
        background = paused.commands.run("sleep 600", background=True, timeout=0)
        assert paused.pause() is True
        assert paused.is_running() is False
        assert paused.is_running() is False  # asking did not wake it
        assert paused.commands.run("cat /tmp/kept.txt").stdout == "kept"
        assert paused.is_running() is True
        assert background.pid in [p.pid for p in paused.commands.list()]
    finally:
        paused.kill()


def test_async_sdk(real_cluster: RealCluster) -> None:  # noqa: F811
    """E2B's async SDK (its async Connect clients; watch_dir is the streaming WatchDir there)."""

    async def scenario() -> None:
        sbx = await AsyncSandbox.create(
            api_key=real_cluster.api_key, api_url=real_cluster.e2b_api_url,
            sandbox_url=real_cluster.e2b_sandbox_url, domain="space.invalid",
        )  # fmt: skip
        try:
            out: list[str] = []
            result = await sbx.commands.run("echo async", on_stdout=out.append)
            assert result.stdout == "async\n" and "".join(out) == "async\n"
            await sbx.files.make_dir("/tmp/aw")
            seen: list[FilesystemEvent] = []
            arrived = asyncio.Event()

            def on_event(event: FilesystemEvent) -> None:
                seen.append(event)
                if event.name == "f.txt":
                    arrived.set()

            handle = await sbx.files.watch_dir(
                "/tmp/aw", on_event=on_event, recursive=True, include_entry=True
            )
            await sbx.files.write("/tmp/aw/f.txt", "x")
            await asyncio.wait_for(arrived.wait(), 30)
            await handle.stop()
            created = [e for e in seen if e.name == "f.txt"]
            assert created[0].type == FilesystemEventType.CREATE
            assert created[0].entry is not None and created[0].entry.path == "/tmp/aw/f.txt"
            assert await sbx.files.read("/tmp/aw/f.txt") == "x"
        finally:
            await sbx.kill()

    asyncio.run(scenario())
