"""The reconciler's plan agrees with the lifecycle table, and every step it can begin has an effect."""

from __future__ import annotations

import asyncio

from space.controlplane.reconciler import plan
from space.controlplane.reconciler.loop import Reconciler
from space.core import errors
from space.core.lifecycle import IN_PROGRESS_STATES, STABLE_STATES, STEPS, Event, State, transition


def test_every_planned_step_is_allowed_by_the_lifecycle_table() -> None:
    for (state, desired), event in plan.NEXT_STEP.items():
        assert state in STABLE_STATES and state != desired
        assert transition(state, event) in IN_PROGRESS_STATES


def test_every_step_the_reconciler_can_begin_has_an_effect() -> None:
    async def in_flight() -> set[State]:
        reconciler = Reconciler(None, None)  # type: ignore[arg-type]  # no store or nodes are touched
        return set(reconciler._in_flight)

    handled = asyncio.run(in_flight())
    begun = {transition(state, event) for (state, _desired), event in plan.NEXT_STEP.items()}
    begun |= {transition(State.PENDING, Event.CREATE), transition(State.CRASHED, Event.RECOVER)}
    begun |= {transition(State.RUNNING, Event.DELETE)}
    assert begun <= handled
    assert handled <= IN_PROGRESS_STATES


def test_node_call_steps_complete_with_the_tables_event() -> None:
    assert {plan.completion(state) for state in plan.NODE_CALLS} == {
        Event.PAUSED,
        Event.RESUMED,
        Event.STOPPED,
        Event.STARTED,
    }
    assert all(state in STEPS for state in plan.NODE_CALLS)


def test_failures_while_restoring_from_an_artifact_include_not_found() -> None:
    assert errors.NotFound in plan.permanent_failures(State.RESTORING)
    assert errors.NotFound not in plan.permanent_failures(State.PAUSING)
    assert plan.backoff(0) == 0.25 and plan.backoff(100) == plan.MAX_BACKOFF_S
