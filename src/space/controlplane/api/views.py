"""Response bodies of the public API: one model per answer, and the functions that build them from records.

Invariants:
- Each model lists exactly the fields its view function emits, in the same order: the routes answer
  through these models, so a field missing here would silently vanish from the answer (tests/controlplane
  check the fields the SDK reads; test_controlplane_openapi checks every public answer is typed).
- Times are ISO 8601 strings as `datetime.isoformat()` writes them (never re-encoded by pydantic).
- No answer to an API key carries a credential value or vault reference.
- Data-plane answers are relayed from the node as they are: their models (here or in
  space.node.agent.rpc_models) document them, the gateway does not re-validate them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from space.controlplane.store.credentials import AuditRecord, OrgKeyRecord
from space.controlplane.store.records import ProjectRecord, SandboxRecord, SnapshotRecord
from space.core.lifecycle import State
from space.core.settings import SandboxLimits


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


# -- sandboxes and snapshots ---------------------------------------------------------------------------------
class Sandbox(_View):
    id: str
    project_id: str
    template: str
    state: str
    desired_state: str
    generation: int
    node_id: str | None
    env: dict[str, str]
    limits: SandboxLimits
    idle_timeout_s: int | None
    ttl_s: int | None
    created_at: str
    updated_at: str
    last_activity_at: str
    error: str | None
    error_code: str | None = Field(description="The typed code of `error` (see the error table).")
    forked_from: str | None
    fork_snapshot_id: str | None = Field(
        default=None, description="The snapshot of `forked_from` it started from (a fork, or from_snapshot)."
    )
    notice: str | None = Field(description="What happened to the sandbox that its user should know.")
    crash_count: int
    recovered_at: str | None
    recovered_from: str | None
    suspended_snapshot_id: str | None = Field(description="Set while the sandbox is suspended.")
    snapshot_policy: dict[str, Any] | None = Field(description="The SnapshotPolicy as given (ADR 0014).")
    created_from: Literal["pool", "warm", "cold"] | None = Field(
        default=None,
        description="How its node made it: 'pool' (a ready pooled sandbox was bound to it), 'warm' (restored "
        "from its template's warm checkpoint: no pooled one was ready) or 'cold' (booted); null for a fork, "
        "or while it is being created.",
    )
    metadata: dict[str, str] = Field(description="The labels given at create (a fork's: its source's).")
    expires_at: str | None = Field(
        description="The deadline: what on_timeout says happens then (null: none)."
    )
    on_timeout: Literal["delete", "pause"] = Field(
        description="'delete' the sandbox at its deadline, or 'pause' it: kept suspended (paused where "
        "there is no object storage) with no deadline until it comes back."
    )
    isolation: Literal["gvisor", "microvm"] = Field(
        description="'gvisor' (gVisor's application kernel) or 'microvm' (a QEMU microVM on its own Linux "
        "kernel); fixed at create: forks and sandboxes from its snapshots keep it (ADR 0076)."
    )


class Sandboxes(_View):
    sandboxes: list[Sandbox]
    next_page_token: str | None = Field(
        default=None, description="Present only when another page follows: pass it as page_token."
    )


def sandbox_view(sb: SandboxRecord) -> dict[str, Any]:
    return {
        "id": sb.id,
        "project_id": sb.project_id,
        "template": sb.template,
        "state": sb.state.value,
        "desired_state": sb.desired_state.value,
        "generation": sb.generation,
        "node_id": sb.node_id,
        "env": sb.env,
        "limits": sb.limits.model_dump(),
        "idle_timeout_s": sb.idle_timeout_s,
        "ttl_s": sb.ttl_s,
        "created_at": sb.created_at.isoformat(),
        "updated_at": sb.updated_at.isoformat(),
        "last_activity_at": sb.last_activity_at.isoformat(),
        "error": sb.error,
        "error_code": sb.error_code,
        "forked_from": sb.forked_from,
        "fork_snapshot_id": sb.fork_snapshot_id,
        # Issue 4: what happened to the sandbox that the user should be able to see.
        "notice": sb.notice,
        "crash_count": sb.crash_count,
        "recovered_at": _iso(sb.recovered_at),
        "recovered_from": sb.recovered_from,
        "suspended_snapshot_id": sb.suspended_snapshot_id if sb.state == State.SUSPENDED else None,
        "snapshot_policy": sb.snapshot_policy,
        "created_from": sb.created_from,
        "metadata": sb.metadata,
        "expires_at": _iso(sb.expires_at),
        "on_timeout": sb.on_timeout,
        "isolation": sb.isolation,
    }


class Snapshot(_View):
    id: str
    sandbox_id: str
    kind: str
    state: str
    created_at: str
    size_bytes: int | None
    exclusive_bytes: int | None = Field(description="What the snapshot alone pins on its node's disk.")
    location: str = Field(description='"node", "objectstore" or "none" (kept for older clients).')
    locations: list[str] = Field(description="Every place a copy is.")
    node_id: str | None
    restorable: bool
    uploaded_at: str | None
    origin: str | None
    error: str | None
    name: str | None = Field(default=None, description="The name it was given (full snapshots only).")


class Snapshots(_View):
    snapshots: list[Snapshot]


def snapshot_view(snap: SnapshotRecord, exclusive_bytes: int | None = None) -> dict[str, Any]:
    locations = snap.locations
    return {
        "id": snap.id,
        "sandbox_id": snap.sandbox_id,
        "kind": snap.kind,
        "state": snap.state,
        "created_at": snap.created_at.isoformat(),
        "size_bytes": snap.size_bytes,
        "exclusive_bytes": exclusive_bytes if exclusive_bytes is not None else snap.exclusive_bytes,
        # "location" (one word, kept for older clients) and "locations" (every place a copy is).
        "location": "node" if snap.node_id else ("objectstore" if locations else "none"),
        "locations": locations,
        "node_id": snap.node_id,
        "restorable": snap.restorable,
        "uploaded_at": _iso(snap.uploaded_at),
        "origin": snap.origin,
        "error": snap.error,
        "name": snap.name,
    }


# -- projects and keys ---------------------------------------------------------------------------------------
class Project(_View):
    id: str
    name: str
    org_id: str


class Projects(_View):
    projects: list[Project]


def project_view(project: ProjectRecord) -> dict[str, Any]:
    return {"id": project.id, "name": project.name, "org_id": project.org_id}


class CreatedKey(_View):
    id: str
    key: str = Field(description="The secret: shown only in this answer.")
    project_id: str
    role: str


# -- credentials, egress, private networks, tenant keys ------------------------------------------------------
class Credential(_View):
    """A credential as tenants see it: everything but the value (and the vault reference)."""

    id: str
    name: str
    scope: str
    project_id: str | None
    sandbox_id: str | None
    hosts: list[str]
    method: str
    header: str | None
    query_param: str | None
    login: dict[str, str | None] | None = Field(
        default=None, description="method 'login': origin, username_field, password_field, form_action"
    )
    env_var: str
    placeholder: str
    username_placeholder: str | None = Field(
        default=None, description="method 'login': the username's placeholder (placeholder is the password's)"
    )
    version: int
    expires_at: str | None
    expired: bool
    rate_per_minute: int | None
    created_at: str
    updated_at: str
    rotated_at: str


class LoginPlaceholders(_View):
    """What an agent types into a login form: placeholders the egress gateway replaces (ADR 0063)."""

    credential: str
    origin: str
    form_action: str | None
    fields: dict[str, str] = Field(description="form field name -> the placeholder to type into it")


class CredentialChange(Credential):
    action: str = Field(description="create, rotate (a new value) or update.")


class CredentialUsage(_View):
    """What the gateways reported of a credential within the audit log's retention (never a value)."""

    injected: int = Field(description="requests a gateway put its value into")
    last_used_at: str | None
    refused: int = Field(description="requests carrying its placeholder that a gateway refused")
    last_refused_at: str | None


