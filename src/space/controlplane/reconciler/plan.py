"""What the reconciler does from each lifecycle state, as data checked against space.core.lifecycle.

The lifecycle table (space.core.lifecycle) says which events are allowed and where they lead; this module
says which of them the reconciler takes on its own to move a sandbox toward its desired state, and how a
failure is classified. Pure: no I/O.

Invariants (checked when this module is imported, and by tests/controlplane/test_reconciler_plan.py):
- Every NEXT_STEP pair starts from a stable state with an event the table allows there, and that event
  leads into an in-progress state, whose completion event (lifecycle.STEPS) the step reports when done.
- NODE_CALLS names the in-progress states whose whole side effect is one idempotent node call: its name is
  the NodeClient method, called with the sandbox id alone.
- A permanent failure (PERMANENT, or RESTORE_PERMANENT while restoring, recovering or about to) takes the
  table's `fail` edge and is not retried until a new wish; anything else backs off exponentially.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from space.core import errors
from space.core.lifecycle import IN_PROGRESS_STATES, STABLE_STATES, STEPS, TRANSITIONS, Event, State

MAX_BACKOFF_S = 30.0

PERMANENT: tuple[type[errors.SpaceError], ...] = (
    errors.InvalidArgument,
    errors.InvalidState,
    errors.PermissionDenied,
    errors.TooLarge,
    errors.ArtifactCorrupt,  # never retried: the same bytes fail the same way; visible on the record
    errors.KeyRevoked,  # revoked on purpose: the data is meant to be unreadable
    errors.NotSupported,  # the sandbox's isolation cannot do it (a microVM's suspend): ADR 0076
)
# A restore whose artifact is gone cannot succeed by retrying either.
RESTORE_PERMANENT: tuple[type[errors.SpaceError], ...] = (*PERMANENT, errors.NotFound)
# States in which a step restores (or is about to restore) from an artifact: a missing one is permanent.
RESTORING_STATES: Final = frozenset({State.RESTORING, State.RECOVERING, State.CRASHED, State.SUSPENDED})

# (stable state, desired state) -> the event that starts the next step toward the desired state.
NEXT_STEP: Final = MappingProxyType(
    {
        (State.RUNNING, State.PAUSED): Event.PAUSE,
        (State.PAUSED, State.RUNNING): Event.RESUME,
        (State.RUNNING, State.STOPPED): Event.STOP,
        (State.PAUSED, State.STOPPED): Event.STOP,
        (State.STOPPED, State.RUNNING): Event.START,
        (State.STOPPED, State.PAUSED): Event.START,  # then pause, on the next round
        (State.CRASHED, State.STOPPED): Event.STOP,
        (State.RUNNING, State.SUSPENDED): Event.SUSPEND,
        (State.PAUSED, State.SUSPENDED): Event.SUSPEND,
        (State.SUSPENDED, State.RUNNING): Event.RESTORE,
        (State.SUSPENDED, State.PAUSED): Event.RESTORE,  # then pause, on the next round
        (State.SUSPENDED, State.STOPPED): Event.RESTORE,  # then stop
    }
)

# In-progress state -> the NodeClient method that is its whole side effect (called with the sandbox id).
NODE_CALLS: Final = MappingProxyType(
    {
        State.PAUSING: "pause",
        State.RESUMING: "resume",
        State.STOPPING: "stop",
        State.STARTING: "start",
    }
)

# Desired states from which a crashed sandbox is recovered (stopped: NEXT_STEP stops it instead).
RECOVER_FOR: Final = frozenset({State.RUNNING, State.PAUSED, State.SUSPENDED})


def completion(state: State) -> Event:
    """The event that reports the end of the step in progress in `state` (from the lifecycle table)."""
    return STEPS[state].completes_with


def permanent_failures(state: State) -> tuple[type[errors.SpaceError], ...]:
    """The errors that end a step begun in `state` for good instead of being retried."""
    return RESTORE_PERMANENT if state in RESTORING_STATES else PERMANENT


def backoff(attempts: int) -> float:
    return float(min(MAX_BACKOFF_S, 0.25 * (2 ** min(attempts, 10))))


def _check_plan() -> None:
    """Fail at import, not in production, if the plan and the lifecycle table drift apart."""
    for (state, desired), event in NEXT_STEP.items():
        target = TRANSITIONS.get((state, event))
        if state not in STABLE_STATES or target not in IN_PROGRESS_STATES:
            raise RuntimeError(f"reconciler plan: {event} from {state} (toward {desired}) starts no step")
    for state in NODE_CALLS:
        if state not in STEPS:
            raise RuntimeError(f"reconciler plan: {state} is not an in-progress state")


_check_plan()
