"""One process spaced started: its I/O thread, its stdin, its signals and terminal, and how it ends.

Invariants:
- Exit statuses come only from the ChildWatcher (see children.py): `on_exit` records the status and wakes the
  I/O thread; Popen never waits, its returncode is set here when the status arrives.
- One I/O thread per process (`pump_output`) owns the output fds: it moves bytes into the process's
  OutputLog, enforces the timeout (SIGKILL to the whole group), and ends the process (log closed, `done`
  set, `on_finished` called) once the process exited and its output reached EOF — or EXIT_GRACE after the
  exit when descendants keep the pipes open (their later output is drained and discarded so they never
  block on a full pipe, but it is not part of the process's output).
- Nobody else blocks on process output: callers follow the log. While a holding follower is behind, the
  I/O thread stops reading and the process blocks on its own writes (flow control); the grace clock stops
  meanwhile, for at most MAX_GRACE_PAUSE, so a slow follower does not cut off the last output.
- Stdin fds are non-blocking and written under a per-process lock that is never held while waiting, so a
  process that does not read its stdin can stall only the call writing to it. A PTY's stdin is its master:
  closing it types ^D instead (a terminal has no half-close).
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
from collections.abc import Callable
from typing import Any

from space.guest.channel import Cancelled, GuestError
from space.guest.outputlog import OutputLog
from space.protocol.frames import Channel

EXIT_GRACE = 0.5  # seconds to wait for output EOF after the process itself exited
MAX_GRACE_PAUSE = 10.0  # the grace clock stops while a slow follower holds the log, at most this long
ROOM_POLL = 0.05  # seconds between checks for room in the log while a follower is behind
READ_SIZE = 65535
MAX_POLL_MS = 60_000  # the longest single wait of the output pump (see _read_ready)


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class _Pump:
    """The I/O thread's state: the output fds still open, and the clock of the grace after the exit."""

    __slots__ = ("exited_at", "open_fds", "paused", "poller")

    def __init__(self, outputs: dict[int, Channel], wake_fd: int) -> None:
        self.poller = select.poll()
        for fd in outputs:
            self.poller.register(fd, select.POLLIN)
        self.poller.register(wake_fd, select.POLLIN)
        self.open_fds = dict(outputs)
        self.exited_at: float | None = None
        self.paused = 0.0


class Process:
    def __init__(
        self,
        argv: list[str],
        tag: str | None,
        pty: bool,
        background: bool,
        *,
        on_activity: Callable[[], None],
        on_finished: Callable[[Process], None],
    ) -> None:
        self.process_id = os.urandom(8).hex()
        self.argv = argv
        # What the caller asked for (not the whole inherited environment), and the directory it runs in:
        # process.list shows them (envd's List does); the env only when asked (it may hold secrets).
        self.requested_env: dict[str, str] = {}
        self.cwd: str | None = None
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
        self._on_activity = on_activity
        self._on_finished = on_finished
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
        self._on_finished(self)

    # --- the I/O thread --------------------------------------------------------------------------------

    def pump_output(self) -> None:
        pump = _Pump(self.outputs, self._wake_read)
        while True:
            now = time.monotonic()
            if self._output_settled(pump, now):
                break
            timeout = self._next_timeout(pump, now)
            if pump.open_fds and not self.log.has_room():
                self._wait_for_log_room(pump, timeout)
                continue
            self._read_ready(pump, timeout)
        self._finish()
        self._discard_late_output(pump)
        self.close_wake_pipe()

    def _output_settled(self, pump: _Pump, now: float) -> bool:
        """True once the process exited and its output reached EOF, or EXIT_GRACE after the exit."""
        if pump.exited_at is None and self.exit_status is not None:
            pump.exited_at = now
        return pump.exited_at is not None and (not pump.open_fds or now - pump.exited_at >= EXIT_GRACE)

    def _next_timeout(self, pump: _Pump, now: float) -> float | None:
        """How long the next poll may wait: until the timeout (which, once passed, kills the group) or the
        end of the exit grace; None for as long as it takes."""
        timeout: float | None = None
        if self.deadline is not None and self.exit_status is None:
            if now >= self.deadline:
                self.timed_out = True
                self.deadline = None
                self.kill_group(signal.SIGKILL)
            else:
                timeout = self.deadline - now
        if pump.exited_at is not None:
            grace_left = pump.exited_at + EXIT_GRACE - now
            timeout = grace_left if timeout is None else min(timeout, grace_left)
        return timeout

    def _wait_for_log_room(self, pump: _Pump, timeout: float | None) -> None:
        """A holding follower is behind: read nothing (the process blocks on its writes) and stop the grace
        clock meanwhile, for at most MAX_GRACE_PAUSE in all."""
        wait = ROOM_POLL if timeout is None else min(timeout, ROOM_POLL)
        started = time.monotonic()
        self.log.wait_for_room(wait)
        if pump.exited_at is not None and pump.paused < MAX_GRACE_PAUSE:
            waited = time.monotonic() - started
            pump.exited_at += waited
            pump.paused += waited

    def _read_ready(self, pump: _Pump, timeout: float | None) -> None:
        # Bounded: poll() takes a C int of milliseconds, and a long process timeout (days) would overflow it
        # and end this thread (found by fuzzing); the loop recomputes the wait after each wake-up.
        wait_ms = None if timeout is None else min(MAX_POLL_MS, max(0, int(timeout * 1000) + 1))
        events = pump.poller.poll(wait_ms)
        for fd, _mask in events:
            if fd == self._wake_read:
                os.read(fd, 64)
                continue
            data = self._read_output(fd)
            if data is None:
                continue
            if data:
                self.log.append(pump.open_fds[fd], data)
                self._on_activity()
            else:
                self._end_output(pump, fd)

    def _discard_late_output(self, pump: _Pump) -> None:
        """Descendants still hold the output open: drain and discard so they never block on a full pipe."""
        pump.poller.unregister(self._wake_read)
        while pump.open_fds:
            for fd, _mask in pump.poller.poll():
                if self._read_output(fd) == b"":
                    self._end_output(pump, fd)

    def _end_output(self, pump: _Pump, fd: int) -> None:
        pump.poller.unregister(fd)
        del pump.open_fds[fd]
        self._close_output(fd)

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
                    raise GuestError("not_a_terminal", "the process was started without a PTY")
                raise GuestError("no_such_process", "the process's terminal is gone")
            set_winsize(self.master_fd, rows, cols)

    def result(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
        }

    def describe(self, *, with_env: bool = False) -> dict[str, Any]:
        found = self._description()
        if with_env:
            found["env"] = dict(self.requested_env)
        return found

    def _description(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "cwd": self.cwd,
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
