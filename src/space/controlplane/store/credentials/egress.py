"""Sandbox egress policies and the private networks an org admin opened for a project (ADR 0026).

Invariants:
- A policy's `version` starts at 1 and grows by one per change, so a node can ignore a stale push.
- A policy row belongs to one project for good: a put from another project is NotFound, like an absent
  sandbox. It is written just BEFORE its sandbox row (no foreign key), so the reconciler never sees a
  sandbox without its policy.
- Every change's audit entries are written in the same transaction as the change (audit.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.orm import Session

from space.controlplane.store.credentials.audit import write_audit
from space.controlplane.store.credentials.mapping import egress_record
from space.controlplane.store.credentials.records import AuditEntry, EgressRecord
from space.controlplane.store.database import Repository
from space.controlplane.store.models import ProjectPrivateNetworks, SandboxEgress
from space.core.errors import NotFound


def _change_policy(
    row: SandboxEgress,
    now: datetime,
    allow: Sequence[str] | None,
    deny: Sequence[str] | None,
    credentials: Sequence[str] | None,
) -> None:
    """Apply a put to an existing policy: the given lists replace the stored ones; version + 1."""
    if allow is not None:
        row.allow = list(allow)
    if deny is not None:
        row.deny = list(deny)
    if credentials is not None:
        row.credentials = list(credentials)
    row.version += 1
    row.updated_at = now


def _log_policy(
    session: Session,
    now: datetime,
    record: EgressRecord,
    audit: AuditEntry | None,
    also: Sequence[AuditEntry],
) -> None:
    if audit is not None:
        detail = {"allow": record.allow, "deny": record.deny, "credentials": record.credentials,
                  "version": record.version}  # fmt: skip
        write_audit(session, now, dataclasses.replace(audit, detail={**audit.detail, **detail}))
    for entry in also:
        write_audit(session, now, entry)


class EgressRepository(Repository):
    """The sandbox_egress and project_private_networks tables."""

    def put_egress(
        self,
        sandbox_id: str,
        project_id: str,
        *,
        allow: Sequence[str] | None,
        deny: Sequence[str] | None,
        credentials: Sequence[str] | None,
        audit: AuditEntry | None = None,
        also: Sequence[AuditEntry] = (),
    ) -> EgressRecord:
        """Set (create or change) a sandbox's policy; `None` lists keep their stored value (empty for a new
        policy). A row of another project is NotFound. `audit` (its detail completed with the resulting
        policy and version) and `also` are written in the same transaction as the change."""
        now = self.now()
        with self._tx("setting an egress policy") as session:
            row = session.get(SandboxEgress, sandbox_id, with_for_update=True)
            if row is None:
                row = SandboxEgress(
                    sandbox_id=sandbox_id, project_id=project_id, allow=list(allow or []),
                    deny=list(deny or []), credentials=list(credentials or []), version=1, updated_at=now,
                )  # fmt: skip
                session.add(row)
            elif row.project_id != project_id:
                raise NotFound(f"sandbox {sandbox_id} not found")
            else:
                _change_policy(row, now, allow, deny, credentials)
            session.flush()
            record = egress_record(row)
            _log_policy(session, now, record, audit, also)
            return record

    def get_egress(self, sandbox_id: str) -> EgressRecord | None:
        with self._tx("reading an egress policy") as session:
            row = session.get(SandboxEgress, sandbox_id)
            return egress_record(row) if row else None

    def get_private_networks(self, project_id: str) -> list[str]:
        with self._tx("reading a project's private networks") as session:
            row = session.get(ProjectPrivateNetworks, project_id)
            return list(row.networks) if row else []

    def set_private_networks(
        self, project_id: str, networks: Sequence[str], *, actor: str, audit: AuditEntry
    ) -> list[str]:
        """Replace the project's approved private networks (validated by the caller); `audit` (its detail
        completed with the networks) is written in the same transaction."""
        now = self.now()
        with self._tx("setting a project's private networks") as session:
            row = session.get(ProjectPrivateNetworks, project_id, with_for_update=True)
            if row is None:
                row = ProjectPrivateNetworks(project_id=project_id)
                session.add(row)
            row.networks, row.updated_at, row.updated_by = list(networks), now, actor
            detail = {**audit.detail, "allowed_private_networks": list(networks)}
            write_audit(session, now, dataclasses.replace(audit, detail=detail))
            return list(networks)
