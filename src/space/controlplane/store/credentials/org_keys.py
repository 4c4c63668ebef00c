"""Tenant keys (BYOK, ADR 0018): the key service and key id that wrap an org's data keys.

Invariants:
- One key per org. Registering a new key replaces the old one without revoking it: data wrapped by the
  old key stays readable as long as its key service still has it.
- Revocation is recorded once (the first revocation time is kept).
- A change's audit entry (completed with the service and key id) is written in the same transaction.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from sqlalchemy.orm import Session

from space.controlplane.store.credentials.audit import write_audit
from space.controlplane.store.credentials.mapping import org_key_record
from space.controlplane.store.credentials.records import AuditEntry, KeyService, OrgKeyRecord
from space.controlplane.store.database import Repository
from space.controlplane.store.models import OrgKey
from space.core.errors import NotFound


def _org_key_changed(session: Session, now: datetime, row: OrgKey, audit: AuditEntry | None) -> OrgKeyRecord:
    session.flush()
    record = org_key_record(row)
    if audit is not None:
        detail = {**audit.detail, "service": record.service, "key_id": record.key_id}
        write_audit(session, now, dataclasses.replace(audit, detail=detail))
    return record


class OrgKeyRepository(Repository):
    """The org_keys table."""

    def get_org_key(self, org_id: str) -> OrgKeyRecord | None:
        with self._tx("reading an org key") as session:
            row = session.get(OrgKey, org_id)
            return org_key_record(row) if row else None

    def set_org_key(
        self, org_id: str, service: KeyService, key_id: str, *, audit: AuditEntry | None = None
    ) -> OrgKeyRecord:
        """Register (or replace) the org's key; a replaced key is not revoked (old data stays readable
        through it as long as the key service still has it). `audit` (its detail completed with the key)
        is written in the same transaction."""
        now = self.now()
        with self._tx("registering an org key") as session:
            row = session.get(OrgKey, org_id, with_for_update=True)
            if row is None:
                row = OrgKey(org_id=org_id, created_at=now)
                session.add(row)
            row.service, row.key_id, row.state = service, key_id, "active"
            row.created_at, row.rotated_at, row.revoked_at = now, None, None
            return _org_key_changed(session, now, row, audit)

    def mark_org_key(
        self, org_id: str, *, rotated: bool = False, revoked: bool = False, audit: AuditEntry | None = None
    ) -> OrgKeyRecord:
        now = self.now()
        with self._tx("updating an org key") as session:
            row = session.get(OrgKey, org_id, with_for_update=True)
            if row is None:
                raise NotFound("this organization has no registered encryption key")
            if rotated:
                row.rotated_at = now
            if revoked and row.state != "revoked":
                row.state, row.revoked_at = "revoked", now
            return _org_key_changed(session, now, row, audit)
