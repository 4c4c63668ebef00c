"""SPACE's process events (the node's NDJSON items) as envd `ProcessEvent` messages, and E2B's pids as
SPACE's process ids.

Invariants:
- E2B names a process by its in-sandbox PID; SPACE by its process id. The daemon's table knows both
  (`process.list` gives each process's `pid`), so a pid is resolved from the table at each call: the
  running process with that pid, else the most recently started finished one still kept (E2B replays the
  end of a recently finished process too). Nothing is cached, so a pid reused after a restore or by a
  later process never reaches the wrong process.
- A stream always starts with `start{pid}` and ends with `end{exitCode, exited, status}` when the process
  ended: the exit code of a signalled process is -1 and its status Go's wording (`signal: killed`), as
  envd reports it. A PTY's output is `data.pty`, a pipe's `data.stdout` / `data.stderr`.
"""

from __future__ import annotations

import base64
import binascii
import signal
from collections.abc import AsyncIterator
from typing import Any, Literal

from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from space.core import errors
from space.node.rpc_client import NodeClient

#: Go's names of signals (syscall.Signal.String), which envd puts into `status`.
_GO_SIGNAL_NAMES = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGABRT: "aborted",
    signal.SIGKILL: "killed",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGPIPE: "broken pipe",
    signal.SIGTERM: "terminated",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGUSR2: "user defined signal 2",
}


_Start = Oneof[Literal["start"], pb.ProcessEvent.StartEvent]
_KeepAlive = Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive]


def start_event(pid: int) -> pb.ProcessEvent:
    return pb.ProcessEvent(
        event=Oneof[Literal["start"], pb.ProcessEvent.StartEvent](
            "start", pb.ProcessEvent.StartEvent(pid=pid)
        )
    )


def keepalive_event() -> pb.ProcessEvent:
    return pb.ProcessEvent(
        event=Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive]("keepalive", pb.ProcessEvent.KeepAlive())
    )


def end_event(item: dict[str, Any]) -> pb.ProcessEvent:
    """The end of a process from SPACE's exit item {exit_code, signal, timed_out}."""
    signum = item.get("signal")
    if isinstance(signum, int) and signum > 0:
        try:
            name = _GO_SIGNAL_NAMES.get(signal.Signals(signum), f"signal {signum}")
        except ValueError:
            name = f"signal {signum}"
        end = pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    else:
        code = item.get("exit_code")
        code = code if isinstance(code, int) else -1
        end = pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")
    if item.get("timed_out"):
        end.error = "the process's deadline passed (Connect-Timeout-Ms)"
    return pb.ProcessEvent(event=Oneof[Literal["end"], pb.ProcessEvent.EndEvent]("end", end))


def _data_event(channel: str, data: bytes) -> pb.ProcessEvent:
    output: Oneof[Literal["stdout"], bytes] | Oneof[Literal["stderr"], bytes] | Oneof[Literal["pty"], bytes]
    if channel == "pty":
        output = Oneof[Literal["pty"], bytes]("pty", data)
    elif channel == "stderr":
        output = Oneof[Literal["stderr"], bytes]("stderr", data)
    else:
        output = Oneof[Literal["stdout"], bytes]("stdout", data)
    data_event = pb.ProcessEvent.DataEvent(output=output)
    return pb.ProcessEvent(event=Oneof[Literal["data"], pb.ProcessEvent.DataEvent]("data", data_event))


async def process_events(
    items: AsyncIterator[dict[str, Any]], *, pty: bool
) -> AsyncIterator[pb.ProcessEvent]:
    """Data and end events of an attach stream (its `attached` announcement and unknown items dropped)."""
    async for item in items:
        kind = item.get("type")
        if kind in ("stdout", "stderr"):
            try:
                data = base64.b64decode(str(item.get("data_b64", "")), validate=True)
            except binascii.Error as exc:
                raise errors.Internal("the node sent malformed process output") from exc
            yield _data_event("pty" if pty else str(kind), data)
        elif kind == "exit":
            yield end_event(item)
        elif kind == "error":
            body = item.get("error")
            raise errors.error_from_dict(body if isinstance(body, dict) else {})


async def process_of_pid(node: NodeClient, sandbox_id: str, pid: int) -> dict[str, Any]:
    """The daemon's record of the process E2B calls `pid` (NotFound as envd words it)."""
    if pid <= 0:
        raise errors.NotFound(f"process with pid {pid} not found")
    found = [p for p in await node.list_processes(sandbox_id) if p.get("pid") == pid]
    if not found:
        raise errors.NotFound(f"process with pid {pid} not found")
    running = [p for p in found if p.get("running")]
    chosen = running or sorted(found, key=lambda p: float(p.get("started_at") or 0.0))
    return chosen[-1]


def selected_pid(selector: pb.ProcessSelector | None) -> int:
    """The pid of a ProcessSelector (E2B's SDK never selects by tag)."""
    if selector is None or selector.selector is None:
        raise errors.InvalidArgument("a process selector (pid) is required", field="process")
    chosen = selector.selector
    if chosen.field != "pid":
        raise errors.InvalidArgument("only selection by pid is supported", field="process")
    return int(chosen.value)


def process_info(record: dict[str, Any]) -> pb.ProcessInfo:
    """envd's ProcessInfo of a daemon table entry: its argv, the variables its start asked for (when the
    entry carries them) and its working directory."""
    argv = [str(a) for a in record.get("argv") or []]
    env = record.get("env")
    envs = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
    config = pb.ProcessConfig(cmd=argv[0] if argv else "", args=argv[1:], envs=envs)
    cwd = record.get("cwd")
    if isinstance(cwd, str) and cwd:
        config.cwd = cwd
    info = pb.ProcessInfo(config=config, pid=int(record.get("pid") or 0))
    tag = record.get("tag")
    if isinstance(tag, str) and tag:
        info.tag = tag
    return info
