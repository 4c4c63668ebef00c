"""Work leases: how the reconcilers share out the sandboxes that need work.

Invariants:
- `claim_work` atomically sets (lease_owner, lease_until) on rows whose lease is free or expired,
  selecting them with `FOR UPDATE SKIP LOCKED` on PostgreSQL and inside a BEGIN IMMEDIATE transaction on
  SQLite, so two claimers never hold the same sandbox at the same time.
- A lease is an optimisation, not a correctness fence: the compare-and-swap on (state, generation)
  (sandbox_state.py) still decides.
- Lease times come from the claimer's clock: keep replica clocks in sync (NTP) to well under the lease
  length.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from sqlalchemy import ColumnElement, and_, or_, select, update

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import sandbox_record
from space.controlplane.store.models import Sandbox
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.values import rowcount, seconds, text
from space.core import lifecycle
from space.core.lifecycle import State

_IN_PROGRESS_VALUES: Final = tuple(sorted(s.value for s in lifecycle.IN_PROGRESS_STATES))


def _lease_free(now: datetime) -> ColumnElement[bool]:
    return or_(Sandbox.lease_until.is_(None), Sandbox.lease_until <= now)


def _needs_work(now: datetime) -> ColumnElement[bool]:
    deleted = State.DELETED.value
    return and_(
        Sandbox.state != deleted,
        Sandbox.next_attempt_at <= now,
        _lease_free(now),
        or_(
            # A step is in flight (maybe its process died): finish it or fail it.
            Sandbox.state.in_(_IN_PROGRESS_VALUES),
            # Users want something else; unless a step gave up for good on this wish.
            and_(Sandbox.state != Sandbox.desired_state, Sandbox.error_permanent.is_(False)),
            # Time to live is over and nobody has asked for deletion yet.
            and_(
                Sandbox.expires_at.is_not(None),
                Sandbox.expires_at <= now,
                Sandbox.desired_state != deleted,
            ),
        ),
    )


class WorkLeaseRepository(Repository):
    """Claiming, renewing and releasing leases on sandboxes."""

    def claim_work(self, owner: str, limit: int, lease_s: float) -> list[SandboxRecord]:
        """Lease up to `limit` sandboxes that need work to `owner` for `lease_s` seconds.

        A sandbox needs work when a step is in progress, when state != desired_state (and no step gave
        up permanently), or when its TTL expired; and its next_attempt_at has come and its lease is free
        or expired. Oldest next_attempt_at first. Concurrent claimers get disjoint sets."""
        owner = text(owner, "owner", 128)
        if limit <= 0:
            return []
        now = self.now()
        until = now + seconds(lease_s, "lease_s")
        candidates = (
            select(Sandbox.id)
            .where(_needs_work(now))
            .order_by(Sandbox.next_attempt_at, Sandbox.id)
            .limit(limit)
            # PostgreSQL: lock the candidates and skip rows another claimer holds, so claimers never
            # wait on each other. SQLite ignores this; its BEGIN IMMEDIATE already serializes claimers.
            .with_for_update(skip_locked=True)
        )
        with self._tx("claiming work") as session:
            chosen = list(session.scalars(candidates))
            if not chosen:
                return []
            # The lease condition again: the rows are locked now, so this re-check is what makes the
            # claim atomic even if a candidate was claimed between snapshot and lock (READ COMMITTED).
            statement = (
                update(Sandbox)
                .where(Sandbox.id.in_(chosen), _lease_free(now))
                .values(lease_owner=owner, lease_until=until)
                .returning(Sandbox)
                .execution_options(synchronize_session=False)
            )
            rows = list(session.scalars(statement))
            rows.sort(key=lambda r: (r.next_attempt_at, r.id))
            return [sandbox_record(row) for row in rows]

    def lease_owners(self) -> list[str]:
        """Owners currently holding unexpired leases."""
        now = self.now()
        query = select(Sandbox.lease_owner).where(Sandbox.lease_owner.is_not(None), Sandbox.lease_until > now)
        with self._tx("listing lease owners") as session:
            return sorted({owner for owner in session.scalars(query.distinct()) if owner})

    def clear_leases(self, owner: str) -> int:
        """Free every lease of `owner` (a process known to be dead), so its work is taken over at once."""
        statement = (
            update(Sandbox)
            .where(Sandbox.lease_owner == owner)
            .values(lease_owner=None, lease_until=None)
            .execution_options(synchronize_session=False)
        )
        with self._tx("clearing a dead owner's leases") as session:
            return rowcount(session.execute(statement))

    def hold(self, sandbox_id: str, owner: str, lease_s: float) -> bool:
        """Lease one sandbox to `owner` for a step run outside the reconciler (an API request's inline
        step): True if its lease was free, expired or already `owner`'s; False if another owner holds it."""
        owner = text(owner, "owner", 128)
        now = self.now()
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, or_(_lease_free(now), Sandbox.lease_owner == owner))
            .values(lease_owner=owner, lease_until=now + seconds(lease_s, "lease_s"))
            .execution_options(synchronize_session=False)
        )
        with self._tx("holding a lease") as session:
            return rowcount(session.execute(statement)) == 1

    def renew(self, sandbox_id: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease; False if the lease now belongs to someone else (stop working on it)."""
        until = self.now() + seconds(lease_s, "lease_s")
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, Sandbox.lease_owner == owner)
            .values(lease_until=until)
            .execution_options(synchronize_session=False)
        )
        with self._tx("renewing a lease") as session:
            return rowcount(session.execute(statement)) == 1

    def release(self, sandbox_id: str, owner: str) -> bool:
        """Give the lease back (False if `owner` no longer held it)."""
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, Sandbox.lease_owner == owner)
            .values(lease_owner=None, lease_until=None)
            .execution_options(synchronize_session=False)
        )
        with self._tx("releasing a lease") as session:
            return rowcount(session.execute(statement)) == 1
