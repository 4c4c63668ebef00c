"""E2B's in-sandbox front, `process.Process`, driven by E2B's own generated Connect clients (the SDK's
factory, transport and JSON codec) over real HTTP against a real runsc sandbox."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from space.sdk import Sandbox
from tests.support import envd_front as ef
from tests.support.cluster import real_cluster  # noqa: F401 - module-bound session fixture

envd_front = ef.envd_front

pytestmark = pytest.mark.root


def _events(stream: Iterator[Any]) -> list[Any]:
    return [message.event.event for message in stream]


def _output(events: list[Any], field: str) -> bytes:
    found = b""
    for event in events:
        match event:
            case Oneof(field="data", value=data) if data.output is not None and data.output.field == field:
                found += data.output.value
    return found


def _end(events: list[Any]) -> Any:
    ends = [e.value for e in events if e.field == "end"]
    assert len(ends) == 1, events
    return ends[0]


def _start(cmd: str, **kw: Any) -> pb.StartRequest:
    return pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/sh", args=["-c", cmd], envs={}), **kw)


def _by_pid(pid: int) -> pb.ProcessSelector:
    return pb.ProcessSelector(selector=Oneof("pid", pid))


def test_start_streams_start_output_and_end(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    client = envd_front.process(sandbox.id)
    request = _start('echo "out $GREETING"; echo err >&2; exit 3', stdin=False)
    request.process.envs["GREETING"] = "hello"
    events = _events(client.start(request, timeout_ms=60_000))
    assert events[0].field == "start" and events[0].value.pid > 0
    assert _output(events, "stdout") == b"out hello\n"
    assert _output(events, "stderr") == b"err\n"
    end = _end(events)
    assert (end.exit_code, end.exited, end.status) == (3, True, "exit status 3")
    assert events[-1].field == "end"


def test_background_process_input_list_connect_and_replay(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    client = envd_front.process(sandbox.id)
    stream = client.start(_start("cat"))  # stdin absent: a pipe (envd's default)
    first = next(iter(stream)).event.event
    assert first.field == "start"
    pid = first.value.pid
    stream.close()  # the client goes away: the process keeps running
    listed = client.list(pb.ListRequest())
    assert pid in [p.pid for p in listed.processes]
    assert [p.config.args for p in listed.processes if p.pid == pid] == [["-c", "cat"]]
    client.send_input(
        pb.SendInputRequest(process=_by_pid(pid), input=pb.ProcessInput(input=Oneof("stdin", b"abc\n")))
    )
    client.close_stdin(pb.CloseStdinRequest(process=_by_pid(pid)))
    events = _events(client.connect(pb.ConnectRequest(process=_by_pid(pid)), timeout_ms=60_000))
    assert events[0].field == "start" and events[0].value.pid == pid
    assert _output(events, "stdout") == b"abc\n"
    assert _end(events).exit_code == 0
    assert pid not in [p.pid for p in client.list(pb.ListRequest()).processes]
    # A finished process is still replayed (start, output, end) while the daemon keeps it.
    again = _events(client.connect(pb.ConnectRequest(process=_by_pid(pid)), timeout_ms=60_000))
    assert _output(again, "stdout") == b"abc\n" and _end(again).exit_code == 0


def test_kill_by_signal_and_unknown_pids(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    client = envd_front.process(sandbox.id)
    stream = client.start(_start("sleep 300", stdin=False))
    pid = next(iter(stream)).event.event.value.pid
    stream.close()
    client.send_signal(pb.SendSignalRequest(process=_by_pid(pid), signal=pb.Signal.SIGKILL))
    end = _end(_events(client.connect(pb.ConnectRequest(process=_by_pid(pid)), timeout_ms=60_000)))
    assert (end.exit_code, end.exited, end.status) == (-1, False, "signal: killed")
    resize = pb.UpdateRequest(process=_by_pid(pid), pty=pb.PTY(size=pb.PTY.Size(cols=100, rows=30)))
    with pytest.raises(ConnectError) as no_pty:
        client.update(resize)  # a process without a PTY: not a sandbox that is down
    assert no_pty.value.code == Code.FAILED_PRECONDITION
    for call in (
        lambda: client.send_signal(pb.SendSignalRequest(process=_by_pid(999_999), signal=pb.Signal.SIGKILL)),
        lambda: list(client.connect(pb.ConnectRequest(process=_by_pid(999_999)))),
        lambda: client.close_stdin(pb.CloseStdinRequest(process=_by_pid(0))),
    ):
        with pytest.raises(ConnectError) as caught:
            call()
        assert caught.value.code == Code.NOT_FOUND


def test_pty_start_input_and_resize(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    client = envd_front.process(sandbox.id)
    request = pb.StartRequest(
        process=pb.ProcessConfig(cmd="/bin/sh", args=["-i"], envs={"TERM": "xterm", "PS1": "$ "}),
        pty=pb.PTY(size=pb.PTY.Size(cols=80, rows=24)),
    )
    stream = iter(client.start(request, timeout_ms=60_000))
    pid = next(stream).event.event.value.pid
    client.update(pb.UpdateRequest(process=_by_pid(pid), pty=pb.PTY(size=pb.PTY.Size(cols=123, rows=45))))
    client.send_input(
        pb.SendInputRequest(
            process=_by_pid(pid), input=pb.ProcessInput(input=Oneof("pty", b"stty size; exit 0\n"))
        )
    )
    events = [message.event.event for message in stream]
    assert b"45 123" in _output(events, "pty")
    assert _output(events, "stdout") == b""
    assert _end(events).exit_code == 0


def test_keepalives_while_quiet(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    client = envd_front.process(sandbox.id)
    stream = client.start(
        _start("sleep 2.5; echo done", stdin=False), headers={"Keepalive-Ping-Interval": "1"}
    )
    events = _events(stream)
    assert events[0].field == "start"
    assert "keepalive" in [e.field for e in events]
    assert _output(events, "stdout") == b"done\n" and _end(events).exit_code == 0


def test_deadline_kills_the_process(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    """Connect-Timeout-Ms on Start is the process's deadline: the client gives up, the process dies too."""
    client = envd_front.process(sandbox.id)
    pids: list[int] = []
    with pytest.raises(ConnectError) as caught:
        for message in client.start(_start("sleep 300", stdin=False), timeout_ms=2_000):
            if message.event.event.field == "start":
                pids.append(message.event.event.value.pid)
    assert caught.value.code == Code.DEADLINE_EXCEEDED
    assert len(pids) == 1
    end = _end(_events(client.connect(pb.ConnectRequest(process=_by_pid(pids[0])), timeout_ms=60_000)))
    assert end.exited is False and end.status.startswith("signal: ")
