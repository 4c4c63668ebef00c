"""Processes: start (argv or shell, env, cwd, user, PTY, timeout), stream, stdin, signals, attach, list.

Invariants:
- Every process runs in its own session and process group (setsid), so a timeout or a signal reaches its
  whole group, and a PTY child gets the PTY slave as its controlling terminal.
- Exit statuses come only from the ChildWatcher (see children.py); Popen never waits: its returncode is set
  here when the status arrives.
- One I/O thread per process owns the output fds: it moves bytes into the process's OutputLog, enforces the
  timeout, and ends the process (log closed, `done` set) once the process exited and its output reached EOF
  — or EXIT_GRACE after the exit when descendants keep the pipes open (their later output is drained and
  discarded so they never block on a full pipe, but it is not part of the process's output).
- Nobody else blocks on process output: callers follow the log. Foreground calls and attached clients hold
  their place in the log, so while one of them is behind, the I/O thread stops reading and the process
  blocks on its own writes (flow control) — memory stays bounded either way.
- Stdin fds are non-blocking and written under a per-process lock that is never held while waiting, so a
  process that does not read its stdin can stall only the call writing to it.
- Children get a sane environment: the daemon's own environment minus SPACED_* and PYTHONPATH (the
  template's and sandbox's variables travel there), over defaults for PATH, HOME and LANG; the call's
  "env" wins. A PTY gets TERM=xterm-256color unless given.
- The table keeps every running process and the newest EXITED_KEPT exited ones, so late attaches work;
  exited processes share an output budget (EXITED_OUTPUT_BUDGET, newest first), older ones lose their
  output (an attach then reports truncated=true) but keep their exit status.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from typing import TYPE_CHECKING, Any

from space.guest.channel import Call, Cancelled, GuestError
from space.guest.outputlog import OutputLog
from space.guest.params import get_bool, get_float, get_int, get_str, get_str_map
from space.protocol import methods as m
from space.protocol.frames import Channel

if TYPE_CHECKING:
    from space.guest.daemon import Daemon

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORKDIR = os.environ.get("SPACED_WORKDIR", "/work")  # overridable for the fake driver only
EXIT_GRACE = 0.5  # seconds to wait for output EOF after the process itself exited
MAX_GRACE_PAUSE = 10.0  # the grace clock stops while a slow follower holds the log, at most this long
EXITED_KEPT = 256
EXITED_OUTPUT_BUDGET = 64 << 20  # output bytes kept across all exited processes, newest first
READ_SIZE = 65535


def _errno_error(exc: OSError) -> GuestError:
    from space.guest.channel import error_payload

    payload = error_payload(exc)
    return GuestError(payload["code"], payload["message"])


class Process:
    def __init__(self, table: ProcessTable, argv: list[str], tag: str | None, pty: bool, background: bool):
        self.table = table
        self.process_id = os.urandom(8).hex()
        self.argv = argv
        self.tag = tag
        self.pty = pty
        self.background = background
        self.log = OutputLog()
        self.pid = 0
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_status: int | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.deadline: float | None = None
        self.done = threading.Event()
        self.stdin_fd: int | None = None  # a pipe's write end, or the PTY master
        self.stdin_lock = threading.Lock()
        self.master_fd: int | None = None
        self.outputs: dict[int, Channel] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)

    # --- exit ------------------------------------------------------------------------------------------

    def on_exit(self, status: int) -> None:
        """Called from the reaper/waiter thread: record, then wake the I/O thread (which does the rest)."""
        self.exit_status = status
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def _finish(self) -> None:
        status = self.exit_status
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        if code is not None and code < 0:
            self.signal = -code
        else:
            self.exit_code = code
        if self.popen is not None and code is not None:
            self.popen.returncode = code
        self.ended_at = time.time()
        with self.stdin_lock:
            if self.stdin_fd is not None and self.stdin_fd != self.master_fd:
                os.close(self.stdin_fd)
            self.stdin_fd = None
        self.log.close()
        self.done.set()
        self.table.finished(self)

    # --- the I/O thread --------------------------------------------------------------------------------

    def pump_output(self) -> None:
        poller = select.poll()
        for fd in self.outputs:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        open_fds = dict(self.outputs)
        exited_at: float | None = None
        paused = 0.0
        while True:
            now = time.monotonic()
            if exited_at is None and self.exit_status is not None:
                exited_at = now
            if exited_at is not None and (not open_fds or now - exited_at >= EXIT_GRACE):
                break
            timeout: float | None = None
            if self.deadline is not None and self.exit_status is None:
                if now >= self.deadline:
                    self.timed_out = True
                    self.deadline = None
                    self.kill_group(signal.SIGKILL)
                else:
                    timeout = self.deadline - now
            if exited_at is not None:
                grace_left = exited_at + EXIT_GRACE - now
                timeout = grace_left if timeout is None else min(timeout, grace_left)
            if open_fds and not self.log.has_room():
                wait = 0.05 if timeout is None else min(timeout, 0.05)
                started = time.monotonic()
                self.log.wait_for_room(wait)
                if exited_at is not None and paused < MAX_GRACE_PAUSE:
                    waited = time.monotonic() - started
                    exited_at += waited
                    paused += waited
                continue
            events = poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
            for fd, _mask in events:
                if fd == self._wake_read:
                    os.read(fd, 64)
                    continue
                data = self._read_output(fd)
                if data is None:
                    continue
                if data:
                    self.log.append(open_fds[fd], data)
                    self.table.daemon.touch()
                else:
                    poller.unregister(fd)
                    del open_fds[fd]
                    self._close_output(fd)
        self._finish()
        # Descendants still hold the output open: drain and discard so they never block on a full pipe.
        poller.unregister(self._wake_read)
        while open_fds:
            for fd, _mask in poller.poll():
                data = self._read_output(fd)
                if data == b"":
                    poller.unregister(fd)
                    del open_fds[fd]
                    self._close_output(fd)
        self.close_wake_pipe()

    def close_wake_pipe(self) -> None:
        os.close(self._wake_read)
        os.close(self._wake_write)

    @staticmethod
    def _read_output(fd: int) -> bytes | None:
        """Bytes from an output fd; b"" at its end (a PTY master says EIO); None when nothing is there."""
        try:
            return os.read(fd, READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _close_output(self, fd: int) -> None:
        if fd == self.master_fd:
            with self.stdin_lock:
                self.master_fd = None
                if self.stdin_fd == fd:
                    self.stdin_fd = None
                os.close(fd)
        else:
            os.close(fd)

    # --- control ---------------------------------------------------------------------------------------

    def kill_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            if not self.done.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signum)
        except PermissionError:
            pass

    def write_stdin(self, data: bytes, cancelled: threading.Event | None = None) -> int:
        view = memoryview(data)
        written = 0
        while view:
            with self.stdin_lock:
                fd = self.stdin_fd
                if fd is None:
                    if self.done.is_set():
                        raise GuestError("no_such_process", "the process has exited")
                    raise GuestError("invalid_argument", "the process's stdin is closed")
                try:
                    count = os.write(fd, view)
                except BlockingIOError:
                    count = 0
                except BrokenPipeError as exc:
                    raise GuestError("no_such_process", "the process closed its stdin") from exc
            if count:
                view = view[count:]
                written += count
                continue
            if cancelled is not None and cancelled.is_set():
                raise Cancelled
            # Full pipe: wait outside the lock so the I/O thread and other writers are never blocked.
            waiter = select.poll()
            waiter.register(fd, select.POLLOUT)
            waiter.poll(200)
        return written

    def close_stdin(self) -> None:
        with self.stdin_lock:
            fd = self.stdin_fd
            if fd is None:
                return
            if fd == self.master_fd:
                # A terminal has no half-close: send the EOF character (^D) as a typing user would.
                with contextlib.suppress(OSError):
                    os.write(fd, b"\x04")
                return
            self.stdin_fd = None
            os.close(fd)

    def resize(self, rows: int, cols: int) -> None:
        with self.stdin_lock:
            if self.master_fd is None:
                if not self.pty:
                    raise GuestError("invalid_argument", "the process has no PTY")
                raise GuestError("no_such_process", "the process's terminal is gone")
            fcntl.ioctl(self.master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def result(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "pid": self.pid,
            "argv": self.argv,
            "tag": self.tag,
            "running": not self.done.is_set(),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "pty": self.pty,
            "background": self.background,
            "output_bytes": self.log.end,
        }


class ProcessTable:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._lock = threading.Lock()
        self._processes: dict[str, Process] = {}
        self._base_env = _base_environment()

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
        argv = _argv(params)
        tag = get_str(params, "tag", None)
        background = get_bool(params, "background", False)
        want_stdin = get_bool(params, "stdin", False)
        timeout = get_float(params, "timeout", None)
        if timeout is not None and timeout <= 0:
            raise GuestError("invalid_argument", "'timeout' must be positive")
        pty_size = _pty_size(params.get("pty"))
        env = dict(self._base_env)
        user = _resolve_user(params.get("user"))
        popen_user: dict[str, Any] = {}
        if user is not None:
            uid, gid, name, home, groups = user
            env.update(HOME=home, USER=name, LOGNAME=name)
            if uid != os.geteuid():
                popen_user = {"user": uid, "group": gid, "extra_groups": groups}
        if pty_size is not None:
            env["TERM"] = "xterm-256color"
        env.update(get_str_map(params, "env"))
        cwd = _resolve_cwd(get_str(params, "cwd", None))

        process = Process(self, argv, tag, pty_size is not None, background)
        child_fds: list[int] = []
        ours: list[int] = []
        try:
            popen_io: dict[str, Any]
            preexec = None
            if pty_size is not None:
                import pty

                master, slave = pty.openpty()
                ours.append(master)
                child_fds.append(slave)
                _set_winsize(master, *pty_size)
                process.master_fd = master
                process.stdin_fd = master
                process.outputs = {master: Channel.STDOUT}
                popen_io = {"stdin": slave, "stdout": slave, "stderr": slave}
                preexec = _take_controlling_tty
            else:
                out_read, out_write = os.pipe()
                err_read, err_write = os.pipe()
                ours += [out_read, err_read]
                child_fds += [out_write, err_write]
                process.outputs = {out_read: Channel.STDOUT, err_read: Channel.STDERR}
                popen_io = {"stdin": subprocess.DEVNULL, "stdout": out_write, "stderr": err_write}
                if want_stdin:
                    in_read, in_write = os.pipe()
                    ours.append(in_write)
                    child_fds.append(in_read)
                    process.stdin_fd = in_write
                    popen_io["stdin"] = in_read
            if process.stdin_fd is not None:
                os.set_blocking(process.stdin_fd, False)

            def launch() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    close_fds=True,
                    preexec_fn=preexec,  # noqa: PLW1509 - PTY only; the hook is one ioctl, see above
                    **popen_io,
                    **popen_user,
                )

            process.popen = self.daemon.children.spawn(launch, process.on_exit)
        except BaseException:
            for fd in ours:
                os.close(fd)
            process.close_wake_pipe()
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        process.pid = process.popen.pid
        if timeout is not None:
            process.deadline = time.monotonic() + timeout
        with self._lock:
            self._processes[process.process_id] = process
        self.daemon.touch()
        threading.Thread(target=process.pump_output, name=f"io-{process.pid}", daemon=True).start()
        return process


# --- helpers -------------------------------------------------------------------------------------------


def _base_environment() -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    env.update(
        (key, value)
        for key, value in os.environ.items()
        if not key.startswith("SPACED_") and key != "PYTHONPATH"
    )
    return env


def _argv(params: dict[str, Any]) -> list[str]:
    argv = params.get("argv")
    cmd = params.get("cmd")
    if (argv is None) == (cmd is None):
        raise GuestError("invalid_argument", "give exactly one of 'argv' (a list) or 'cmd' (a shell string)")
    if cmd is not None:
        if not isinstance(cmd, str):
            raise GuestError("invalid_argument", "'cmd' must be a string")
        return ["/bin/sh", "-c", cmd]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise GuestError("invalid_argument", "'argv' must be a non-empty list of strings")
    return argv


def _pty_size(value: Any) -> tuple[int, int] | None:
    if value is None or value is False:
        return None
    if value is True:
        return 24, 80
    if not isinstance(value, dict):
        raise GuestError("invalid_argument", "'pty' must be an object {rows, cols} or true")
    rows = get_int(value, "rows", 24)
    cols = get_int(value, "cols", 80)
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_argument", "PTY rows and cols must be 1..65535")
    return rows, cols


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_tty() -> None:
    # Runs in the child between fork and exec, after setsid: only a plain ioctl, no locks, no imports.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _resolve_user(value: Any) -> tuple[int, int, str, str, list[int]] | None:
    """(uid, gid, name, home, supplementary groups) of a user given by name or uid."""
    if value is None:
        return None
    import pwd

    if isinstance(value, str) and value.isdigit():
        value = int(value)
    try:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise GuestError("invalid_argument", "'user' must be a name or a uid")
        entry = pwd.getpwnam(value) if isinstance(value, str) else pwd.getpwuid(value)
    except KeyError:
        if isinstance(value, int) and value >= 0:
            return value, value, str(value), "/", []
        raise GuestError("invalid_argument", f"unknown user {value!r}") from None
    try:
        groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    except OSError:
        groups = [entry.pw_gid]
    return entry.pw_uid, entry.pw_gid, entry.pw_name, entry.pw_dir, groups


def _resolve_cwd(cwd: str | None) -> str:
    if cwd is None:
        return WORKDIR if os.path.isdir(WORKDIR) else "/"
    return os.path.join(WORKDIR, cwd)


# --- handlers --------------------------------------------------------------------------------------------


def process_start(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
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
                raise GuestError(
                    "cancelled",
                    "detached; the process keeps running",
                    process_id=process.process_id,
                    offset=offset,
                ) from None
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
                raise GuestError(
                    "cancelled",
                    "detached; the process keeps running",
                    process_id=process.process_id,
                    offset=offset,
                ) from None
            offset = at + len(data)
            log.move_hold(hold, offset)
    finally:
        log.release_hold(hold)
        call.remove_waker(log.wake)
    if not follow:
        return {"process_id": process.process_id, "offset": offset, "running": not process.done.is_set()}
    process.done.wait()
    return {**process.result(), "offset": offset}


def process_attach(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    offset = get_int(params, "offset", 0)
    if offset < 0:
        raise GuestError("invalid_argument", "'offset' must be >= 0")
    return _follow(call, process, offset, follow=get_bool(params, "follow", True), announce=True)


def process_input(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    close = get_bool(params, "eof", False)
    written = 0
    for chunk in call.body():
        written += process.write_stdin(chunk, call.cancelled)
    if close:
        process.close_stdin()
    return {"written": written}


def process_signal(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
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


def process_resize(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    process = daemon.processes.get(params.get("process_id"))
    rows = get_int(params, "rows")
    cols = get_int(params, "cols")
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_argument", "rows and cols must be 1..65535")
    process.resize(rows, cols)
    return {}


def process_list(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    return {"processes": [process.describe() for process in daemon.processes.all()]}
