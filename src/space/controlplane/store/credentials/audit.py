"""The credential audit log: who set, rotated, deleted, bound or used which credential, and when.

Invariants:
- Entries about a change are written by `write_audit` in the SAME transaction as the change (the other
  credential repositories call it with their session), so the log never misses a change that happened
  nor records one that did not.
- Entries are ordered by their autoincrement id (the order they were written in, also within one
  instant); pages and purges walk that id, so every batch is bounded.
- The log outlives deleted credentials (no foreign key) and is purged by age only.
- Usage (`usage_of`) counts only what gateways reported (INJECTED, REFUSED) per credential id, so a
  credential deleted and made again under its name starts from nothing; with a project, only that
  project's sandboxes' uses count (an org credential's uses elsewhere are not a project's business).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Final

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from space.controlplane.credentials.spec import Scope
from space.controlplane.store.credentials.mapping import audit_record
from space.controlplane.store.credentials.records import AuditEntry, AuditRecord, CredentialUsage
from space.controlplane.store.database import Repository
from space.controlplane.store.models import CredentialAudit
from space.controlplane.store.values import rowcount
from space.core.errors import InvalidArgument

MAX_AUDIT_PAGE: Final = 1000
HOST_LENGTH: Final = 255
#: The gateway's report of a value put into a request (node_routes.NODE_AUDIT_ACTIONS).
INJECTED: Final = "injected"
#: The gateway's reports of a request that carried a credential's placeholder and was refused.
REFUSED: Final = frozenset({"denied", "rate_limited", "expired", "placeholder_blocked"})
#: Credentials per usage query (bound parameters stay far below any database's limit).
USAGE_BATCH: Final = 400


def write_audit(session: Session, at: datetime, entry: AuditEntry) -> None:
    """Add `entry`, stamped `at`, to the transaction of `session`."""
    session.add(
        CredentialAudit(
            at=at,
            org_id=entry.org_id,
            project_id=entry.project_id,
            sandbox_id=entry.sandbox_id,
            credential_id=entry.credential_id,
            credential_name=entry.credential_name,
            scope=entry.scope,
            action=entry.action,
            actor=entry.actor,
            host=entry.host[:HOST_LENGTH] if entry.host else None,
            detail=dict(entry.detail),
        )
    )


def _counted(
    have: CredentialUsage | None, action: str, count: int, newest: datetime | None
) -> CredentialUsage:
    """`have` with one (action, count, newest) group of the usage query added."""
    have = have or CredentialUsage()
    if action == INJECTED:
        return replace(have, injected=have.injected + count, last_used_at=newest)
    times = [t for t in (have.last_refused_at, newest) if t is not None]
    return replace(have, refused=have.refused + count, last_refused_at=max(times) if times else None)


def _page(limit: int) -> int:
    return max(1, min(limit, MAX_AUDIT_PAGE))


class AuditRepository(Repository):
    """Writing, reading and purging the credential audit log."""

    def audit(self, entries: Sequence[AuditEntry], at: datetime | None = None) -> None:
        if not entries:
            return
        now = at or self.now()
        with self._tx("writing the credential audit log") as session:
            for entry in entries:
                write_audit(session, now, entry)

    def list_audit(
        self,
        org_id: str,
        name: str,
        *,
        scope: Scope,
        scope_id: str,
        project_id: str | None,
        limit: int = 100,
        after_id: int = 0,
    ) -> list[AuditRecord]:
        """The log of the credential (scope, scope_id, name), oldest first; with `project_id`, only what
        happened in that project (an org credential's uses elsewhere are not a project's business)."""
        query = select(CredentialAudit).where(
            CredentialAudit.org_id == org_id,
            CredentialAudit.credential_name == name,
            CredentialAudit.scope == scope,
            CredentialAudit.id > after_id,
        )
        if scope == "project":
            query = query.where(CredentialAudit.project_id == scope_id)
        elif scope == "sandbox":
            query = query.where(CredentialAudit.sandbox_id == scope_id)
        if project_id is not None:
            query = query.where(CredentialAudit.project_id == project_id)
        with self._tx("reading the credential audit log") as session:
            rows = session.scalars(query.order_by(CredentialAudit.id).limit(_page(limit)))
            return [audit_record(row) for row in rows]

    def usage_of(
        self, org_id: str, credentials: Collection[tuple[str, str]], *, project_id: str | None
    ) -> dict[str, CredentialUsage]:
        """Usage per credential id of `credentials` ((id, name) pairs); with `project_id`, only the uses in
        that project. One grouped query per USAGE_BATCH credentials, walking the (org, name) index."""
        pairs = sorted(set(credentials))
        found: dict[str, CredentialUsage] = {}
        with self._tx("counting credential uses") as session:
            for start in range(0, len(pairs), USAGE_BATCH):
                batch = pairs[start : start + USAGE_BATCH]
                query = (
                    select(
                        CredentialAudit.credential_id, CredentialAudit.action, func.count(),
                        func.max(CredentialAudit.at),
                    )
                    .where(
                        CredentialAudit.org_id == org_id,
                        CredentialAudit.credential_name.in_(sorted({name for _id, name in batch})),
                        CredentialAudit.credential_id.in_([credential_id for credential_id, _name in batch]),
                        CredentialAudit.action.in_(sorted({INJECTED, *REFUSED})),
                    )
                    .group_by(CredentialAudit.credential_id, CredentialAudit.action)
                )  # fmt: skip
                if project_id is not None:
                    query = query.where(CredentialAudit.project_id == project_id)
                for credential_id, action, count, newest in session.execute(query):
                    if credential_id is not None:  # the query names ids: never None, but typed so
                        found[credential_id] = _counted(found.get(credential_id), action, count, newest)
        return found

    def purge_audit(self, older_than_s: float, *, limit: int = 1000) -> int:
        """Delete audit entries older than `older_than_s` among the `limit` oldest (by id), in one short
        transaction; the number deleted (== limit: there may be more). Entries are written in time
        order, so the oldest ids are the oldest entries; walking the primary key keeps every batch
        bounded without an index on `at` (an entry stamped a little out of order by another replica's
        clock waits at most that skew longer)."""
        if older_than_s <= 0:
            raise InvalidArgument("older_than_s must be positive", field="older_than_s")
        cutoff = self.now() - timedelta(seconds=older_than_s)
        oldest = (
            select(CredentialAudit.id, CredentialAudit.at).order_by(CredentialAudit.id).limit(max(1, limit))
        )
        with self._tx("purging the credential audit log") as session:
            expired = []
            for entry_id, at in session.execute(oldest):
                if at >= cutoff:
                    break
                expired.append(entry_id)
            if not expired:
                return 0
            return rowcount(session.execute(delete(CredentialAudit).where(CredentialAudit.id.in_(expired))))

    def list_sandbox_audit(self, sandbox_id: str, limit: int = 100) -> list[AuditRecord]:
        query = select(CredentialAudit).where(CredentialAudit.sandbox_id == sandbox_id)
        with self._tx("reading the credential audit log") as session:
            rows = session.scalars(query.order_by(CredentialAudit.id).limit(_page(limit)))
            return [audit_record(row) for row in rows]
