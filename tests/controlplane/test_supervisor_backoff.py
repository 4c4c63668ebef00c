"""The supervisor of `space up` (space.controlplane.supervisor) on a fake clock and fake processes: restart
with exponential back-off (capped, reset after a stable run), a component that dies at once on every start
costs one start per back-off period (no hot loop), a failed start counts as a death, deaths and restarts
are logged, the status file (0600) follows, and nothing restarts after stop()."""

from __future__ import annotations

import json
import pathlib
import signal
import stat
from typing import Any

from space.controlplane.supervisor import (
    STATUS_FILENAME,
    Backoff,
    Component,
    Supervisor,
    describe_exit,
    read_status,
)
from space.core import errors


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Starter:
    """Starts fake processes; `dies_at_once`: each one has exited before the supervisor looks."""

    def __init__(self, clock: FakeClock, *, dies_at_once: bool = False) -> None:
        self.clock = clock
        self.dies_at_once = dies_at_once
        self.fail_with: Exception | None = None
        self.started: list[FakeProcess] = []
        self.times: list[float] = []
        self.next_pid = 100

    def __call__(self) -> FakeProcess:
        self.times.append(self.clock.now)
        if self.fail_with is not None:
            raise self.fail_with
        self.next_pid += 1
        process = FakeProcess(self.next_pid)
        if self.dies_at_once:
            process.returncode = 1
        self.started.append(process)
        return process


