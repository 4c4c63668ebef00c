"""Store operations for credentials, their audit log, sandbox egress policies and tenant keys (issue 5).

Invariants:
- No method takes or returns a credential's value: rows hold an opaque vault reference, and the default
  vault's sealed values (`vault_secrets`) are ciphertext only (space.controlplane.credentials.vault).
- A credential is identified by (scope_id, name), scope_id being the org, project or sandbox it belongs
  to; resolution for a sandbox takes the most specific of sandbox -> project -> org.
- Every change to a credential or to a policy (and the bindings it makes or drops) writes its audit
  entries in the SAME transaction as the change, so the log never misses a change that happened (nor
  records one that did not).
- A placeholder is chosen at creation and kept across rotations and metadata updates.
- An egress policy's `version` grows by one per change, so a node can ignore a stale push.
- Each public method is one short transaction returning frozen records (like Store).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal, cast

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from space.controlplane.credentials.spec import (
    SCOPE_PRECEDENCE,
    Injection,
    Method,
    Scope,
    default_env_var,
    new_placeholder,
)
from space.controlplane.store.models import (
    Credential,
    CredentialAudit,
    OrgKey,
    ProjectPrivateNetworks,
    Sandbox,
    SandboxEgress,
    VaultSecret,
)
from space.controlplane.store.store import Store
from space.core.errors import AlreadyExists, InvalidArgument, NotFound

CREDENTIAL_ID_PREFIX: Final = "cred-"
MAX_AUDIT_PAGE: Final = 1000
KeyService = Literal["local", "kms"]
KeyState = Literal["active", "revoked"]


def new_credential_id() -> str:
    return CREDENTIAL_ID_PREFIX + secrets.token_hex(13)  # 31 characters, fits ID_LENGTH


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    id: str
    org_id: str
    project_id: str | None
    sandbox_id: str | None
    scope: Scope
    scope_id: str
    name: str
    hosts: list[str]
    injection: Injection
    env_var: str
    placeholder: str
    vault: str
    vault_ref: str
    version: int
    expires_at: datetime | None
    rate_per_minute: int | None
    created_by: str | None
    created_at: datetime
    updated_at: datetime
    rotated_at: datetime

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: datetime
    org_id: str
    project_id: str | None
    sandbox_id: str | None
    credential_id: str | None
    credential_name: str | None
    scope: str | None
    action: str
    actor: str
    host: str | None
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EgressRecord:
    sandbox_id: str
    project_id: str
    allow: list[str]
    deny: list[str]
    credentials: list[str]
    version: int
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class OrgKeyRecord:
    org_id: str
    service: KeyService
    key_id: str
    state: KeyState
    created_at: datetime
    rotated_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class CredentialChange:
    """What `put_credential` did: the new record, the audit action, and the vault reference (and its
    backend) the caller must delete now that the change is committed (the replaced value of a rotation)."""

    record: CredentialRecord
    action: Literal["create", "rotate", "update"]
    stale_ref: str | None = None
    stale_vault: str | None = None  # the backend holding `stale_ref`


@dataclass(frozen=True, slots=True)
class CredentialFields:
    """The metadata of a put; `None` fields of an update keep their stored value."""

    hosts: list[str] | None = None
    injection: Injection | None = None
    env_var: str | None = None
    expires_at: datetime | None = None
    clear_expiry: bool = False
    rate_per_minute: int | None = None
    clear_rate: bool = False


@dataclass(frozen=True, slots=True)
class AuditEntry:
    org_id: str
    action: str
    actor: str
    project_id: str | None = None
    sandbox_id: str | None = None
    credential_id: str | None = None
    credential_name: str | None = None
    scope: str | None = None
    host: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _credential(row: Credential) -> CredentialRecord:
    return CredentialRecord(
        id=row.id,
        org_id=row.org_id,
        project_id=row.project_id,
        sandbox_id=row.sandbox_id,
        scope=cast(Scope, row.scope),
        scope_id=row.scope_id,
        name=row.name,
        hosts=list(row.hosts),
        injection=Injection(cast(Method, row.method), row.header_name, row.header_template, row.query_param),
        env_var=row.env_var,
        placeholder=row.placeholder,
        vault=row.vault,
        vault_ref=row.vault_ref,
        version=row.version,
        expires_at=row.expires_at,
        rate_per_minute=row.rate_per_minute,
        created_by=row.created_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        rotated_at=row.rotated_at,
    )


def _audit(row: CredentialAudit) -> AuditRecord:
    return AuditRecord(
        id=row.id,
        at=row.at,
        org_id=row.org_id,
        project_id=row.project_id,
        sandbox_id=row.sandbox_id,
        credential_id=row.credential_id,
        credential_name=row.credential_name,
        scope=row.scope,
        action=row.action,
        actor=row.actor,
        host=row.host,
        detail=dict(row.detail or {}),
    )


def _egress(row: SandboxEgress) -> EgressRecord:
    return EgressRecord(
        sandbox_id=row.sandbox_id,
        project_id=row.project_id,
        allow=list(row.allow),
        deny=list(row.deny),
        credentials=list(row.credentials),
        version=row.version,
        updated_at=row.updated_at,
    )


def _org_key(row: OrgKey) -> OrgKeyRecord:
    return OrgKeyRecord(
        org_id=row.org_id,
        service=cast(KeyService, row.service),
        key_id=row.key_id,
        state=cast(KeyState, row.state),
        created_at=row.created_at,
        rotated_at=row.rotated_at,
        revoked_at=row.revoked_at,
    )


def scope_id_of(scope: Scope, org_id: str, project_id: str | None, sandbox_id: str | None) -> str:
    owner = {"org": org_id, "project": project_id, "sandbox": sandbox_id}[scope]
    if owner is None:
        raise InvalidArgument(f"a {scope}-scoped credential needs its {scope} id", field="scope")
    return owner


class CredentialStore:
    """The credential tables, over the engine and clock of a `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.database = store.database

    def _tx(self, what: str) -> AbstractContextManager[Session]:
        return self.database.transaction(what)

    def now(self) -> datetime:
        return self.store.now()

    @staticmethod
    def _log(session: Session, at: datetime, entry: AuditEntry) -> None:
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
                host=entry.host[:255] if entry.host else None,
                detail=dict(entry.detail),
            )
        )

    # ---- credentials ----------------------------------------------------------------------------------

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
                    query = select(Credential).where(Credential.scope_id == owner, Credential.name == name)
                    row = session.scalars(query.with_for_update()).one_or_none()
                    if row is None:
                        if vault_ref is None:
                            raise InvalidArgument(
                                f"credential {name!r} does not exist yet: give its value", field="value"
                            )
                        if fields.hosts is None:
                            raise InvalidArgument("a new credential needs hosts", field="hosts")
                        injection = fields.injection or Injection("bearer", "Authorization", "Bearer {value}")
                        row = Credential(
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
                        session.add(row)
                        action: Literal["create", "rotate", "update"] = "create"
                        stale: tuple[str, str] | None = None
                    else:
                        action, stale = self._update_row(row, fields, vault, vault_ref, now)
                    session.flush()
                    record = _credential(row)
                    self._log(
                        session,
                        now,
                        AuditEntry(
                            org_id=org_id, action=action, actor=actor, project_id=record.project_id,
                            sandbox_id=record.sandbox_id, credential_id=record.id, credential_name=name,
                            scope=scope,
                            detail={
                                "version": record.version, "hosts": record.hosts,
                                "method": record.injection.method,
                                "expires_at": record.expires_at.isoformat() if record.expires_at else None,
                                "rate_per_minute": record.rate_per_minute,
                            },
                        ),
                    )  # fmt: skip
                    if stale is None:
                        return CredentialChange(record, action)
                    return CredentialChange(record, action, stale_vault=stale[0], stale_ref=stale[1])
            except AlreadyExists:  # a concurrent first put of this name won: update its row instead
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _update_row(
        row: Credential, fields: CredentialFields, vault: str, vault_ref: str | None, now: datetime
    ) -> tuple[Literal["rotate", "update"], tuple[str, str] | None]:
        """Apply an update to `row`: the audit action, and the (vault, reference) of a replaced value."""
        if fields.hosts is not None:
            row.hosts = list(fields.hosts)
        if fields.injection is not None:
            row.method = fields.injection.method
            row.header_name = fields.injection.header_name
            row.header_template = fields.injection.header_template
            row.query_param = fields.injection.query_param
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
        row.updated_at = now
        if vault_ref is None:
            return "update", None
        # The replaced value stays in ITS vault, which need not be the one new values go to.
        stale = (row.vault, row.vault_ref) if row.vault_ref != vault_ref else None
        row.vault, row.vault_ref = vault, vault_ref
        row.version += 1
        row.rotated_at = now
        return "rotate", stale

    def get_credential(self, scope_id: str, name: str) -> CredentialRecord | None:
        with self._tx("reading a credential") as session:
            query = select(Credential).where(Credential.scope_id == scope_id, Credential.name == name)
            row = session.scalars(query).one_or_none()
            return _credential(row) if row else None

    def list_credentials(self, org_id: str, project_id: str | None) -> list[CredentialRecord]:
        """The org's credentials and, with `project_id`, that project's and its sandboxes'; without it, every
        credential of the org."""
        query = select(Credential).where(Credential.org_id == org_id)
        if project_id is not None:
            query = query.where(or_(Credential.scope == "org", Credential.project_id == project_id))
        with self._tx("listing credentials") as session:
            rows = session.scalars(query.order_by(Credential.name, Credential.scope, Credential.id))
            return [_credential(row) for row in rows]

    def delete_credential(self, scope_id: str, name: str, *, actor: str) -> CredentialRecord:
        """Delete the credential and log it; the caller then deletes its vault value."""
        now = self.now()
        with self._tx(f"deleting credential {name!r}") as session:
            query = select(Credential).where(Credential.scope_id == scope_id, Credential.name == name)
            row = session.scalars(query.with_for_update()).one_or_none()
            if row is None:
                raise NotFound(f"credential {name!r} not found")
            record = _credential(row)
            session.delete(row)
            self._log(
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
            rows = [_credential(row) for row in session.scalars(query)]
        for name in wanted:
            candidates = {r.scope: r for r in rows if r.name == name and owners[r.scope] == r.scope_id}
            for scope in SCOPE_PRECEDENCE:
                if scope in candidates:
                    found[name] = candidates[scope]
                    break
        return found

    # ---- audit ----------------------------------------------------------------------------------------

    def audit(self, entries: Sequence[AuditEntry], at: datetime | None = None) -> None:
        if not entries:
            return
        now = at or self.now()
        with self._tx("writing the credential audit log") as session:
            for entry in entries:
                self._log(session, now, entry)

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
        limit = max(1, min(limit, MAX_AUDIT_PAGE))
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
            rows = session.scalars(query.order_by(CredentialAudit.id).limit(limit))
            return [_audit(row) for row in rows]

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
            statement = delete(CredentialAudit).where(CredentialAudit.id.in_(expired))
            return int(session.execute(statement).rowcount)  # type: ignore[attr-defined]

    def list_sandbox_audit(self, sandbox_id: str, limit: int = 100) -> list[AuditRecord]:
        with self._tx("reading the credential audit log") as session:
            query = select(CredentialAudit).where(CredentialAudit.sandbox_id == sandbox_id)
            rows = session.scalars(
                query.order_by(CredentialAudit.id).limit(max(1, min(limit, MAX_AUDIT_PAGE)))
            )
            return [_audit(row) for row in rows]

    # ---- the default vault's sealed values -------------------------------------------------------------

    def put_blob(self, reference: str, sealed: bytes) -> None:
        with self._tx("storing a sealed value") as session:
            existing = session.get(VaultSecret, reference)
            if existing is not None:
                raise AlreadyExists("vault reference already used")
            session.add(VaultSecret(reference=reference, sealed=sealed, created_at=self.now()))

    def get_blob(self, reference: str) -> bytes | None:
        with self._tx("reading a sealed value") as session:
            row = session.get(VaultSecret, reference)
            return bytes(row.sealed) if row else None

    def delete_blob(self, reference: str) -> None:
        with self._tx("deleting a sealed value") as session:
            session.execute(delete(VaultSecret).where(VaultSecret.reference == reference))

    def unreferenced_blobs(self, older_than_s: float = 0.0) -> list[str]:
        """Sealed values no credential points at (left by a crash between vault write and row update),
        written more than `older_than_s` ago (younger ones may belong to a put in flight)."""
        cutoff = self.now() - timedelta(seconds=older_than_s)
        with self._tx("finding unreferenced sealed values") as session:
            used = select(Credential.vault_ref).where(Credential.vault == "local")
            query = select(VaultSecret.reference).where(
                VaultSecret.reference.not_in(used), VaultSecret.created_at <= cutoff
            )
            return list(session.scalars(query))

    def credentials_of_deleted_sandboxes(self, limit: int = 500) -> list[CredentialRecord]:
        """Sandbox-scoped credentials whose sandbox is deleted (they can never be used again)."""
        with self._tx("finding credentials of deleted sandboxes") as session:
            query = (
                select(Credential)
                .join(Sandbox, Sandbox.id == Credential.sandbox_id)
                .where(Credential.scope == "sandbox", Sandbox.state == "deleted")
                .limit(limit)
            )
            return [_credential(row) for row in session.scalars(query)]

    # ---- egress policies ------------------------------------------------------------------------------

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
            else:
                if row.project_id != project_id:
                    raise NotFound(f"sandbox {sandbox_id} not found")
                if allow is not None:
                    row.allow = list(allow)
                if deny is not None:
                    row.deny = list(deny)
                if credentials is not None:
                    row.credentials = list(credentials)
                row.version += 1
                row.updated_at = now
            session.flush()
            record = _egress(row)
            if audit is not None:
                detail = {"allow": record.allow, "deny": record.deny, "credentials": record.credentials,
                          "version": record.version}  # fmt: skip
                self._log(session, now, dataclasses.replace(audit, detail={**audit.detail, **detail}))
            for entry in also:
                self._log(session, now, entry)
            return record

    def get_egress(self, sandbox_id: str) -> EgressRecord | None:
        with self._tx("reading an egress policy") as session:
            row = session.get(SandboxEgress, sandbox_id)
            return _egress(row) if row else None

    # ---- private networks an org admin opened for a project (ADR 0026) --------------------------------

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
            self._log(session, now, dataclasses.replace(audit, detail=detail))
            return list(networks)

    # ---- tenant keys (BYOK) ---------------------------------------------------------------------------

    def get_org_key(self, org_id: str) -> OrgKeyRecord | None:
        with self._tx("reading an org key") as session:
            row = session.get(OrgKey, org_id)
            return _org_key(row) if row else None

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
            return self._org_key_changed(session, now, row, audit)

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
            return self._org_key_changed(session, now, row, audit)

    def _org_key_changed(
        self, session: Session, now: datetime, row: OrgKey, audit: AuditEntry | None
    ) -> OrgKeyRecord:
        session.flush()
        record = _org_key(row)
        if audit is not None:
            detail = {**audit.detail, "service": record.service, "key_id": record.key_id}
            self._log(session, now, dataclasses.replace(audit, detail=detail))
        return record


def egress_view(record: EgressRecord | None) -> dict[str, Any]:
    if record is None:
        return {"allow": [], "deny": [], "credentials": [], "version": 0}
    return {
        "allow": record.allow,
        "deny": record.deny,
        "credentials": record.credentials,
        "version": record.version,
        "updated_at": record.updated_at.isoformat(),
    }


def credential_view(record: CredentialRecord, now: datetime) -> Mapping[str, Any]:
    """What tenants see of a credential: everything but the value (and the vault reference)."""
    return {
        "id": record.id,
        "name": record.name,
        "scope": record.scope,
        "project_id": record.project_id,
        "sandbox_id": record.sandbox_id,
        "hosts": record.hosts,
        "method": record.injection.method,
        "header": (
            f"{record.injection.header_name}: {record.injection.header_template}"
            if record.injection.header_name
            else None
        ),
        "query_param": record.injection.query_param,
        "env_var": record.env_var,
        "placeholder": record.placeholder,
        "version": record.version,
        "expires_at": record.expires_at.isoformat() if record.expires_at else None,
        "expired": record.expired(now),
        "rate_per_minute": record.rate_per_minute,
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
        "rotated_at": record.rotated_at.isoformat(),
    }
