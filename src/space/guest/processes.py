"""Process calls: the table of processes spaced started, and process.start/attach/input/signal/resize/list.

Invariants:
- The table keeps every running process and the newest EXITED_KEPT exited ones, so late attaches work;
  exited processes share an output budget (EXITED_OUTPUT_BUDGET, newest first), older ones lose their
  output (an attach then reports truncated=true) but keep their exit status.
- A foreground start and an attach follow the process's output log from an offset, holding their place
  (see outputlog.py): while the host reads slowly, the process is slowed, never its output lost. CANCEL
  of either detaches: ERROR "cancelled" with the offset reached, and the process keeps running.
- A foreground start's stdin is the call's request body; its EOF closes the process's stdin (a PTY gets
  ^D). process.input writes to a running process's stdin from any later call.
- Signals go to the whole process group unless "group" is false; names are case-insensitive and may omit
  "SIG".
- This module does not import the daemon: handlers reach the table through the ProcessHost protocol.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from space.guest.channel import Call, Cancelled, GuestError, error_payload
from space.guest.children import ChildWatcher
from space.guest.launch import base_environment, parse_launch, spawn
from space.guest.params import get_bool, get_int, get_str_map
from space.guest.process import Process
from space.protocol import commands
from space.protocol import methods as m
from space.protocol.frames import Channel

EXITED_KEPT = 256
EXITED_OUTPUT_BUDGET = 64 << 20  # output bytes kept across all exited processes, newest first


class ProcessTable:
    def __init__(self, children: ChildWatcher, on_activity: Callable[[], None]) -> None:
        self._children = children
        self._on_activity = on_activity
        self._lock = threading.Lock()
        self._processes: dict[str, Process] = {}
        self._base_env = base_environment()

    def set_base_environment(self, env: dict[str, str]) -> None:
        """Variables every later process inherits (sys.configure)."""
        self._base_env.update(env)

    def get(self, process_id: Any) -> Process:
        if not isinstance(process_id, str):
            raise GuestError("invalid_argument", "'process_id' must be a string")
        with self._lock:
            process = self._processes.get(process_id)
        if process is None:
            raise GuestError("no_such_process", f"no process {process_id!r}")
        return process

    def all(self) -> list[Process]:
        with self._lock:
            return list(self._processes.values())

    def running_count(self) -> int:
        return sum(1 for process in self.all() if not process.done.is_set())

    def finished(self, process: Process) -> None:
        with self._lock:
            exited = [p for p in self._processes.values() if p.done.is_set()]
            for old in exited[: max(0, len(exited) - EXITED_KEPT)]:
                del self._processes[old.process_id]
            exited = exited[-EXITED_KEPT:]
        kept = 0
        for old in reversed(exited):
            kept += old.log.retained
            if kept > EXITED_OUTPUT_BUDGET:
                old.log.discard()

    def kill_all(self) -> None:
        for process in self.all():
            if not process.done.is_set():
                process.kill_group(signal.SIGKILL)

    def start(self, params: dict[str, Any]) -> Process:
        launch = parse_launch(params, self._base_env)
        process = Process(
            launch.argv,
            launch.tag,
            launch.pty_size is not None,
            launch.background,
            on_activity=self._on_activity,
            on_finished=self.finished,
        )
        process.requested_env = get_str_map(params, commands.ENV)
        process.cwd = launch.cwd
        process.popen = spawn(process, launch, self._children)
        process.pid = process.popen.pid
        if launch.timeout is not None:
            process.deadline = time.monotonic() + launch.timeout
        with self._lock:
            self._processes[process.process_id] = process
        self._on_activity()
        threading.Thread(target=process.pump_output, name=f"io-{process.pid}", daemon=True).start()
        return process


class ProcessHost(Protocol):
    """What the process calls need of the daemon."""

    @property
    def processes(self) -> ProcessTable: ...


def _errno_error(exc: OSError) -> GuestError:
    payload = error_payload(exc)
    return GuestError(payload["code"], payload["message"])


# --- handlers --------------------------------------------------------------------------------------------


def process_start(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    try:
        process = daemon.processes.start(params)
    except OSError as exc:
        raise _errno_error(exc) from exc
    if process.background:
        return {"process_id": process.process_id, "pid": process.pid}
    call.event({"type": m.EVENT_STARTED, "process_id": process.process_id, "pid": process.pid})
    if process.stdin_fd is None:
        call.inbound.refuse()
    else:
        threading.Thread(
            target=_pump_stdin, args=(call, process), name=f"stdin-{process.pid}", daemon=True
        ).start()
    return _follow(call, process, 0, follow=True, announce=False)


def _pump_stdin(call: Call, process: Process) -> None:
    """Foreground stdin: the call's BODY frames, then EOF closes the process's stdin. CANCEL keeps it open."""
    try:
        for chunk in call.body():
            process.write_stdin(chunk, call.cancelled)
        process.close_stdin()
    except (Cancelled, GuestError):
        # Cancelled: detached, stdin stays open for process.input. GuestError: the process is gone or
        # stopped reading; what the host still sends is dropped with the stream.
        return


def _follow(call: Call, process: Process, offset: int, follow: bool, announce: bool) -> dict[str, Any]:
    log = process.log
    hold, offset, truncated = log.add_hold(offset)
    call.add_waker(log.wake)
    try:
        if announce:
            call.event({"type": m.EVENT_ATTACHED, "offset": offset, "truncated": truncated})
        stop_at = None if follow else log.end
        while stop_at is None or offset < stop_at:
            try:
                found = log.wait_read(offset, call.cancelled)
            except Cancelled:
                raise _detached(process, offset) from None
            if found is None:
                break
            at, channel, data = found
            if stop_at is not None:
                data = data[: max(0, stop_at - at)]
            try:
                call.data(Channel(channel), data)  # waits for the host's credit (flow control)
            except Cancelled:
                if call.finished:
                    raise
                raise _detached(process, offset) from None
            offset = at + len(data)
            log.move_hold(hold, offset)
    finally:
        log.release_hold(hold)
        call.remove_waker(log.wake)
    if not follow:
        return {"process_id": process.process_id, "offset": offset, "running": not process.done.is_set()}
    process.done.wait()
    return {**process.result(), "offset": offset}


def _detached(process: Process, offset: int) -> GuestError:
    return GuestError(
        "cancelled", "detached; the process keeps running", process_id=process.process_id, offset=offset
    )


def process_attach(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    offset = get_int(params, "offset", 0)
    if offset < 0:
        raise GuestError("invalid_argument", "'offset' must be >= 0")
    return _follow(call, process, offset, follow=get_bool(params, "follow", True), announce=True)


def process_input(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    close = get_bool(params, "eof", False)
    written = 0
    for chunk in call.body():
        written += process.write_stdin(chunk, call.cancelled)
    if close:
        process.close_stdin()
    return {"written": written}


def process_signal(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    signum = _signal_number(params.get("signal", "SIGTERM"))
    if not get_bool(params, "group", True):
        if process.done.is_set():
            raise GuestError("no_such_process", "the process has exited")
        os.kill(process.pid, signum)
        return {}
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        raise GuestError("no_such_process", "the process and its group are gone") from None
    return {}


def _signal_number(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value in signal.valid_signals() or value == 0:
            return value
        raise GuestError("invalid_argument", f"no signal {value}")
    if isinstance(value, str):
        name = value.upper()
        if name.isdigit():
            return _signal_number(int(name))
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return int(signal.Signals[name])
        except KeyError:
            pass
    raise GuestError("invalid_argument", f"unknown signal {value!r}")


def process_resize(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    rows = get_int(params, "rows")
    cols = get_int(params, "cols")
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_argument", "rows and cols must be 1..65535")
    process.resize(rows, cols)
    return {}


def process_list(daemon: ProcessHost, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    with_env = get_bool(params, "env", False)
    return {"processes": [process.describe(with_env=with_env) for process in daemon.processes.all()]}