def make(
    tmp_path: pathlib.Path, starter: Starter, clock: FakeClock, backoff: Backoff
) -> tuple[Supervisor, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    sup = Supervisor(
        [Component("agent", starter)], emit=events.append, status_file=tmp_path / STATUS_FILENAME,
        backoff=backoff, clock=clock, wall=clock, extra={"url": "http://127.0.0.1:1"},
    )  # fmt: skip
    return sup, events


def run_for(sup: Supervisor, clock: FakeClock, seconds: float, step: float = 0.1) -> None:
    end = clock.now + seconds
    while clock.now < end:
        sup.tick()
        clock.now = round(clock.now + step, 6)


def test_a_component_that_dies_at_once_backs_off_exponentially_up_to_the_cap(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock, dies_at_once=True)
    sup, events = make(tmp_path, starter, clock, Backoff(initial_s=1, factor=2, cap_s=8, stable_s=30))
    first = FakeProcess(1)
    sup.adopt("agent", first)
    first.returncode = -signal.SIGKILL
    run_for(sup, clock, 60.0)
    # The kill is seen at t=0 and the first start follows 1 s later; each later start dies at once, which
    # the next tick (0.1 s) sees, and waits 2, 4, 8, 8, 8, ... s.
    gaps = [round(b - a, 1) for a, b in zip([1000.0, *starter.times], starter.times, strict=False)]
    assert gaps[:4] == [1.0, 2.1, 4.1, 8.1], gaps
    assert set(gaps[4:]) == {8.1}, gaps
    # 60 s of a component that never stays up: a handful of starts, not a hot loop.
    assert len(starter.times) == 9, starter.times
    status = sup.status["agent"]
    assert status.restarts == 9 and status.state == "waiting" and status.last_exit == "exit 1"
    exited = [e for e in events if e["event"] == "component.exited"]
    assert exited[0]["exit"] == "signal SIGKILL" and exited[0]["restart_in_s"] == 1.0
    assert [e["restart_in_s"] for e in exited[1:5]] == [2.0, 4.0, 8.0, 8.0]
    assert [e["restarts"] for e in events if e["event"] == "component.restarted"] == list(range(1, 10))


def test_a_stable_run_resets_the_back_off(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock)
    sup, events = make(tmp_path, starter, clock, Backoff(initial_s=1, factor=2, cap_s=60, stable_s=30))
    sup.adopt("agent", FakeProcess(1))
    for _ in range(3):  # three quick deaths: 1, 2, 4 s
        sup.processes["agent"].returncode = 1  # type: ignore[attr-defined]
        run_for(sup, clock, 10.0)
    delays = [e["restart_in_s"] for e in events if e["event"] == "component.exited"]
    assert delays == [1.0, 2.0, 4.0]
    run_for(sup, clock, 31.0)  # up for longer than stable_s ...
    sup.processes["agent"].returncode = 1  # type: ignore[attr-defined]
    run_for(sup, clock, 0.2)
    assert events[-1]["event"] == "component.exited" and events[-1]["restart_in_s"] == 1.0  # ... starts over
    assert sup.status["agent"].failures == 1


def test_a_failed_start_counts_as_a_death_and_is_retried_later(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock)
    starter.fail_with = errors.RuntimeFailure("node helper exited at start: boom")
    sup, events = make(tmp_path, starter, clock, Backoff(initial_s=1, factor=2, cap_s=60, stable_s=30))
    first = FakeProcess(1)
    sup.adopt("agent", first)
    first.returncode = 2
    run_for(sup, clock, 3.5)
    assert [round(t - 1000.0, 1) for t in starter.times] == [1.0, 3.0]
    assert sup.status["agent"].last_exit is not None
    assert sup.status["agent"].last_exit.startswith(
        "start failed: RuntimeFailure: node helper exited at start"
    )
    waiting = sup.status["agent"]
    assert waiting.restarts == 0 and waiting.state == "waiting"
    starter.fail_with = None
    run_for(sup, clock, 4.0)
    running = sup.status["agent"]
    assert running.state == "running" and running.restarts == 1
    assert events[-1] == {"event": "component.restarted", "component": "agent", "pid": 101, "restarts": 1}


def test_any_exception_from_a_start_is_a_failed_start_not_the_supervisors_end(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock)
    starter.fail_with = RuntimeError("a bug in a start function")
    sup, _events = make(tmp_path, starter, clock, Backoff(initial_s=1, factor=2, cap_s=60, stable_s=30))
    first = FakeProcess(1)
    sup.adopt("agent", first)
    first.returncode = 1
    run_for(sup, clock, 4.0)  # no exception escapes tick()
    assert len(starter.times) == 2
    assert sup.status["agent"].last_exit == "start failed: RuntimeError: a bug in a start function"


def test_nothing_restarts_after_stop(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock)
    sup, _events = make(tmp_path, starter, clock, Backoff(initial_s=1))
    first = FakeProcess(1)
    sup.adopt("agent", first)
    first.returncode = -signal.SIGTERM
    sup.tick()  # the death is seen, a restart is due in 1 s ...
    sup.stop()  # ... but `space down` came first
    run_for(sup, clock, 10.0)
    assert starter.times == []
    assert sup.status["agent"].state == "stopping"
    sup.stopped()
    assert read_status(tmp_path)["components"][0]["state"] == "stopped"  # type: ignore[index]


def test_the_status_file_is_owner_only_and_follows_every_change(tmp_path: pathlib.Path) -> None:
    clock = FakeClock()
    starter = Starter(clock)
    sup, _events = make(tmp_path, starter, clock, Backoff(initial_s=1))
    first = FakeProcess(7)
    sup.adopt("agent", first)
    path = tmp_path / STATUS_FILENAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = json.loads(path.read_text())
    assert written["url"] == "http://127.0.0.1:1"
    assert written["components"][0] | {"started_at": None} == {
        "name": "agent", "pid": 7, "state": "running", "started_at": None, "restarts": 0,
        "last_exit": None, "last_exit_at": None, "next_start_at": None, "failures": 0,
    }  # fmt: skip
    first.returncode = -signal.SIGKILL
    sup.tick()
    row = json.loads(path.read_text())["components"][0]
    assert row["state"] == "waiting" and row["pid"] is None and row["last_exit"] == "signal SIGKILL"
    assert row["next_start_at"] == clock.now + 1
    run_for(sup, clock, 1.5)
    row = json.loads(path.read_text())["components"][0]
    assert row["state"] == "running" and row["pid"] == 101 and row["restarts"] == 1
    assert not (tmp_path / (STATUS_FILENAME + ".tmp")).exists()
    # A purged data directory is not recreated by a late status write.
    gone = Supervisor(
        [Component("agent", starter)], emit=lambda _e: None, status_file=tmp_path / "gone" / "s"
    )
    gone.write_status()
    assert not (tmp_path / "gone").exists()


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(0) == "exit 0"
    assert describe_exit(3) == "exit 3"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"
    assert describe_exit(-200) == "signal 200"
