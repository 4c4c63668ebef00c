"""What a passed deadline does (docs/adr/0048-metadata-lists-and-deadlines.md).

Invariants:
- `on_timeout: delete` (the default, and what a deadline always did): the sandbox is asked to be deleted,
  whatever its state (every non-terminal state allows delete).
- `on_timeout: pause`: the sandbox is KEPT: a running, paused or crashed one is asked to be suspended (its
  state in object storage: it survives its node and comes back on any node, on first use) or, where the
  control plane has no object storage, paused; a suspended or stopped one stays as it is; a failed one
  keeps its wish (its data cannot be trusted: it waits for a recovery or a delete). Its deadline is
  cleared in the same UPDATE, so it is not acted on again; coming back (resumed, restored, started) gives
  it a fresh one (space.controlplane.store.sandbox_state).
- A step in progress, or a sandbox not yet created, is left to finish under `pause`: its deadline is acted
  on from the stable state it reaches.
- The store applies an expiry only while the deadline is still passed, so a deadline moved meanwhile by
  `set_timeout` wins over an expiry decided on an older read.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Final

from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core.lifecycle import State

# Stable states a `pause` expiry keeps as they are (only the deadline is cleared).
_KEPT_AS_THEY_ARE: Final = frozenset({State.SUSPENDED, State.STOPPED})
_SUSPENDED_FROM: Final = frozenset({State.RUNNING, State.PAUSED, State.CRASHED})


def expired(sb: SandboxRecord, now: datetime) -> bool:
    """Whether `sb` has a passed deadline that is still to be acted on."""
    if sb.state in (State.DELETED, State.DELETING) or sb.desired_state == State.DELETED:
        return False
    return sb.expires_at is not None and sb.expires_at <= now


def expiry_plan(sb: SandboxRecord, *, can_suspend: bool) -> tuple[State | None, bool] | None:
    """(the wish to record, None: keep the wish as it is; whether to clear the deadline) for an expired
    `sb`, or None when it is not to be acted on now (a step in progress under `pause`)."""
    if sb.on_timeout == "delete":
        return State.DELETED, False
    if sb.state in _SUSPENDED_FROM:
        return (State.SUSPENDED if can_suspend else State.PAUSED), True
    if sb.state in _KEPT_AS_THEY_ARE:
        return sb.state, True
    if sb.state == State.FAILED:
        return None, True
    return None  # pending or a step in progress: decided from the state it reaches


async def expire(store: Store, sb: SandboxRecord, *, can_suspend: bool) -> SandboxRecord | None:
    """Act on `sb`'s passed deadline; the record as it is now, or None when nothing is to be done now."""
    plan = expiry_plan(sb, can_suspend=can_suspend)
    if plan is None:
        return None
    desired, clear = plan
    done = await asyncio.to_thread(store.expire_sandbox, sb.id, desired, clear_deadline=clear)
    return done if done is not None else await asyncio.to_thread(store.load_sandbox, sb.id)
