"""The sandbox lifecycle as data: the ONE transition table (state, event) -> state (pure: no I/O).

The control plane, the node and the tests all ask this module; nobody else decides whether an event is
allowed. See docs/adr/0003-lifecycle-table.md for why each state exists.

Vocabulary:
- A *request* event is caused by a client action (pause, resume, ...; see ACTION_EVENTS). A *report* event
  (created, paused, crash, fail, ...) is emitted by the reconciler or node when a side effect finished,
  failed, or was observed.
- An *in-progress* state (its name ends in -ing) is written, by compare-and-swap, BEFORE the side effect
  starts. After any crash of any process the record therefore says which step may be half done, and the
  reconciler re-runs that step idempotently and reports its completion (or `fail`).
- A *stable* state is any other state; the reconciler has nothing in flight for it.

Invariants (checked when this module is imported, and again by tests/core/test_core_lifecycle.py):
- Every in-progress state has exactly one completion event leading to a stable state, a `fail` event
  leading to a stable state, and allows `delete`: a crash mid-operation can always be driven forward,
  backed out, or cleaned up.
- `crash` is allowed exactly in LIVE_STATES (a runtime is established on a node, so it can die).
- `node_lost` is allowed exactly in REPLANNED_STATES (every in-progress state but deleting) and leads to a
  stable state: no step ever waits on a node that is gone (docs/adr/0032-lost-nodes-and-incarnations.md).
- DELETED is the only terminal state; it has no exits. Every non-terminal state allows `delete`.
- Every state is reachable from PENDING (the first state of every sandbox, forked or not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from space.core.errors import InvalidArgument, InvalidState


class State(StrEnum):
    PENDING = "pending"  # record exists, waiting for the scheduler / reconciler to begin creation
    CREATING = "creating"  # rootfs from a template (or, for a fork, from the source's checkpoint)
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"  # processes frozen in memory on the node
    RESUMING = "resuming"
    SUSPENDING = "suspending"  # pause -> full checkpoint -> upload (manifest last) -> free the node
    SUSPENDED = "suspended"  # lives only in object storage; no node
    RESTORING = "restoring"  # any node: download -> verify -> receive delta -> restore from checkpoint
    STOPPING = "stopping"
    STOPPED = "stopped"  # processes gone, disk kept on the node
    STARTING = "starting"  # fresh processes on the kept disk
    CHECKPOINTING = "checkpointing"  # full snapshot; the sandbox returns to running
    ROLLING_BACK = "rolling_back"  # back to a disk snapshot or a full checkpoint of the same sandbox
    CRASHED = "crashed"  # runtime gone or in an unknown state; data believed intact
    RECOVERING = "recovering"  # from the newest usable checkpoint
    DELETING = "deleting"
    DELETED = "deleted"  # terminal; the record stays as a tombstone
    FAILED = "failed"  # a step gave up and the sandbox's data cannot be trusted (or never existed)


class Event(StrEnum):
    CREATE = "create"
    CREATED = "created"
    FORK = "fork"  # starts a child created from another sandbox's checkpoint (source kept on the record)
    PAUSE = "pause"
    PAUSED = "paused"
    RESUME = "resume"
    RESUMED = "resumed"
    SUSPEND = "suspend"
    SUSPENDED = "suspended"
    RESTORE = "restore"
    RESTORED = "restored"
    STOP = "stop"
    STOPPED = "stopped"
    START = "start"
    STARTED = "started"
    CHECKPOINT = "checkpoint"
    CHECKPOINTED = "checkpointed"
    ROLLBACK = "rollback"
    ROLLED_BACK = "rolled_back"
    CRASH = "crash"
    RECOVER = "recover"
    RECOVERED = "recovered"
    DELETE = "delete"
    DELETED = "deleted"
    FAIL = "fail"
    # The node of an in-progress step is gone (lost, or deregistered on purpose): the step is re-planned
    # elsewhere instead of waiting for that node (docs/adr/0032-lost-nodes-and-incarnations.md).
    NODE_LOST = "node_lost"


class Action(StrEnum):
    """What a client can ask of an existing sandbox (API routes, SDK methods, CLI verbs)."""

    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"
    START = "start"
    SUSPEND = "suspend"
    RESTORE = "restore"
    CHECKPOINT = "checkpoint"
    ROLLBACK = "rollback"
    RECOVER = "recover"
    DELETE = "delete"


# Short aliases so the table below reads as a table.
S = State
E = Event

# THE table. One block per state; a pair that is not listed is not allowed (409 naming the state).
# Why each failure target (`fail` means "the step gave up after its retries"):
# - back to where the step started when the old reality is known to still hold (pausing, resuming,
#   checkpointing, restoring: the artifacts are still in object storage; starting: the disk is kept);
# - suspending always pauses first, so a failed suspend leaves the sandbox paused, whichever state it
#   came from (the reconciler makes that true before reporting `fail`);
# - crashed when the runtime is in an unknown state but the data is intact (stopping, rolling_back);
# - failed when there is nothing trustworthy to go back to (creating, recovering, deleting).
# Why each `node_lost` target (the step's node is gone; ADR 0032): a step that has not made anything
# yet goes back to where it can be placed again (creating -> pending, restoring -> suspended: the artifact
# is still in object storage); a step on an established runtime, or one bringing one up on the kept disk,
# leaves the sandbox crashed (its data is on the gone node; recovery uses an uploaded checkpoint or waits
# for the node); deleting needs no node to finish, so it has no `node_lost`.
_TABLE: Final[dict[State, dict[Event, State]]] = {
    S.PENDING: {E.CREATE: S.CREATING, E.FORK: S.CREATING, E.FAIL: S.FAILED, E.DELETE: S.DELETING},
    S.CREATING: {E.CREATED: S.RUNNING, E.FAIL: S.FAILED, E.NODE_LOST: S.PENDING, E.DELETE: S.DELETING},
    S.RUNNING: {
        E.PAUSE: S.PAUSING,
        E.SUSPEND: S.SUSPENDING,
        E.STOP: S.STOPPING,
        E.CHECKPOINT: S.CHECKPOINTING,
        E.ROLLBACK: S.ROLLING_BACK,
        E.CRASH: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.PAUSING: {
        E.PAUSED: S.PAUSED,
        E.FAIL: S.RUNNING,
        E.CRASH: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.PAUSED: {
        E.RESUME: S.RESUMING,
        E.SUSPEND: S.SUSPENDING,
        E.STOP: S.STOPPING,
        E.ROLLBACK: S.ROLLING_BACK,
        E.CRASH: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.RESUMING: {
        E.RESUMED: S.RUNNING,
        E.FAIL: S.PAUSED,
        E.CRASH: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.SUSPENDING: {
        E.SUSPENDED: S.SUSPENDED,
        E.FAIL: S.PAUSED,
        E.CRASH: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.SUSPENDED: {E.RESTORE: S.RESTORING, E.DELETE: S.DELETING},
    S.RESTORING: {E.RESTORED: S.RUNNING, E.FAIL: S.SUSPENDED, E.NODE_LOST: S.SUSPENDED, E.DELETE: S.DELETING},
    S.STOPPING: {
        E.STOPPED: S.STOPPED,
        E.FAIL: S.CRASHED,
        E.CRASH: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.STOPPED: {E.START: S.STARTING, E.ROLLBACK: S.ROLLING_BACK, E.DELETE: S.DELETING},
    S.STARTING: {E.STARTED: S.RUNNING, E.FAIL: S.STOPPED, E.NODE_LOST: S.CRASHED, E.DELETE: S.DELETING},
    S.CHECKPOINTING: {
        E.CHECKPOINTED: S.RUNNING,
        E.FAIL: S.RUNNING,
        E.CRASH: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.ROLLING_BACK: {
        E.ROLLED_BACK: S.RUNNING,
        E.FAIL: S.CRASHED,
        E.NODE_LOST: S.CRASHED,
        E.DELETE: S.DELETING,
    },
    S.CRASHED: {
        E.RECOVER: S.RECOVERING,
        E.STOP: S.STOPPING,
        E.ROLLBACK: S.ROLLING_BACK,
        E.DELETE: S.DELETING,
    },
    S.RECOVERING: {E.RECOVERED: S.RUNNING, E.FAIL: S.FAILED, E.NODE_LOST: S.CRASHED, E.DELETE: S.DELETING},
    # `delete` while deleting is an accepted no-op, so a retried DELETE request is idempotent.
    S.DELETING: {E.DELETED: S.DELETED, E.FAIL: S.FAILED, E.DELETE: S.DELETING},
    S.DELETED: {},
    # Retrying recovery from `failed` is allowed: the reconciler checks for a usable checkpoint first.
    S.FAILED: {E.RECOVER: S.RECOVERING, E.DELETE: S.DELETING},
}

TRANSITIONS: Final[Mapping[tuple[State, Event], State]] = MappingProxyType(
    {(state, event): target for state, row in _TABLE.items() for event, target in row.items()}
)

INITIAL_STATE: Final = State.PENDING
TERMINAL_STATES: Final = frozenset(s for s in State if not _TABLE[s])

IN_PROGRESS_STATES: Final = frozenset(
    {
        S.CREATING,
        S.PAUSING,
        S.RESUMING,
        S.SUSPENDING,
        S.RESTORING,
        S.STOPPING,
        S.STARTING,
        S.CHECKPOINTING,
        S.ROLLING_BACK,
        S.RECOVERING,
        S.DELETING,
    }
)
STABLE_STATES: Final = frozenset(State) - IN_PROGRESS_STATES

# A runtime is established on a node (it may be frozen): the only states in which it can crash. States
# that *bring up* a runtime (creating, starting, restoring, rolling_back, recovering) are not here: if
# the runtime dies under them, their step fails and reports `fail`.
LIVE_STATES: Final = frozenset(
    {S.RUNNING, S.PAUSING, S.PAUSED, S.RESUMING, S.SUSPENDING, S.STOPPING, S.CHECKPOINTING}
)

# In-progress states whose step waits on its node: when that node is gone, `node_lost` re-plans them.
# Deleting is not one of them: it finishes without its node (the copy is collected when the node returns).
REPLANNED_STATES: Final = IN_PROGRESS_STATES - {S.DELETING}

ACTION_EVENTS: Final[Mapping[Action, Event]] = MappingProxyType(
    {
        Action.PAUSE: E.PAUSE,
        Action.RESUME: E.RESUME,
        Action.STOP: E.STOP,
        Action.START: E.START,
        Action.SUSPEND: E.SUSPEND,
        Action.RESTORE: E.RESTORE,
        Action.CHECKPOINT: E.CHECKPOINT,
        Action.ROLLBACK: E.ROLLBACK,
        Action.RECOVER: E.RECOVER,
        Action.DELETE: E.DELETE,
    }
)
REQUEST_EVENTS: Final = frozenset(ACTION_EVENTS.values())
# Events that never complete a step: they start one, abandon one, or observe a crash.
_NON_COMPLETION_EVENTS: Final = frozenset({E.FAIL, E.CRASH, E.DELETE, E.NODE_LOST})


@dataclass(frozen=True, slots=True)
class Step:
    """How an in-progress state ends: what the reconciler reports after (re)running its side effect."""

    state: State
    completes_with: Event
    settles_in: State
    fails_to: State


def _derive_steps() -> dict[State, Step]:
    steps: dict[State, Step] = {}
    for state in sorted(IN_PROGRESS_STATES):
        row = _TABLE[state]
        completions = [
            (event, target)
            for event, target in row.items()
            if event not in _NON_COMPLETION_EVENTS and target in STABLE_STATES
        ]
        if len(completions) != 1 or E.FAIL not in row:
            raise RuntimeError(f"lifecycle table: {state} needs exactly one completion and a fail event")
        event, target = completions[0]
        steps[state] = Step(state, event, target, row[E.FAIL])
    return steps


# For each in-progress state: its completion event, the stable state it settles in, where `fail` leads.
STEPS: Final[Mapping[State, Step]] = MappingProxyType(_derive_steps())


_EXPECTED_TERMINAL: Final = frozenset({S.DELETED})


def _check_table() -> None:
    """Fail at import, not in production, if someone edits the table into an unrecoverable shape."""
    if set(_TABLE) != set(State):
        raise RuntimeError("lifecycle table: every state needs a row (an empty one for terminal states)")
    if TERMINAL_STATES != _EXPECTED_TERMINAL:
        raise RuntimeError(f"lifecycle table: unexpected terminal states {sorted(TERMINAL_STATES)}")
    for state, row in _TABLE.items():
        if state not in TERMINAL_STATES and row.get(E.DELETE) != S.DELETING:
            raise RuntimeError(f"lifecycle table: {state} must allow delete -> deleting")
        if (E.CRASH in row) != (state in LIVE_STATES):
            raise RuntimeError(f"lifecycle table: crash must be allowed exactly in live states ({state})")
        if state in IN_PROGRESS_STATES and row[E.FAIL] not in STABLE_STATES:
            raise RuntimeError(f"lifecycle table: fail from {state} must settle in a stable state")
        if (E.NODE_LOST in row) != (state in REPLANNED_STATES):
            raise RuntimeError(
                f"lifecycle table: node_lost must be allowed exactly in re-planned states ({state})"
            )
        if E.NODE_LOST in row and row[E.NODE_LOST] not in STABLE_STATES:
            raise RuntimeError(f"lifecycle table: node_lost from {state} must settle in a stable state")


_check_table()


_STATE_VALUES: Final = frozenset(s.value for s in State)
_EVENT_VALUES: Final = frozenset(e.value for e in Event)


def parse_state(value: object) -> State:
    """A State from its string form (e.g. from the database or a request); InvalidArgument otherwise."""
    if isinstance(value, str) and value in _STATE_VALUES:
        return State(value)
    raise InvalidArgument(f"unknown sandbox state {value!r}", field="state")


def parse_event(value: object) -> Event:
    if isinstance(value, str) and value in _EVENT_VALUES:
        return Event(value)
    raise InvalidArgument(f"unknown lifecycle event {value!r}", field="event")


def transition(state: State | str, event: Event | str) -> State:
    """The state after `event` in `state`, or InvalidState naming the current state and the event."""
    current, ev = parse_state(state), parse_event(event)
    target = TRANSITIONS.get((current, ev))
    if target is None:
        if ev in REQUEST_EVENTS:
            message = f"cannot {ev} a sandbox in state '{current}'"
        else:
            message = f"event '{ev}' does not apply to a sandbox in state '{current}'"
        raise InvalidState(
            message,
            state=current.value,
            event=ev.value,
            allowed=sorted(e.value for e in allowed_events(current)),
        )
    return target


def can(state: State | str, event: Event | str) -> bool:
    return (parse_state(state), parse_event(event)) in TRANSITIONS


def allowed_events(state: State | str) -> frozenset[Event]:
    return frozenset(_TABLE[parse_state(state)])


def allowed_actions(state: State | str) -> frozenset[Action]:
    """The client actions the table accepts in `state` (for API hints and CLI help)."""
    events = allowed_events(state)
    return frozenset(action for action, event in ACTION_EVENTS.items() if event in events)


def is_terminal(state: State | str) -> bool:
    return parse_state(state) in TERMINAL_STATES


def is_in_progress(state: State | str) -> bool:
    return parse_state(state) in IN_PROGRESS_STATES


def is_live(state: State | str) -> bool:
    return parse_state(state) in LIVE_STATES


def step_of(state: State | str) -> Step:
    """The Step of an in-progress state (InvalidArgument for a stable one: it has nothing in flight)."""
    current = parse_state(state)
    step = STEPS.get(current)
    if step is None:
        raise InvalidArgument(f"state '{current}' is stable: no step in progress", field="state")
    return step


def action_event(action: Action | str) -> Event:
    try:
        return ACTION_EVENTS[Action(action)]
    except ValueError:
        raise InvalidArgument(f"unknown sandbox action {action!r}", field="action") from None
