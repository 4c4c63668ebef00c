"""Sandbox state changes: compare-and-swap transitions, wishes, observations, failures and crashes.

Invariants:
- A sandbox's `state` changes only in `transition()`, as a compare-and-swap
  `UPDATE ... WHERE id = :id AND state = :expected AND generation = :gen` that bumps `generation`, after
  space.core.lifecycle.transition() has allowed (expected state, event). A lost race is `Conflict` (the
  caller re-reads and decides again); a refused event is `InvalidState` naming the state. So two writers
  (API replicas, reconcilers, a restarted process replaying a step) can never both move one sandbox.
- `desired_state` is what users asked for; `set_desired` never touches `state` or `generation`.
  Deletion is irrevocable: once desired is `deleted` it cannot be changed back.
- Callers set only the columns of TRANSITION_FIELDS (with a state change) or OBSERVED_FIELDS (without
  one); ids, project, state, generation, lease and timestamps are owned by the store.
- Every compare-and-swap of `transition()` has two kill points (crash injection, armed only by
  SPACE_FAILPOINTS): `cp.<state>.<event>.before` and `.after` (space.faults.failpoints.transition_point).
- `last_activity_at` never moves backwards, so late reports are harmless.
- A transition given a `note` writes that sandbox event in the SAME transaction as the state change, so a
  move and the event that explains it (node lost, step re-planned, crashed, recovered) are never apart.
- `node_lost` (a step re-planned because its node is gone) also frees the sandbox's lease.
- `incarnation` (docs/adr/0032-lost-nodes-and-incarnations.md) is the generation at which the copy on
  `node_id` was made; callers set it together with the node the copy is placed on, before the node call.
- Deadlines (docs/adr/0048-metadata-lists-and-deadlines.md): `set_deadline` moves `expires_at` to now + N
  (with extend_only only later, and never off "no deadline"), on any sandbox not deleted or being deleted;
  `expire_sandbox` acts on a deadline only while it is still passed (a deadline moved meanwhile wins), in
  the same UPDATE; a sandbox that comes back (`resumed`, `restored`, `started`) with a timeout (`ttl_s`)
  gets a deadline of at least now + that timeout, in the transaction of its transition.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import ColumnElement, case, or_, update
from sqlalchemy.orm import Session

from space.controlplane.store.database import Repository
from space.controlplane.store.events import MESSAGE_LENGTH
from space.controlplane.store.events import _kind as check_kind  # the one rule for event kinds
from space.controlplane.store.mapping import sandbox_record
from space.controlplane.store.models import Sandbox, SandboxEvent
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandboxes import desirable
from space.controlplane.store.values import aware, seconds, settable
from space.core import lifecycle
from space.core.errors import Conflict, InvalidState, NotFound
from space.core.lifecycle import Event, State
from space.core.sandbox_options import timeout_seconds
from space.faults import failpoints

# Columns a caller may set alongside a state change / as an observation. Everything else (ids, project,
# state, generation, lease, timestamps) is owned by the store.
TRANSITION_FIELDS: Final = frozenset(
    {
        "node_id",
        "incarnation",
        "created_from",
        "error",
        "error_code",
        "error_permanent",
        "attempts",
        "next_attempt_at",
        "last_activity_at",
        "fork_snapshot_id",
        "expires_at",
        "desired_state",
        *[
            "suspended_snapshot_id",
            "suspended_prefix",
            "recovered_at",
            "recovered_from",
            "crash_count",
            "notice",
            "data_key_id",
        ],
    }
)
OBSERVED_FIELDS: Final = frozenset(
    {
        "node_id",
        "incarnation",
        "error",
        "error_code",
        "error_permanent",
        "attempts",
        "next_attempt_at",
        "last_activity_at",
        "fork_snapshot_id",
        *[
            "suspended_snapshot_id",
            "suspended_prefix",
            "recovered_from",
            "notice",
            "data_key_id",
            "snapshot_policy",
        ],
    }
)
_TIME_FIELDS: Final = ("next_attempt_at", "last_activity_at", "expires_at", "recovered_at")
# Completions that bring a sandbox back to running on a user's behalf: its deadline starts again.
_FRESH_DEADLINE: Final = frozenset({Event.RESUMED, Event.RESTORED, Event.STARTED})


@dataclass(frozen=True, slots=True)
class Note:
    """A sandbox event written with a state change (space.controlplane.store.events has the rules)."""

    kind: str
    message: str
    detail: Mapping[str, Any] = field(default_factory=dict)


def sandbox_values(fields: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    """`fields` checked against `allowed`, times made aware UTC, a desired state validated."""
    values = settable(fields, allowed)
    for name in _TIME_FIELDS:
        if values.get(name) is not None:
            values[name] = aware(values[name], name)
    if "desired_state" in values:
        values["desired_state"] = desirable(values["desired_state"]).value
    return values


def _conflict(session: Session, sandbox_id: str, what: str) -> Conflict | NotFound:
    """The error for a compare-and-swap that matched nothing, naming what the row is now."""
    current = session.get(Sandbox, sandbox_id)
    if current is None:
        return NotFound(f"sandbox {sandbox_id} not found")
    return Conflict(
        f"{what}: sandbox {sandbox_id} changed concurrently (now '{current.state}', "
        f"generation {current.generation})",
        state=current.state,
        generation=current.generation,
    )


def _deleted_refusal(current: Sandbox | None, desired: State) -> InvalidState | None:
    """InvalidState if `desired` may not be asked of `current` because it is (being) deleted for good."""
    if current is None:
        return None
    deleted = State.DELETED.value
    if current.state != deleted and (current.desired_state != deleted or desired is State.DELETED):
        return None
    gone = "deleted" if current.state == deleted else "being deleted"
    return InvalidState(
        f"cannot ask for '{desired}': sandbox is {gone} (state '{current.state}')",
        state=current.state,
        desired_state=current.desired_state,
    )


class SandboxStateRepository(Repository):
    """Every write to an existing sandbox row."""

    def _update_sandbox(
        self,
        sandbox_id: str,
        conditions: list[ColumnElement[bool]],
        values: dict[str, Any],
        what: str,
        note: Note | None = None,
        *,
        fresh_deadline: bool = False,
    ) -> SandboxRecord:
        """UPDATE one sandbox where `conditions` still hold (the compare of compare-and-swap) and return
        it; Conflict (or NotFound) naming what the row is now if someone else changed it first. With
        `fresh_deadline`, a sandbox with a timeout gets a deadline of at least now + that timeout."""
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, *conditions)
            .values(values)
            .returning(Sandbox)
            .execution_options(synchronize_session=False)
        )
        with self._tx(what) as session:
            row = session.scalars(statement).one_or_none()
            if row is None:
                raise _conflict(session, sandbox_id, what)
            if note is not None:
                session.add(
                    SandboxEvent(
                        sandbox_id=sandbox_id, at=self.now(), kind=check_kind(note.kind),
                        message=(note.message or note.kind)[:MESSAGE_LENGTH], detail=dict(note.detail),
                    )
                )  # fmt: skip
            record = sandbox_record(row)
            if fresh_deadline and record.ttl_s and "expires_at" not in values:
                fresh = record.updated_at + timedelta(seconds=record.ttl_s)  # the transition's "now"
                if record.expires_at is None or record.expires_at < fresh:
                    session.execute(
                        update(Sandbox).where(Sandbox.id == sandbox_id).values(expires_at=fresh)
                        .execution_options(synchronize_session=False)
                    )  # fmt: skip
                    record = replace(record, expires_at=fresh)
            return record

    def transition(
        self,
        sandbox_id: str,
        expected_state: State | str,
        expected_generation: int,
        event: Event | str,
        *,
        note: Note | None = None,
        **fields: Any,
    ) -> SandboxRecord:
        """Apply `event` to a sandbox believed to be in (expected_state, expected_generation).

        InvalidState if the lifecycle table refuses the event in expected_state (naming that state);
        Conflict if the row is no longer at that (state, generation); NotFound if it does not exist.
        A state change starts a fresh step: attempts, error and error_permanent reset and
        next_attempt_at becomes now, unless given in `fields` (see TRANSITION_FIELDS). Reaching
        `deleted` stamps deleted_at. The lease is left as it is (the holder releases it)."""
        target = lifecycle.transition(expected_state, event)
        current = lifecycle.parse_state(expected_state)
        now = self.now()
        values: dict[str, Any] = {
            "attempts": 0,
            "error": None,
            "error_code": None,
            "error_permanent": False,
            "next_attempt_at": now,
        }
        values.update(sandbox_values(fields, TRANSITION_FIELDS))
        values.update(state=target.value, generation=Sandbox.generation + 1, updated_at=now)
        if target is State.DELETED:
            values["deleted_at"] = now
        if lifecycle.parse_event(event) is Event.NODE_LOST:
            # The step's worker may hang on the gone node for long: the re-planned sandbox is claimable at
            # once, and that worker, failing to renew a lease it no longer holds, abandons the step.
            values.update(lease_owner=None, lease_until=None)
        conditions = [Sandbox.state == current.value, Sandbox.generation == expected_generation]
        step = lifecycle.parse_event(event)
        failpoints.hit(failpoints.transition_point(current.value, step.value, "before"))
        record = self._update_sandbox(
            sandbox_id,
            conditions,
            values,
            f"{step} on sandbox {sandbox_id}",
            note,
            fresh_deadline=step in _FRESH_DEADLINE,
        )
        failpoints.hit(failpoints.transition_point(current.value, step.value, "after"))
        return record

    def set_desired(
        self,
        sandbox_id: str,
        desired_state: State | str,
        expected_generation: int | None = None,
        *,
        hold: tuple[str, float] | None = None,
    ) -> SandboxRecord:
        """Record what the user wants; the reconciler makes it so. Does not change state or generation.

        With expected_generation, Conflict unless the sandbox is still at that generation (the API
        passes the generation it validated the request against). Resets the retry bookkeeping (a new
        wish deserves a fresh attempt now). InvalidState if the sandbox is deleted or being deleted
        for good (desired 'deleted' is final). With `hold` = (owner, lease_s), the same UPDATE also
        leases the sandbox to `owner` if its lease is free, expired or already `owner`'s (a request that
        runs the step itself, ADR 0074): the returned record's `lease_owner` says whether it did."""
        desired = desirable(desired_state)
        now = self.now()
        leased: dict[str, Any] = {}
        if hold is not None:
            owner, lease_s = hold
            free = or_(
                Sandbox.lease_until.is_(None), Sandbox.lease_until <= now, Sandbox.lease_owner == owner
            )
            leased = {
                "lease_owner": case((free, owner), else_=Sandbox.lease_owner),
                "lease_until": case((free, now + timedelta(seconds=lease_s)), else_=Sandbox.lease_until),
            }
        conditions: list[ColumnElement[bool]] = [Sandbox.id == sandbox_id]
        if expected_generation is not None:
            conditions.append(Sandbox.generation == expected_generation)
        if desired is not State.DELETED:
            conditions.append(Sandbox.desired_state != State.DELETED.value)
        conditions.append(Sandbox.state != State.DELETED.value)
        statement = (
            update(Sandbox)
            .where(*conditions)
            .values(
                desired_state=desired.value,
                attempts=0,
                error_permanent=False,
                next_attempt_at=now,
                updated_at=now,
                **leased,
            )
            .returning(Sandbox)
            .execution_options(synchronize_session=False)
        )
        what = f"asking sandbox {sandbox_id} to be {desired}"
        with self._tx(what) as session:
            row = session.scalars(statement).one_or_none()
            if row is not None:
                return sandbox_record(row)
            refusal = _deleted_refusal(session.get(Sandbox, sandbox_id), desired)
            raise refusal if refusal is not None else _conflict(session, sandbox_id, what)

    def set_deadline(self, sandbox_id: str, timeout_s: int, *, extend_only: bool = False) -> SandboxRecord:
        """The sandbox's deadline becomes now + timeout_s (0: now; it may shorten it), and a positive
        timeout_s becomes its timeout for later resumes (ttl_s). With extend_only the deadline only moves
        later: an earlier or equal one, or none at all (no deadline is later than any), is left as it is.
        InvalidState if the sandbox is deleted or being deleted; NotFound if it does not exist."""
        timeout_s = timeout_seconds(timeout_s)
        now = self.now()
        deadline = now + timedelta(seconds=timeout_s)
        deleted = State.DELETED.value
        conditions: list[ColumnElement[bool]] = [
            Sandbox.id == sandbox_id, Sandbox.state != deleted, Sandbox.desired_state != deleted
        ]  # fmt: skip
        if extend_only:
            conditions += [Sandbox.expires_at.is_not(None), Sandbox.expires_at < deadline]
        values: dict[str, Any] = {"expires_at": deadline, "updated_at": now}
        if timeout_s > 0:
            values["ttl_s"] = timeout_s
        statement = (
            update(Sandbox).where(*conditions).values(values).returning(Sandbox)
            .execution_options(synchronize_session=False)
        )  # fmt: skip
        with self._tx(f"setting the deadline of sandbox {sandbox_id}") as session:
            row = session.scalars(statement).one_or_none()
            if row is None:
                row = session.get(Sandbox, sandbox_id)
                if row is None:
                    raise NotFound(f"sandbox {sandbox_id} not found")
                if deleted in (row.state, row.desired_state):
                    gone = "deleted" if row.state == deleted else "being deleted"
                    raise InvalidState(
                        f"sandbox {sandbox_id} is {gone} (state '{row.state}')", state=row.state
                    )
            return sandbox_record(row)  # extend_only and not later: as it was

    def expire_sandbox(
        self, sandbox_id: str, desired: State | None, *, clear_deadline: bool
    ) -> SandboxRecord | None:
        """Act on a passed deadline: ask for `desired` (None: leave the wish as it is) and, with
        clear_deadline, drop the deadline (a sandbox kept instead of deleted has none until it comes
        back). Only while the deadline is still passed and the sandbox not deleted or being deleted;
        None if that no longer holds (moved meanwhile). Writes a `sandbox.expired` event with it."""
        now = self.now()
        deleted = State.DELETED.value
        conditions: list[ColumnElement[bool]] = [
            Sandbox.expires_at.is_not(None), Sandbox.expires_at <= now,
            Sandbox.state != deleted, Sandbox.desired_state != deleted,
        ]  # fmt: skip
        values: dict[str, Any] = {"updated_at": now}
        if desired is not None:
            values.update(
                desired_state=desirable(desired).value, attempts=0, error_permanent=False, next_attempt_at=now
            )
        if clear_deadline:
            values["expires_at"] = None
        outcome = "deleted" if desired is State.DELETED else f"kept ({desired or 'as it is'})"
        note = Note("sandbox.expired", f"its deadline passed: {outcome}", {"desired_state": desired})
        try:
            return self._update_sandbox(
                sandbox_id, conditions, values, f"expiring sandbox {sandbox_id}", note
            )
        except (Conflict, NotFound):
            return None

    def update_observed(
        self, sandbox_id: str, expected_generation: int | None = None, **fields: Any
    ) -> SandboxRecord:
        """Set observation/bookkeeping columns (OBSERVED_FIELDS) without changing state or generation.

        With expected_generation, only if the sandbox is still at that generation (else Conflict): use
        it whenever the value is only true for that step (e.g. node_id chosen for a create)."""
        values = sandbox_values(fields, OBSERVED_FIELDS)
        values["updated_at"] = self.now()
        conditions = [] if expected_generation is None else [Sandbox.generation == expected_generation]
        return self._update_sandbox(sandbox_id, conditions, values, f"updating sandbox {sandbox_id}")

    def record_failure(
        self,
        sandbox_id: str,
        error: str,
        *,
        code: str,
        retry_in_s: float,
        permanent: bool = False,
        expected_generation: int | None = None,
    ) -> SandboxRecord:
        """A step attempt failed: attempts += 1 (atomically), error and its typed code recorded, next try
        after retry_in_s.
        With permanent=True the reconciler stops retrying until the next state change or set_desired."""
        now = self.now()
        conditions = [] if expected_generation is None else [Sandbox.generation == expected_generation]
        values = {
            "attempts": Sandbox.attempts + 1,
            "error": error,
            "error_code": code,
            "error_permanent": permanent,
            "next_attempt_at": now + seconds(retry_in_s, "retry_in_s"),
            "updated_at": now,
        }
        return self._update_sandbox(
            sandbox_id, conditions, values, f"recording a failure of sandbox {sandbox_id}"
        )

    def record_activity(self, sandbox_id: str, at: datetime | None = None) -> None:
        """Move last_activity_at forward to `at` (default now); never backwards, so late reports are
        harmless."""
        when = aware(at, "at") if at is not None else self.now()
        statement = update(Sandbox).where(Sandbox.id == sandbox_id, Sandbox.last_activity_at < when)
        with self._tx("recording sandbox activity") as session:
            session.execute(
                statement.values(last_activity_at=when).execution_options(synchronize_session=False)
            )

    def report_crash(
        self,
        sandbox_id: str,
        node_id: str | None,
        *,
        notice: str,
        observed_at: datetime | None = None,
        only_in: Collection[State] = lifecycle.LIVE_STATES,
    ) -> SandboxRecord | None:
        """A runtime died (or its node was lost): live -> crashed by compare-and-swap, crash_count + 1.

        Applies only while the sandbox is in a live state (narrowed by `only_in`) on `node_id` (None: any
        node) and, with `observed_at`, only if the record did not change after that observation (a late
        heartbeat must not undo a recovery that finished after it was assembled). None when nothing
        changed."""
        live = tuple(sorted(s.value for s in lifecycle.LIVE_STATES if s in only_in))
        with self._tx(f"reporting a crash of sandbox {sandbox_id}") as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.state not in live or (node_id is not None and row.node_id != node_id):
                return None
            if observed_at is not None and row.updated_at > aware(observed_at, "observed_at"):
                return None
            state, generation, crashes = row.state, row.generation, row.crash_count or 0
        note = Note("sandbox.crashed", notice, {"node_id": node_id, "from": state})
        try:
            return self.transition(
                sandbox_id, state, generation, Event.CRASH, crash_count=crashes + 1, notice=notice, note=note
            )
        except (Conflict, InvalidState, NotFound):
            return None  # moved meanwhile: whoever moved it decides
