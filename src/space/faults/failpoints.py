"""Kill points: named steps where a process of SPACE may be made to SIGKILL itself (crash injection).

Every component calls `hit(name)` at its named steps; the names are derived from the tables that define
the steps (the lifecycle table, the node RPC routes, the root helper's verb table, the artifact parts), so
a new step is a new kill point without anyone listing it (`space.controlplane.failpoints.all_points()`
assembles the full list; docs/adr/0038-crash-injection-harness.md).

Arming (read ONCE, from the process's own environment, when this module is first imported):
- `SPACE_FAILPOINTS`: comma-separated point names, or `*` for every point. Unset or empty (always, in
  production: no component and no installer sets it) nothing is armed and `hit` is one truth test.
- `SPACE_FAILPOINTS_ONCE`: the path of a journal. A point the journal names is disarmed; a process that
  dies at a point appends its name to the journal first (one O_APPEND write, fsynced). So a process that
  is restarted with the same environment goes past the points it already died at: "fire once", which lets
  one pass of a scenario die once at every point it reaches.

Invariants:
- Unarmed, `hit` has no side effect. Armed, it never returns at an armed point that the journal does not
  name: the process is SIGKILLed (nothing gets to clean up, exactly like a crash).
- At most one thread of a process fires (a lock): the journal never names a point the process did not die
  at.
- Standard library only (`os`, `signal`, `threading`), so every layer may import it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

EVERY_POINT: Final = "*"
ARM_VARIABLE: Final = "SPACE_FAILPOINTS"
JOURNAL_VARIABLE: Final = "SPACE_FAILPOINTS_ONCE"
PHASES: Final = ("before", "after")


@dataclass(frozen=True)
class Arming:
    """What a process's environment arms: named points or every point, minus the journal's."""

    names: frozenset[str] = frozenset()
    every: bool = False
    journal: str | None = None
    fired: frozenset[str] = frozenset()

    @property
    def active(self) -> bool:
        return self.every or bool(self.names)

    def armed(self, name: str) -> bool:
        return (self.every or name in self.names) and name not in self.fired


def read_journal(path: str) -> frozenset[str]:
    """The points a journal says already fired (a missing journal: none)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return frozenset(line.strip() for line in handle if line.strip())
    except FileNotFoundError:
        return frozenset()


def arming_from(environ: Mapping[str, str]) -> Arming:
    """The arming an environment asks for (pure apart from reading the journal it names)."""
    names = frozenset(part.strip() for part in environ.get(ARM_VARIABLE, "").split(",") if part.strip())
    journal = environ.get(JOURNAL_VARIABLE) or None
    if not names:
        return Arming()
    return Arming(
        names=names - {EVERY_POINT},
        every=EVERY_POINT in names,
        journal=journal,
        fired=read_journal(journal) if journal else frozenset(),
    )


_ARMING: Arming = arming_from(os.environ)
_FIRING: Final = threading.Lock()

if _ARMING.active:  # loud, so an armed process is never mistaken for a production one
    print(
        f"space: crash injection ARMED in pid {os.getpid()} ({ARM_VARIABLE}={os.environ[ARM_VARIABLE]!r})",
        file=sys.stderr,
        flush=True,
    )


def arming() -> Arming:
    """This process's arming (read at import)."""
    return _ARMING


def armed() -> bool:
    """Whether anything is armed in this process (components skip installing hooks when not)."""
    return _ARMING.active


def hit(name: str) -> None:
    """Die here (SIGKILL) if the point `name` is armed and has not fired yet (see module docstring)."""
    if not _ARMING.active or not _ARMING.armed(name):
        return
    with _FIRING:  # held until death: a second thread never journals a point it did not die at
        if _ARMING.journal is not None:
            descriptor = os.open(_ARMING.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(descriptor, f"{name}\n".encode())
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        os.kill(os.getpid(), signal.SIGKILL)


def phased(prefix: str, steps: Iterable[str]) -> list[str]:
    """`prefix.step.before` and `prefix.step.after` for each step: the two kill points around a step."""
    return [f"{prefix}.{step}.{phase}" for step in steps for phase in PHASES]


def transition_point(state: str, event: str, phase: str) -> str:
    """The control plane's kill point around the compare-and-swap of (state, event)."""
    return f"cp.{state}.{event}.{phase}"


def transition_points(transitions: Iterable[tuple[str, str]]) -> list[str]:
    """Both kill points of every (state, event) of a transition table."""
    return [transition_point(state, event, phase) for state, event in transitions for phase in PHASES]