class ListedCredential(Credential):
    usage: CredentialUsage


class Credentials(_View):
    credentials: list[ListedCredential]


class CredentialDeleted(_View):
    deleted: bool
    name: str
    scope: str
    id: str


class AuditEvent(_View):
    id: int
    at: str
    action: str
    actor: str
    credential: str | None
    credential_id: str | None
    scope: str | None
    project_id: str | None
    sandbox_id: str | None
    host: str | None
    detail: dict[str, Any]


class AuditLog(_View):
    entries: list[AuditEvent]


def audit_view(entry: AuditRecord) -> dict[str, Any]:
    return {
        "id": entry.id,
        "at": entry.at.isoformat(),
        "action": entry.action,
        "actor": entry.actor,
        "credential": entry.credential_name,
        "credential_id": entry.credential_id,
        "scope": entry.scope,
        "project_id": entry.project_id,
        "sandbox_id": entry.sandbox_id,
        "host": entry.host,
        "detail": entry.detail,
    }


class EgressPolicy(_View):
    """A sandbox's egress policy and bound credentials (no values)."""

    allow: list[str]
    deny: list[str]
    credentials: list[str]
    version: int
    updated_at: str | None = Field(default=None, description="Absent while no policy was ever set.")
    sandbox_id: str


class EgressPolicyApplied(EgressPolicy):
    applied: bool = Field(description="Whether the sandbox's node took the new policy now.")
    node_error: str | None


class PrivateNetworks(_View):
    project_id: str
    allowed_private_networks: list[str]


class OrgKey(_View):
    service: str
    key_id: str
    state: str
    created_at: str
    rotated_at: str | None
    revoked_at: str | None


def key_view(record: OrgKeyRecord) -> dict[str, Any]:
    return {
        "service": record.service,
        "key_id": record.key_id,
        "state": record.state,
        "created_at": record.created_at.isoformat(),
        "rotated_at": _iso(record.rotated_at),
        "revoked_at": _iso(record.revoked_at),
    }


# -- data plane (relayed from the node) ----------------------------------------------------------------------
class Empty(_View):
    """`{}`: the operation was done."""
