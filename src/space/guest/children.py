"""Exit statuses of the daemon's children; the only code in spaced that calls waitpid.

Two modes, chosen once at start:
- reap-all (spaced is PID 1, or SPACED_REAP_ALL=1): one thread blocks in waitpid(-1) and so also reaps
  orphans re-parented to the daemon. A status whose pid is not registered yet (the child exited before
  `spawn` registered it) is parked while a spawn is in flight and claimed at registration; with no spawn
  in flight an unknown pid is an orphan and its status is dropped. Outside PID 1 the daemon makes itself
  a child subreaper so orphans come to it as they would to an init.
- per-child (a plain host subprocess, e.g. under tests): one thread per child waits for that pid only, so
  other children of the same process are never stolen.
In both modes Popen never waits for anything itself: the owner of the Popen sets its returncode from the
status delivered here, before the Popen object can be dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

PR_SET_CHILD_SUBREAPER = 36


class HasPid(Protocol):
    @property
    def pid(self) -> int: ...


ExitCallback = Callable[[int], None]
Child = TypeVar("Child", bound=HasPid)


class ChildWatcher:
    def __init__(self, reap_all: bool) -> None:
        self.reap_all = reap_all
        self.orphans_reaped = 0
        self._cond = threading.Condition()
        self._callbacks: dict[int, ExitCallback] = {}
        self._parked: dict[int, int] = {}
        self._spawning = 0
        self._generation = 0
        if reap_all:
            if os.getpid() != 1:
                _become_subreaper()
            threading.Thread(target=self._reap_forever, name="reaper", daemon=True).start()

    def spawn(self, start: Callable[[], Child], on_exit: ExitCallback) -> Child:
        """Run `start` (which forks one child) and deliver that child's wait status to `on_exit` once."""
        with self._cond:
            self._spawning += 1
        try:
            child = start()
        except BaseException:
            with self._cond:
                self._finish_spawn()
            raise
        pid = child.pid
        with self._cond:
            status = self._parked.pop(pid, None)
            if status is None:
                self._callbacks[pid] = on_exit
            self._finish_spawn()
        if status is not None:
            on_exit(status)
        elif not self.reap_all:
            threading.Thread(target=self._wait_one, args=(pid,), name=f"wait-{pid}", daemon=True).start()
        return child

    def _finish_spawn(self) -> None:
        self._spawning -= 1
        if not self._spawning:
            # Whatever is still parked belongs to no spawn: orphans, or a child whose exec failed.
            self._parked.clear()
        self._generation += 1
        self._cond.notify_all()

    def _wait_one(self, pid: int) -> None:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        self._deliver(pid, status)

    def _reap_forever(self) -> None:
        while True:
            with self._cond:
                generation = self._generation
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # No children at all: sleep until the next spawn instead of spinning.
                with self._cond:
                    while self._generation == generation:
                        self._cond.wait()
                continue
            self._deliver(pid, status)

    def _deliver(self, pid: int, status: int) -> None:
        with self._cond:
            callback = self._callbacks.pop(pid, None)
            if callback is None:
                if self._spawning:
                    self._parked[pid] = status
                else:
                    self.orphans_reaped += 1
                return
        try:
            callback(status)
        except Exception as exc:  # a faulty callback must not stop the reaper
            os.write(2, f"spaced: exit callback for pid {pid} failed: {exc!r}\n".encode())


def _become_subreaper() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
