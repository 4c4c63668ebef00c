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

from space.core import errors

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
#: How long a freeze may take to converge before it is given up (it takes well under 1 ms when idle).
FREEZE_WAIT_S = 1.0
#: How long a thaw may take: the kernel thaws in one pass, so this only bounds a broken cgroup.
THAW_WAIT_S = 2.0
#: How often the freeze request is written again while tasks are still freezing (see the module's doc).
REWRITE_EVERY_S = 0.002


class CgroupFreezer:
    def __init__(self, root: pathlib.Path = CGROUP_ROOT) -> None:
        self.root = root

    def _v1(self, cgroup: str) -> pathlib.Path | None:
        path = self.root / "freezer" / cgroup / "freezer.state"
        return path if path.exists() else None

    def _v2(self, cgroup: str) -> pathlib.Path | None:
        path = self.root / cgroup / "cgroup.freeze"
        return path if path.exists() else None

    def available(self, cgroup: str) -> bool:
        return self._v1(cgroup) is not None or self._v2(cgroup) is not None

    def frozen(self, cgroup: str) -> bool:
        """Whether a freeze of `cgroup` was asked and not undone (False without a freezer)."""
        if (v1 := self._v1(cgroup)) is not None:
            return _read(v1) in {"FROZEN", "FREEZING"}
        if (v2 := self._v2(cgroup)) is not None:
            return _read(v2) == "1"
        return False

    def freeze(self, cgroup: str) -> bool:
        """Freeze every task of `cgroup`; False (thawed again) without a freezer or if it did not converge."""
        if (v1 := self._v1(cgroup)) is not None:
            done = self._converge(v1, "FROZEN", lambda: _read(v1) == "FROZEN", FREEZE_WAIT_S)
        elif (v2 := self._v2(cgroup)) is not None:
            events = v2.with_name("cgroup.events")
            done = self._converge(v2, "1", lambda: _event(events, "frozen") == "1", FREEZE_WAIT_S)
        else:
            return False
        if not done:
            self.thaw(cgroup)
        return done

    def thaw(self, cgroup: str) -> None:
        """Let every task of `cgroup` run again (nothing to do without a freezer or when not frozen)."""
        if (v1 := self._v1(cgroup)) is not None:
            done = self._converge(v1, "THAWED", lambda: _read(v1) == "THAWED", THAW_WAIT_S)
        elif (v2 := self._v2(cgroup)) is not None:
            events = v2.with_name("cgroup.events")
            done = self._converge(v2, "0", lambda: _event(events, "frozen") in {"0", None}, THAW_WAIT_S)
        else:
            return
        if not done:
            raise errors.RuntimeFailure(f"cgroup {cgroup} did not thaw within {THAW_WAIT_S:.0f} s")

    @staticmethod
    def _converge(control: pathlib.Path, request: str, reached: Callable[[], bool], wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        written = 0.0
        while True:
            now = time.monotonic()
            if now - written >= REWRITE_EVERY_S:
                try:
                    control.write_text(request)
                except OSError:
                    return False  # the cgroup went away: its runtime ended
                written = now
            if reached():
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
