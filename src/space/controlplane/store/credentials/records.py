"""What the credential side of the store hands out and takes: frozen records and change descriptions.

Invariants:
- No record carries a credential's value: a credential names an opaque vault reference only.
- A credential is identified by (scope_id, name), scope_id being the org, project or sandbox it belongs
  to (`scope_id_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from space.controlplane.credentials.spec import Injection, Scope
from space.core.errors import InvalidArgument

KeyService = Literal["local", "kms"]
KeyState = Literal["active", "revoked"]


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
class CredentialUsage:
    """What the gateways reported of one credential, from the audit entries still kept (ADR 0025's
    retention): values injected into requests and requests refused, each with its newest time."""

    injected: int = 0
    last_used_at: datetime | None = None
    refused: int = 0
    last_refused_at: datetime | None = None


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


def scope_id_of(scope: Scope, org_id: str, project_id: str | None, sandbox_id: str | None) -> str:
    owner = {"org": org_id, "project": project_id, "sandbox": sandbox_id}[scope]
    if owner is None:
        raise InvalidArgument(f"a {scope}-scoped credential needs its {scope} id", field="scope")
    return owner
