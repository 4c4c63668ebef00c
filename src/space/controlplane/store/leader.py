"""Leader leases: at most one control-plane replica holds a named lease at a time (ADR 0034).

Invariants:
- `claim_leadership(name, owner, lease_s)` is one transaction on the lease's row: it succeeds when the row
  is absent, held by `owner` (a renewal) or expired, and then sets `expires_at` = now + lease_s; it fails
  (False) while another owner's lease runs. Two claimers that both find the row absent race on its
  primary key: the loser's insert is a unique violation and it is told False, never an error.
- The row is read `FOR UPDATE` (PostgreSQL; SQLite's BEGIN IMMEDIATE serializes writers), so a renewal and
  a takeover of an expired lease never both succeed.
- `acquired_at` changes only when the owner changes: it dates the current holder's tenure.
- Times come from the claimer's clock (the Database's): the replicas' clocks must agree to well under the
  lease length. The holder itself must stop acting as leader before the lease could have expired for the
  others; it measures that with its own monotonic clock (space.controlplane.api.jobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete

from space.controlplane.store.database import Repository
from space.controlplane.store.models import LeaderLease
from space.controlplane.store.values import rowcount, seconds, text
from space.core.errors import AlreadyExists, Conflict

NAME_LENGTH = 64
OWNER_LENGTH = 128


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    name: str
    owner: str
    expires_at: datetime
    acquired_at: datetime


def _record(row: LeaderLease) -> LeaderRecord:
    return LeaderRecord(
        name=row.name, owner=row.owner, expires_at=row.expires_at, acquired_at=row.acquired_at
    )


class LeaderLeaseRepository(Repository):
    """Claiming, renewing, releasing and reading leader leases."""

    def claim_leadership(self, name: str, owner: str, lease_s: float) -> bool:
        """Take or renew the lease `name` for `owner` until now + `lease_s`; False if another owner holds
        an unexpired lease (or won a race for a lease nobody held)."""
        name = text(name, "name", NAME_LENGTH)
        owner = text(owner, "owner", OWNER_LENGTH)
        now = self.now()
        until = now + seconds(lease_s, "lease_s")
        try:
            with self._tx(f"claiming leadership of {name}") as session:
                row = session.get(LeaderLease, name, with_for_update=True)
                if row is None:
                    session.add(LeaderLease(name=name, owner=owner, expires_at=until, acquired_at=now))
                    session.flush()
                    return True
                if row.owner != owner and row.expires_at > now:
                    return False
                if row.owner != owner:
                    row.owner, row.acquired_at = owner, now
                row.expires_at = until
                return True
        except (AlreadyExists, Conflict):
            return False  # another replica inserted the row (or serialized ahead of us) first

    def release_leadership(self, name: str, owner: str) -> bool:
        """Give the lease up at once (a clean shutdown), so another replica need not wait for it to expire;
        False if `owner` did not hold it."""
        statement = delete(LeaderLease).where(LeaderLease.name == name, LeaderLease.owner == owner)
        with self._tx(f"releasing leadership of {name}") as session:
            return rowcount(session.execute(statement)) == 1

    def leader(self, name: str) -> LeaderRecord | None:
        """The lease `name` if it is held and unexpired, else None."""
        with self._tx(f"reading the leader of {name}") as session:
            row = session.get(LeaderLease, name)
            if row is None or row.expires_at <= self.now():
                return None
            return _record(row)
