"""What a passed deadline does, state by state (space.controlplane.reconciler.expiry; ADR 0048): pure, no
I/O. The store's side (the conditional UPDATE) is tests/store/test_sandbox_lists_and_deadlines.py; the whole
path on the fake cluster tests/controlplane/test_sandbox_lists_and_deadlines_api.py and on runsc
tests/e2e/test_deadlines_runsc.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from space.controlplane.reconciler.expiry import expired, expiry_plan
from space.controlplane.reconciler.plan import NEXT_STEP, RECOVER_FOR
from space.controlplane.store.records import SandboxRecord
from space.core.lifecycle import IN_PROGRESS_STATES, STABLE_STATES, State
from space.core.settings import SandboxLimits

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def record(state: State, on_timeout: str = "pause", **changes: object) -> SandboxRecord:
    values: dict[str, object] = {
        "id": "sb-" + "a" * 26, "project_id": "prj-" + "a" * 26, "template": "python", "env": {},
        "limits": SandboxLimits(), "state": state, "desired_state": State.RUNNING, "generation": 3,
        "node_id": None, "forked_from": None, "fork_snapshot_id": None, "idle_timeout_s": None, "ttl_s": 60,
        "expires_at": NOW - timedelta(seconds=1), "last_activity_at": NOW, "error": None,
        "error_permanent": False, "attempts": 0, "next_attempt_at": NOW, "lease_owner": None,
        "lease_until": None, "created_at": NOW, "updated_at": NOW, "deleted_at": None,
        "on_timeout": on_timeout,
    }  # fmt: skip
    values.update(changes)
    return SandboxRecord(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", sorted(set(State) - {State.DELETED, State.DELETING}))
def test_delete_deletes_from_every_state(state: State) -> None:
    assert expiry_plan(record(state, "delete"), can_suspend=True) == (State.DELETED, False)


@pytest.mark.parametrize("can_suspend", [True, False])
def test_pause_keeps_the_sandbox(can_suspend: bool) -> None:
    kept = State.SUSPENDED if can_suspend else State.PAUSED
    plans = {state: expiry_plan(record(state), can_suspend=can_suspend) for state in State}
    assert plans[State.RUNNING] == plans[State.PAUSED] == plans[State.CRASHED] == (kept, True)
    assert plans[State.SUSPENDED] == (State.SUSPENDED, True)
    assert plans[State.STOPPED] == (State.STOPPED, True)
    assert plans[State.FAILED] == (None, True)  # its wish kept: recovery or delete
    waiting = {state for state, plan in plans.items() if plan is None}
    assert waiting == {State.PENDING, *IN_PROGRESS_STATES, State.DELETED}


@pytest.mark.parametrize("can_suspend", [True, False])
def test_every_wish_a_pause_expiry_records_is_reachable(can_suspend: bool) -> None:
    """A wish the reconciler cannot reach would be claimed again and again: every (state, wish) of the
    plan is where the sandbox is, a planned step, or a recovery."""
    for state in STABLE_STATES:
        plan = expiry_plan(record(state), can_suspend=can_suspend)
        if plan is None or plan[0] is None or plan[0] == state:
            continue
        wish = plan[0]
        assert (state, wish) in NEXT_STEP or (state == State.CRASHED and wish in RECOVER_FOR), (state, wish)


def test_expired_only_with_a_passed_deadline_and_not_while_deleted() -> None:
    assert expired(record(State.RUNNING), NOW)
    assert expired(record(State.RUNNING, expires_at=NOW), NOW)  # at the deadline
    assert not expired(record(State.RUNNING, expires_at=NOW + timedelta(microseconds=1)), NOW)
    assert not expired(record(State.RUNNING, expires_at=None), NOW)
    assert not expired(record(State.DELETING), NOW)
    assert not expired(record(State.RUNNING, desired_state=State.DELETED), NOW)
