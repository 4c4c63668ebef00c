"""Supervision of the processes `space up` starts (root helper, control plane, node agent; the egress
gateway runs inside the agent): a component that dies is started again after a back-off, and what happened
is logged and kept in a status file for `space status`.

Invariants:
- Nothing is restarted once `stop()` was called: `space down` never fights a restart loop. Every decision
  is taken in `tick()`, on the caller's one thread, so `stop()` between two ticks is final.
- A component that dies (or fails to start) less than `Backoff.stable_s` after it was started waits
  `initial_s · factor^(n-1)` (capped at `cap_s`) before its n-th consecutive start; one that ran at least
  `stable_s` starts over at `initial_s`. A component that dies at once on every start therefore costs at
  most one start per `cap_s` once the back-off is capped: no hot loop.
- Components are checked and restarted in the order given (helper, control plane, agent): when several
  are due at once, what the others depend on comes first.
- Every death (exit code or signal), failed start and restart is one JSON line handed to `emit`, and the
  status file (owner-only, ADR 0022; replaced atomically, never half written) is rewritten on every change.
- The clock is injected (`clock` for back-off arithmetic, `wall` for the times shown), so the back-off is
  tested with a fake clock (tests/controlplane/test_supervisor_backoff.py), not by waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

STATUS_FILENAME = "status.json"
ComponentState = Literal["running", "waiting", "stopping", "stopped"]
Emit = Callable[[dict[str, Any]], None]


class Process(Protocol):
    """What the supervisor needs of a started process (subprocess.Popen has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 60.0
    #: A component that stayed up this long counts as healthy: its next death starts the back-off over.
    stable_s: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before the start that follows `failures` (≥ 1) consecutive quick deaths."""
        return float(min(self.cap_s, self.initial_s * self.factor ** max(0, failures - 1)))


@dataclass(frozen=True)
class Component:
    name: str
    #: Starts the component and returns its process; raises when it cannot (any exception: a failed start).
    start: Callable[[], Process]


@dataclass
class ComponentStatus:
    """One row of the status file (times are wall-clock epoch seconds, for `space status`)."""

    name: str
    pid: int | None = None
    state: ComponentState = "stopped"
    started_at: float | None = None
    restarts: int = 0
    last_exit: str | None = None
    last_exit_at: float | None = None
    next_start_at: float | None = None
    #: Consecutive deaths (or failed starts) within `stable_s` of a start: the back-off exponent.
    failures: int = 0


def describe_exit(returncode: int) -> str:
    """`exit 3`, or `signal SIGKILL` for a process killed by a signal (Popen's negative return code)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class Supervisor:
    def __init__(
        self,
        components: list[Component],
        *,
        emit: Emit,
        status_file: pathlib.Path | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.components = {component.name: component for component in components}
        self.status = {component.name: ComponentStatus(component.name) for component in components}
        self.processes: dict[str, Process] = {}
        self.emit = emit
        self.status_file = status_file
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.wall = wall
        #: Shown in the status file as is (the API's url, the supervisor's pid).
        self.extra = dict(extra or {})
        self.stopping = False
        self._started_mono: dict[str, float] = {}
        self._due: dict[str, float] = {}

    # -- the loop ----------------------------------------------------------------------------------------
    def adopt(self, name: str, process: Process) -> None:
        """Supervise `process`, started by the caller as the first run of component `name`."""
        self._running(name, process)
        self.write_status()

    def tick(self) -> None:
        """Notice deaths and start what is due; call it every fraction of a second."""
        for name in self.components:
            if self.stopping:
                return
            process = self.processes.get(name)
            returncode = process.poll() if process is not None else None
            if process is not None and returncode is not None:
                self._died(name, process.pid, describe_exit(returncode))
            due = self._due.get(name)
            if due is not None and self.clock() >= due:
                self._restart(name)

    def stop(self) -> None:
        """No more restarts; every component is marked stopping (the caller stops the processes)."""
        self.stopping = True
        self._due.clear()
        for status in self.status.values():
            status.next_start_at = None
            if status.state != "stopped":
                status.state = "stopping"
        self.write_status()

    def stopped(self) -> None:
        for status in self.status.values():
            status.state, status.pid, status.next_start_at = "stopped", None, None
        self.processes.clear()
        self.write_status()

    # -- transitions ---------------------------------------------------------------------------------------
    def _running(self, name: str, process: Process) -> None:
        status = self.status[name]
        self.processes[name] = process
        self._started_mono[name] = self.clock()
        status.pid, status.state, status.started_at, status.next_start_at = (
            process.pid, "running", self.wall(), None
        )  # fmt: skip

    def _died(self, name: str, pid: int | None, how: str) -> None:
        status = self.status[name]
        self.processes.pop(name, None)
        ran_s = self.clock() - self._started_mono.get(name, self.clock())
        status.failures = 1 if ran_s >= self.backoff.stable_s else status.failures + 1
        delay = self.backoff.delay(status.failures)
        self._due[name] = self.clock() + delay
        status.pid, status.state, status.last_exit, status.last_exit_at = None, "waiting", how, self.wall()
        status.next_start_at = self.wall() + delay
        self.emit(
            {"event": "component.exited", "component": name, "pid": pid, "exit": how,
             "ran_s": round(ran_s, 3), "restart_in_s": delay, "restarts": status.restarts}
        )  # fmt: skip
        self.write_status()

    def _restart(self, name: str) -> None:
        self._due.pop(name, None)
        self._started_mono[name] = self.clock()
        try:
            process = self.components[name].start()
        except Exception as exc:
            # The supervisor must outlive any failure of what it starts (it is what keeps the rest up).
            self._died(name, None, f"start failed: {type(exc).__name__}: {exc}"[:300])
            return
        self.status[name].restarts += 1
        self._running(name, process)
        self.emit(
            {"event": "component.restarted", "component": name, "pid": process.pid,
             "restarts": self.status[name].restarts}
        )  # fmt: skip
        self.write_status()

    # -- the status file -------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            **self.extra,
            "stopping": self.stopping,
            "updated_at": self.wall(),
            "components": [asdict(status) for status in self.status.values()],
        }

    def write_status(self) -> None:
        """Replace the status file (0600) with the current snapshot; a missing directory (purged) is left
        alone."""
        if self.status_file is None:
            return
        tmp = self.status_file.with_name(self.status_file.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            return
        with os.fdopen(fd, "w") as handle:
            json.dump(self.snapshot(), handle)
        os.replace(tmp, self.status_file)


def read_status(data_dir: pathlib.Path) -> dict[str, Any] | None:
    """The status file of the installation in `data_dir` (None: none written, or unreadable)."""
    try:
        value = json.loads((data_dir / STATUS_FILENAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
