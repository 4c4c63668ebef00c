"""Pausing a runtime with the kernel's cgroup freezer instead of `runsc pause` (ADR 0082; root helper only).

`runsc pause`/`resume` start a Go binary that loads the container's state and asks the sandbox to stop its
tasks (~25 ms each on the reference machine); freezing the container's cgroup stops every process of the
runtime (sandbox, gofer, their stubs) in well under a millisecond, and thawing it lets them go on.

Invariants:
- A cgroup is frozen when its freezer says so (v1 `freezer.state` FROZEN, or still FREEZING: a freeze was
  asked and never undone; v2 `cgroup.freeze` 1). That kernel state is the only record of a pause made here:
  it survives a helper restart and needs no file of ours.
- `freeze` answers True only once the kernel reports every task frozen. Under runsc's ptrace platform a
  task that enters a ptrace stop after the freezer's pass is left unfrozen (v1 stays FREEZING), so the
  request is written again until it converges; one that does not converge within FREEZE_WAIT_S is thawed
  again and answers False, for the caller to pause the runtime another way. So is a runtime without a
  freezer (no cgroup, cgroups ignored).
- Paths are built from a cgroup name the helper derived itself (`<parent>/<container>`), never from a
  caller's text.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import NamedTuple

from space.core import errors

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
#: How long a freeze may take to converge before it is given up (it takes well under 1 ms when idle).
FREEZE_WAIT_S = 1.0
#: How long a thaw may take: the kernel thaws in one pass, so this only bounds a broken cgroup.
THAW_WAIT_S = 2.0
#: How often the freeze request is written again while tasks are still freezing (see the module's doc).
REWRITE_EVERY_S = 0.002


class _Knob(NamedTuple):
    """One cgroup's freezer: the file a request is written to, the value asking each state, and the
    kernel's answer (True frozen, False thawed, None still freezing)."""

    control: pathlib.Path
    asking: dict[bool, str]
    state: Callable[[], bool | None]


class CgroupFreezer:
    def __init__(self, root: pathlib.Path = CGROUP_ROOT) -> None:
        self.root = root

    def _knob(self, cgroup: str) -> _Knob | None:
        """cgroup v1's `freezer.state` (which reads back the state itself), or v2's `cgroup.freeze` (whose
        state is a line of `cgroup.events`); None without a freezer."""
        v1 = self.root / "freezer" / cgroup / "freezer.state"
        if v1.exists():
            return _Knob(
                v1,
                {True: "FROZEN", False: "THAWED"},
                lambda: {"FROZEN": True, "THAWED": False}.get(_read(v1) or ""),
            )
        v2 = self.root / cgroup / "cgroup.freeze"
        if v2.exists():
            events = v2.with_name("cgroup.events")
            return _Knob(v2, {True: "1", False: "0"}, lambda: _event(events, "frozen") == "1")
        return None

    def available(self, cgroup: str) -> bool:
        return self._knob(cgroup) is not None

    def frozen(self, cgroup: str) -> bool:
        """Whether a freeze of `cgroup` was asked and not undone (v1 FREEZING counts; False without a
        freezer)."""
        knob = self._knob(cgroup)
        return knob is not None and _read(knob.control) not in {knob.asking[False], None}

    def freeze(self, cgroup: str) -> bool:
        """Freeze every task of `cgroup`; False (thawed again) without a freezer or if it did not converge."""
        knob = self._knob(cgroup)
        if knob is None:
            return False
        done = self._converge(knob, True, FREEZE_WAIT_S)
        if not done:
            self.thaw(cgroup)
        return done

    def thaw(self, cgroup: str) -> None:
        """Let every task of `cgroup` run again (nothing to do without a freezer)."""
        knob = self._knob(cgroup)
        if knob is not None and not self._converge(knob, False, THAW_WAIT_S):
            raise errors.RuntimeFailure(f"cgroup {cgroup} did not thaw within {THAW_WAIT_S:.0f} s")

    @staticmethod
    def _converge(knob: _Knob, frozen: bool, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        written = 0.0
        while True:
            now = time.monotonic()
            if now - written >= REWRITE_EVERY_S:
                try:
                    knob.control.write_text(knob.asking[frozen])
                except OSError:
                    return False  # the cgroup went away: its runtime ended
                written = now
            if knob.state() is frozen:
                return True
            if now > deadline:
                return False
            time.sleep(0.0002)


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _event(path: pathlib.Path, key: str) -> str | None:
    """The value of `key` in a `key value` lines file (cgroup v2's cgroup.events)."""
    text = _read(path)
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return value.strip()
    return None
