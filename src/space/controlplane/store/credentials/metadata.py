"""Credentials: their metadata (hosts, injection, env var, placeholder, expiry, rate) and vault reference.

Invariants:
- No method takes or returns a credential's value: rows hold an opaque vault reference, and the default
  vault's sealed values (vault_blobs.py) are ciphertext only.
- A credential is identified by (scope_id, name); resolution for a sandbox takes the most specific of
  sandbox -> project -> org.
- A placeholder is chosen at creation and kept across rotations and metadata updates; a rotation bumps
  `version` and hands back the replaced value's (vault, reference) for the caller to delete once the
  change is committed.
- Every change writes its audit entry in the same transaction as the change (audit.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Final, Literal

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from space.controlplane.credentials.spec import (
    SCOPE_PRECEDENCE,
    Injection,
    Scope,
    default_env_var,
    new_placeholder,
)
from space.controlplane.store.credentials.audit import write_audit
from space.controlplane.store.credentials.mapping import credential_record
from space.controlplane.store.credentials.records import (
    AuditEntry,
    CredentialChange,
    CredentialFields,
    CredentialRecord,
    scope_id_of,
)
from space.controlplane.store.database import Repository
from space.controlplane.store.models import Credential, Sandbox
from space.core.errors import AlreadyExists, InvalidArgument, NotFound

CREDENTIAL_ID_PREFIX: Final = "cred-"
DEFAULT_INJECTION: Final = Injection("bearer", "Authorization", "Bearer {value}")
Action = Literal["create", "rotate", "update"]


def new_credential_id() -> str:
    return CREDENTIAL_ID_PREFIX + secrets.token_hex(13)  # 31 characters, fits ID_LENGTH


def _new_row(
    *,
    org_id: str,
    project_id: str | None,
    sandbox_id: str | None,
    scope: Scope,
    owner: str,
    name: str,
    fields: CredentialFields,
    vault: str,
    vault_ref: str | None,
    actor: str,
    now: datetime,
) -> Credential:
    """The row of a credential created by a put (which must give its value and hosts)."""
    if vault_ref is None:
        raise InvalidArgument(f"credential {name!r} does not exist yet: give its value", field="value")
    if fields.hosts is None:
        raise InvalidArgument("a new credential needs hosts", field="hosts")
    injection = fields.injection or DEFAULT_INJECTION
    return Credential(
        id=new_credential_id(),
        org_id=org_id,
        project_id=project_id if scope != "org" else None,
        sandbox_id=sandbox_id if scope == "sandbox" else None,
        scope=scope,
        scope_id=owner,
        name=name,
        hosts=list(fields.hosts),
        method=injection.method,
        header_name=injection.header_name,
        header_template=injection.header_template,
        query_param=injection.query_param,
        login=injection.login.to_json() if injection.login else None,
        env_var=fields.env_var or default_env_var(name),
        placeholder=new_placeholder(name),
        vault=vault,
        vault_ref=vault_ref,
        version=1,
        expires_at=None if fields.clear_expiry else fields.expires_at,
        rate_per_minute=None if fields.clear_rate else fields.rate_per_minute,
        created_by=actor,
        created_at=now,
        updated_at=now,
        rotated_at=now,
    )


def _update_metadata(row: Credential, fields: CredentialFields) -> None:
    """Apply the given metadata of an update; `None` fields keep their stored value."""
    if fields.hosts is not None:
        row.hosts = list(fields.hosts)
    if fields.injection is not None:
        row.method = fields.injection.method
        row.header_name = fields.injection.header_name
        row.header_template = fields.injection.header_template
        row.query_param = fields.injection.query_param
        row.login = fields.injection.login.to_json() if fields.injection.login else None
    if fields.env_var is not None:
        row.env_var = fields.env_var
    if fields.clear_expiry:
        row.expires_at = None
    elif fields.expires_at is not None:
        row.expires_at = fields.expires_at
    if fields.clear_rate:
        row.rate_per_minute = None
    elif fields.rate_per_minute is not None:
        row.rate_per_minute = fields.rate_per_minute


def _update_row(
    row: Credential, fields: CredentialFields, vault: str, vault_ref: str | None, now: datetime
) -> tuple[Literal["rotate", "update"], tuple[str, str] | None]:
    """Apply an update to `row`: the audit action, and the (vault, reference) of a replaced value."""
    _update_metadata(row, fields)
    row.updated_at = now
    if vault_ref is None:
        return "update", None
    # The replaced value stays in ITS vault, which need not be the one new values go to.
    stale = (row.vault, row.vault_ref) if row.vault_ref != vault_ref else None
    row.vault, row.vault_ref = vault, vault_ref
    row.version += 1
    row.rotated_at = now
    return "rotate", stale


def _put_entry(record: CredentialRecord, action: Action, actor: str) -> AuditEntry:
    """The audit entry of a put: what the credential is now (never its value)."""
    return AuditEntry(
        org_id=record.org_id, action=action, actor=actor, project_id=record.project_id,
        sandbox_id=record.sandbox_id, credential_id=record.id, credential_name=record.name,
        scope=record.scope,
        detail={
            "version": record.version, "hosts": record.hosts, "method": record.injection.method,
            "expires_at": record.expires_at.isoformat() if record.expires_at else None,
            "rate_per_minute": record.rate_per_minute,
        },
    )  # fmt: skip


def _locked(session: Session, scope_id: str, name: str) -> Credential | None:
    query = select(Credential).where(Credential.scope_id == scope_id, Credential.name == name)
    return session.scalars(query.with_for_update()).one_or_none()


class CredentialRepository(Repository):
    """The credentials table."""

    def put_credential(
        self,
        *,
        org_id: str,
        project_id: str | None,
        sandbox_id: str | None,
        scope: Scope,
        name: str,
        fields: CredentialFields,
        vault: str,
        vault_ref: str | None,
        actor: str,
    ) -> CredentialChange:
        """Create or update the credential (scope, owner, name). A new one needs hosts, injection and a
        vault reference; an update changes the given fields, and with `vault_ref` rotates the value.
        Concurrent first puts of one name: one creates, the others (after a unique violation) update."""
        owner = scope_id_of(scope, org_id, project_id, sandbox_id)
        for attempt in range(2):
            now = self.now()
            try:
                with self._tx(f"setting credential {name!r}") as session:
                    row = _locked(session, owner, name)
                    action: Action
                    stale: tuple[str, str] | None = None
                    if row is None:
                        row = _new_row(
                            org_id=org_id, project_id=project_id, sandbox_id=sandbox_id, scope=scope,
                            owner=owner, name=name, fields=fields, vault=vault, vault_ref=vault_ref,
                            actor=actor, now=now,
                        )  # fmt: skip
                        session.add(row)
                        action = "create"
                    else:
                        action, stale = _update_row(row, fields, vault, vault_ref, now)
                    session.flush()
                    record = credential_record(row)
                    write_audit(session, now, _put_entry(record, action, actor))
                    if stale is None:
                        return CredentialChange(record, action)
                    return CredentialChange(record, action, stale_vault=stale[0], stale_ref=stale[1])
            except AlreadyExists:  # a concurrent first put of this name won: update its row instead
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def get_credential(self, scope_id: str, name: str) -> CredentialRecord | None:
        with self._tx("reading a credential") as session:
            query = select(Credential).where(Credential.scope_id == scope_id, Credential.name == name)
            row = session.scalars(query).one_or_none()
            return credential_record(row) if row else None

    def list_credentials(self, org_id: str, project_id: str | None) -> list[CredentialRecord]:
        """The org's credentials and, with `project_id`, that project's and its sandboxes'; without it, every
        credential of the org."""
        query = select(Credential).where(Credential.org_id == org_id)
        if project_id is not None:
            query = query.where(or_(Credential.scope == "org", Credential.project_id == project_id))
        with self._tx("listing credentials") as session:
            rows = session.scalars(query.order_by(Credential.name, Credential.scope, Credential.id))
            return [credential_record(row) for row in rows]

    def delete_credential(self, scope_id: str, name: str, *, actor: str) -> CredentialRecord:
        """Delete the credential and log it; the caller then deletes its vault value."""
        now = self.now()
        with self._tx(f"deleting credential {name!r}") as session:
            row = _locked(session, scope_id, name)
            if row is None:
                raise NotFound(f"credential {name!r} not found")
            record = credential_record(row)
            session.delete(row)
            write_audit(
                session,
                now,
                AuditEntry(
                    org_id=record.org_id, action="delete", actor=actor, project_id=record.project_id,
                    sandbox_id=record.sandbox_id, credential_id=record.id, credential_name=name,
                    scope=record.scope, detail={"version": record.version},
                ),
            )  # fmt: skip
            return record

    def resolve(
        self, org_id: str, project_id: str, sandbox_id: str | None, names: Sequence[str]
    ) -> dict[str, CredentialRecord | None]:
        """name -> the most specific credential of that name visible to the sandbox (sandbox, project, org),
        or None when there is none."""
        owners = {"org": org_id, "project": project_id, "sandbox": sandbox_id}
        wanted = sorted(set(names))
        found: dict[str, CredentialRecord | None] = dict.fromkeys(wanted)
        if not wanted:
            return found
        with self._tx("resolving credentials") as session:
            query = select(Credential).where(
                Credential.name.in_(wanted),
                Credential.scope_id.in_([o for o in owners.values() if o is not None]),
                Credential.org_id == org_id,
            )
            rows = [credential_record(row) for row in session.scalars(query)]
        for name in wanted:
            candidates = {r.scope: r for r in rows if r.name == name and owners[r.scope] == r.scope_id}
            found[name] = next((candidates[s] for s in SCOPE_PRECEDENCE if s in candidates), None)
        return found

    def credentials_of_deleted_sandboxes(self, limit: int = 500) -> list[CredentialRecord]:
        """Sandbox-scoped credentials whose sandbox is deleted (they can never be used again)."""
        with self._tx("finding credentials of deleted sandboxes") as session:
            query = (
                select(Credential)
                .join(Sandbox, Sandbox.id == Credential.sandbox_id)
                .where(Credential.scope == "sandbox", Sandbox.state == "deleted")
                .limit(limit)
            )
            return [credential_record(row) for row in session.scalars(query)]
