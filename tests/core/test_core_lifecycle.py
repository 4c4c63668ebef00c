"""Tests of the sandbox lifecycle table (space.core.lifecycle).

The expectations here are written out by hand, independently of the table, so that an edit to the table
that changes behaviour makes a test fail; the graph tests (reachability, recoverability) check properties
of the whole table rather than individual rows.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from space.core import errors
from space.core.lifecycle import (
    ACTION_EVENTS,
    IN_PROGRESS_STATES,
    INITIAL_STATE,
    LIVE_STATES,
    REQUEST_EVENTS,
    STABLE_STATES,
    STEPS,
    TERMINAL_STATES,
    TRANSITIONS,
    Action,
    Event,
    State,
    action_event,
    allowed_actions,
    allowed_events,
    can,
    is_in_progress,
    is_live,
    is_terminal,
    parse_event,
    parse_state,
    step_of,
    transition,
)

ALL_PAIRS = list(itertools.product(State, Event))

EXPECTED_STATES = {
    "pending", "creating", "running", "pausing", "paused", "resuming", "suspending", "suspended",
    "restoring", "stopping", "stopped", "starting", "checkpointing", "rolling_back", "crashed",
    "recovering", "deleting", "deleted", "failed",
}  # fmt: skip
EXPECTED_EVENTS = {
    "create", "created", "fork", "pause", "paused", "resume", "resumed", "suspend", "suspended",
    "restore", "restored", "stop", "stopped", "start", "started", "checkpoint", "checkpointed",
    "rollback", "rolled_back", "crash", "recover", "recovered", "delete", "deleted", "fail", "node_lost",
}  # fmt: skip

# in-progress state -> (completion event, settles in, `fail` leads to); written by hand from the ADR.
EXPECTED_STEPS = {
    "creating": ("created", "running", "failed"),
    "pausing": ("paused", "paused", "running"),
    "resuming": ("resumed", "running", "paused"),
    "suspending": ("suspended", "suspended", "paused"),
    "restoring": ("restored", "running", "suspended"),
    "stopping": ("stopped", "stopped", "crashed"),
    "starting": ("started", "running", "stopped"),
    "checkpointing": ("checkpointed", "running", "running"),
    "rolling_back": ("rolled_back", "running", "crashed"),
    "recovering": ("recovered", "running", "failed"),
    "deleting": ("deleted", "deleted", "failed"),
}

# in-progress state -> where `node_lost` (its node is gone) re-plans it; written by hand from ADR 0032.
EXPECTED_NODE_LOST = {
    "creating": "pending", "restoring": "suspended", "recovering": "crashed", "pausing": "crashed",
    "resuming": "crashed", "suspending": "crashed", "stopping": "crashed", "starting": "crashed",
    "checkpointing": "crashed", "rolling_back": "crashed",
}  # fmt: skip

EXPECTED_LIVE = {"running", "pausing", "paused", "resuming", "suspending", "stopping", "checkpointing"}


def _successors(state: State) -> set[State]:
    return {TRANSITIONS[(state, event)] for event in allowed_events(state)}


def _reachable(start: State) -> set[State]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in _successors(queue.popleft()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _run(start: str, events: list[str]) -> State:
    state = State(start)
    for event in events:
        state = transition(state, event)
    return state


# --- vocabulary ---------------------------------------------------------------------------------------


def test_state_and_event_vocabulary_is_the_documented_one() -> None:
    assert {s.value for s in State} == EXPECTED_STATES
    assert {e.value for e in Event} == EXPECTED_EVENTS


def test_in_progress_states_are_exactly_the_ing_states_except_pending_and_running() -> None:
    # The naming rule of DESIGN.md: a step in progress is named by its verb's -ing form.
    ing = {s for s in State if s.value.split("_")[0].endswith("ing")} - {State.PENDING, State.RUNNING}
    assert ing == IN_PROGRESS_STATES == {State(s) for s in EXPECTED_STEPS}
    assert set(State) - ing == STABLE_STATES
    assert INITIAL_STATE is State.PENDING


# --- the whole table ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS, ids=[f"{s}-{e}" for s, e in ALL_PAIRS])
def test_every_pair_follows_the_table_or_raises_invalid_state(state: State, event: Event) -> None:
    if (state, event) in TRANSITIONS:
        assert transition(state, event) is TRANSITIONS[(state, event)]
        assert transition(state.value, event.value) is TRANSITIONS[(state, event)]
        assert can(state, event)
        assert event in allowed_events(state)
        return
    assert not can(state, event)
    with pytest.raises(errors.InvalidState) as info:
        transition(state, event)
    err = info.value
    assert err.state == state.value
    assert err.event == event.value
    assert f"'{state.value}'" in err.message
    assert event.value in err.message
    assert err.code == "invalid_state"
    body = err.to_dict()
    assert body["details"]["state"] == state.value
    assert body["details"]["allowed"] == sorted(e.value for e in allowed_events(state))


@pytest.mark.parametrize(
    ("state", "event", "message"),
    [
        ("stopped", "pause", "cannot pause a sandbox in state 'stopped'"),
        ("suspended", "resume", "cannot resume a sandbox in state 'suspended'"),
        ("paused", "checkpoint", "cannot checkpoint a sandbox in state 'paused'"),
        ("suspended", "rollback", "cannot rollback a sandbox in state 'suspended'"),
        ("pausing", "pause", "cannot pause a sandbox in state 'pausing'"),
        ("deleted", "delete", "cannot delete a sandbox in state 'deleted'"),
        ("running", "start", "cannot start a sandbox in state 'running'"),
        ("running", "created", "event 'created' does not apply to a sandbox in state 'running'"),
        ("creating", "crash", "event 'crash' does not apply to a sandbox in state 'creating'"),
        ("running", "fork", "event 'fork' does not apply to a sandbox in state 'running'"),
    ],
)
def test_rejections_name_the_current_state(state: str, event: str, message: str) -> None:
    with pytest.raises(errors.InvalidState) as info:
        transition(state, event)
    assert info.value.message == message
    assert info.value.state == state


@pytest.mark.parametrize(
    ("start", "events", "end"),
    [
        # the DESIGN.md sketch, line by line
        ("pending", ["create", "created"], "running"),
        ("running", ["pause", "paused", "resume", "resumed"], "running"),
        ("running", ["suspend", "suspended", "restore", "restored"], "running"),
        ("paused", ["suspend", "suspended", "restore", "restored"], "running"),
        ("running", ["stop", "stopped", "start", "started"], "running"),
        ("paused", ["stop", "stopped"], "stopped"),
        ("running", ["checkpoint", "checkpointed"], "running"),
        ("running", ["crash", "recover", "recovered"], "running"),
        ("paused", ["delete", "deleted"], "deleted"),
        # fork: the child starts in pending; its creation is the fork event
        ("pending", ["fork", "created"], "running"),
        # rollback from each stable state that has a disk on a node
        ("running", ["rollback", "rolled_back"], "running"),
        ("paused", ["rollback", "rolled_back"], "running"),
        ("stopped", ["rollback", "rolled_back"], "running"),
        ("crashed", ["rollback", "rolled_back"], "running"),
        # failures back out to a known state
        ("running", ["pause", "fail"], "running"),
        ("running", ["suspend", "fail"], "paused"),
        ("suspended", ["restore", "fail"], "suspended"),
        ("stopped", ["start", "fail"], "stopped"),
        ("running", ["stop", "fail", "stop", "stopped"], "stopped"),
        ("pending", ["create", "fail", "delete", "deleted"], "deleted"),
        ("crashed", ["recover", "fail", "recover", "recovered"], "running"),
        ("deleting", ["delete", "fail", "delete", "deleted"], "deleted"),
    ],
)
def test_documented_paths(start: str, events: list[str], end: str) -> None:
    assert _run(start, events) == State(end)


# --- graph properties ---------------------------------------------------------------------------------


def test_only_deleted_is_terminal_and_it_has_no_exits() -> None:
    assert {State.DELETED} == TERMINAL_STATES
    assert allowed_events(State.DELETED) == frozenset()
    assert not [pair for pair in TRANSITIONS if pair[0] is State.DELETED]
    for state in State:
        assert is_terminal(state) == (state is State.DELETED)
        for event in Event if state is State.DELETED else ():
            with pytest.raises(errors.InvalidState):
                transition(state, event)


def test_every_state_is_reachable_from_pending() -> None:
    assert _reachable(State.PENDING) == set(State)


def test_every_non_terminal_state_can_reach_deleted_and_running() -> None:
    # No dead ends: whatever happened, a sandbox can be deleted, and brought back to running.
    for state in set(State) - TERMINAL_STATES:
        reach = _reachable(state)
        assert State.DELETED in reach, state
        assert State.RUNNING in reach, state


def test_every_non_terminal_state_is_deleted_by_delete_then_deleted() -> None:
    for state in set(State) - TERMINAL_STATES:
        assert transition(state, Event.DELETE) is State.DELETING
        assert _run(state, ["delete", "deleted"]) is State.DELETED


@pytest.mark.parametrize("state", sorted(IN_PROGRESS_STATES))
def test_in_progress_state_has_completion_failure_and_delete(state: State) -> None:
    completion, settles, fails_to = EXPECTED_STEPS[state.value]
    step = step_of(state)
    assert (step.completes_with, step.settles_in, step.fails_to) == (completion, settles, fails_to)
    assert transition(state, completion) == State(settles)
    assert transition(state, Event.FAIL) == State(fails_to)
    assert State(settles) in STABLE_STATES
    assert State(fails_to) in STABLE_STATES
    assert transition(state, Event.DELETE) is State.DELETING
    assert is_in_progress(state)
    assert State.DELETED in _reachable(state)


def test_steps_cover_exactly_the_in_progress_states() -> None:
    assert set(STEPS) == {State(s) for s in EXPECTED_STEPS} == IN_PROGRESS_STATES
    for state in STABLE_STATES:
        assert not is_in_progress(state)
        with pytest.raises(errors.InvalidArgument):
            step_of(state)


def test_requests_enter_an_in_progress_state_before_any_side_effect() -> None:
    # A request (or the create/fork that starts a sandbox) never jumps straight to a stable state: the
    # -ing state must be recorded first, so a crash mid-operation is visible.
    starters = REQUEST_EVENTS | {Event.CREATE, Event.FORK}
    for (state, event), target in TRANSITIONS.items():
        if event in starters:
            assert target in IN_PROGRESS_STATES, (state, event, target)


def test_one_step_in_flight_at_a_time() -> None:
    # While a step runs, the only request accepted is delete (which supersedes it).
    for state in IN_PROGRESS_STATES:
        assert allowed_events(state) & REQUEST_EVENTS == {Event.DELETE}, state


def test_completion_and_crash_events_settle_in_stable_states() -> None:
    reports = {step.completes_with for step in STEPS.values()} | {Event.CRASH, Event.FAIL}
    for (state, event), target in TRANSITIONS.items():
        if event in reports:
            assert target in STABLE_STATES, (state, event, target)


# --- crash and recovery -------------------------------------------------------------------------------


def test_live_states_are_the_documented_ones() -> None:
    assert {s.value for s in LIVE_STATES} == EXPECTED_LIVE
    for state in State:
        assert is_live(state) == (state.value in EXPECTED_LIVE)


@pytest.mark.parametrize("state", sorted(State))
def test_crash_is_accepted_exactly_in_live_states_and_is_recoverable(state: State) -> None:
    if state.value not in EXPECTED_LIVE:
        with pytest.raises(errors.InvalidState):
            transition(state, Event.CRASH)
        return
    crashed = transition(state, Event.CRASH)
    assert crashed is State.CRASHED
    assert _run(crashed, ["recover", "recovered"]) is State.RUNNING
    assert _run(crashed, ["stop", "stopped"]) is State.STOPPED


@pytest.mark.parametrize("state", sorted(State))
def test_node_lost_replans_every_step_but_deleting(state: State) -> None:
    if state.value not in EXPECTED_NODE_LOST:
        with pytest.raises(errors.InvalidState):
            transition(state, Event.NODE_LOST)
        return
    target = transition(state, Event.NODE_LOST)
    assert target.value == EXPECTED_NODE_LOST[state.value]
    assert target in STABLE_STATES
    # Re-planned, never stuck: from where it lands, running is reachable again.
    assert State.RUNNING in _reachable(target)


def test_a_replanned_create_is_placed_again() -> None:
    assert _run("pending", ["create", "node_lost", "create", "created"]) is State.RUNNING
    assert _run("pending", ["fork", "node_lost", "fork", "created"]) is State.RUNNING
    assert _run("suspended", ["restore", "node_lost", "restore", "restored"]) is State.RUNNING


def test_failed_recovery_can_be_retried_or_deleted() -> None:
    failed = _run("running", ["crash", "recover", "fail"])
    assert failed is State.FAILED
    assert allowed_events(failed) == {Event.RECOVER, Event.DELETE}
    assert _run(failed, ["recover", "recovered"]) is State.RUNNING


# --- actions and parsing ------------------------------------------------------------------------------


def test_each_action_maps_to_the_event_of_the_same_name() -> None:
    assert {a.value for a in Action} == {
        "pause", "resume", "stop", "start", "suspend", "restore", "checkpoint", "rollback", "recover",
        "delete",
    }  # fmt: skip
    for action in Action:
        assert action_event(action).value == action.value
        assert action_event(action.value) is ACTION_EVENTS[action]
    with pytest.raises(errors.InvalidArgument):
        action_event("explode")


@pytest.mark.parametrize(
    ("state", "actions"),
    [
        ("running", {"pause", "suspend", "stop", "checkpoint", "rollback", "delete"}),
        ("paused", {"resume", "suspend", "stop", "rollback", "delete"}),
        ("stopped", {"start", "rollback", "delete"}),
        ("suspended", {"restore", "delete"}),
        ("crashed", {"recover", "stop", "rollback", "delete"}),
        ("pausing", {"delete"}),
        ("deleted", set()),
    ],
)
def test_allowed_actions(state: str, actions: set[str]) -> None:
    assert {a.value for a in allowed_actions(state)} == actions


@pytest.mark.parametrize("bad", ["", "Running", "running ", "gone", None, 3, b"running"])
def test_unknown_states_and_events_are_invalid_arguments(bad: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        parse_state(bad)
    with pytest.raises(errors.InvalidArgument):
        parse_event(bad)
    with pytest.raises(errors.InvalidArgument):
        transition(State.RUNNING, bad)  # type: ignore[arg-type]


# --- random event sequences ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_event_sequences_keep_the_invariants(data: st.DataObject) -> None:
    state = INITIAL_STATE
    seen_deleted = False
    for _ in range(data.draw(st.integers(min_value=1, max_value=60), label="length")):
        # Mostly allowed events so sequences get deep; sometimes any event to exercise rejections.
        options = sorted(allowed_events(state))
        if options and data.draw(st.integers(0, 4), label="bias") > 0:
            event = data.draw(st.sampled_from(options), label="event")
        else:
            event = data.draw(st.sampled_from(sorted(Event)), label="event")
        before = state
        try:
            state = transition(state, event)
        except errors.InvalidState as exc:
            assert exc.state == before.value
            assert (before, event) not in TRANSITIONS
            state = before  # a rejected event changes nothing
        else:
            assert not seen_deleted, "deleted must be terminal"
            if before in IN_PROGRESS_STATES and event in REQUEST_EVENTS:
                assert event is Event.DELETE
            if event is Event.CRASH:
                assert before.value in EXPECTED_LIVE
        seen_deleted = seen_deleted or state is State.DELETED
        assert isinstance(state, State)
        assert (state is State.DELETED) == seen_deleted
        # Wherever we are, a restarted reconciler can settle the state and delete can finish it.
        if state in IN_PROGRESS_STATES:
            step = STEPS[state]
            assert transition(state, step.completes_with) in STABLE_STATES
            assert transition(state, Event.FAIL) in STABLE_STATES
        if state is not State.DELETED:
            assert _run(state, ["delete", "deleted"]) is State.DELETED
