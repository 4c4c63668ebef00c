"""The control plane's tables (SQLAlchemy 2 typed declarative).

Invariants:
- These models and migrations/versions/* describe the same schema; tests/store/test_store.py runs
  Alembic's autogenerate comparison against a migrated database and requires an empty diff. Change both
  together: a model edit without a new migration fails that test.
- Ids are the prefixed random ids of space.core.ids, stored as text. Every timestamp is aware UTC
  (UTCDateTime). The secret of an API key or node token is never stored, only its SHA-256 hex digest.
- `sandboxes.generation` changes exactly when `state` changes (Store.transition), so (id, state,
  generation) identifies one version of a sandbox's lifecycle for compare-and-swap.
- Rows are never hard-deleted except snapshots and idempotency records: a deleted sandbox stays as a
  tombstone (state 'deleted', deleted_at set) so ids are never reused and late reports can be refused.
- `forked_from` and `fork_snapshot_id` carry no foreign key on purpose: the source sandbox may become a
  tombstone and its snapshot may be purged while the child lives on.
- Objects of these classes never leave the store package; callers get the frozen records of
  space.controlplane.store.records, so nobody mistakes a detached ORM object for a live row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import BigInteger, LargeBinary

from space.controlplane.store.types import UTCDateTime

# Deterministic constraint names: Alembic needs them to alter or drop constraints later (and SQLite's
# batch mode rebuilds tables by name).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 40  # the longest prefix ("snap-") + 26 characters, with room to spare
STATE_LENGTH = 32
ERROR_CODE_LENGTH = 64  # a space.core.errors code (snake_case, short)

ROLES = ("admin", "member", "read-only")
NODE_STATUSES = ("ready", "lost", "draining", "offline")
EVENT_KIND_LENGTH = 32
SNAPSHOT_KINDS = ("disk", "full")
SNAPSHOT_STATES = ("creating", "ready", "deleting")
ON_TIMEOUT = ("delete", "pause")  # space.core.sandbox_options.ON_TIMEOUT
ISOLATIONS = ("gvisor", "microvm")  # space.core.isolation.ISOLATIONS


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Org(Base):
    __tablename__ = "orgs"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"))
    name: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_one_of("role", ROLES), name="role"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    # NULL: an org-level key (the org admin key `space up` prints).
    project_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"), index=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    # authenticate() looks keys up by this digest, hence the unique index.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(_one_of("status", NODE_STATUSES), name="status"),
        # mark_lost and list_nodes filter on status, then on heartbeat age.
        Index("ix_nodes_status_last_heartbeat_at", "status", "last_heartbeat_at"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    url: Mapped[str] = mapped_column(String(512), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    # SHA-256 of the per-node secret issued at registration (ADR 0019); NULL: must register again.
    identity_hash: Mapped[str | None] = mapped_column(String(64))
    # The node's own RPC token, AES-GCM sealed by the control plane (space.controlplane.nodes, ADR 0021):
    # the control plane must present it, so it cannot be a digest. NULL: the node must register again.
    rpc_token_sealed: Mapped[bytes | None] = mapped_column(LargeBinary)
    capacity: Mapped[dict[str, Any]] = mapped_column(JSON)
    used: Mapped[dict[str, Any]] = mapped_column(JSON)
    templates: Mapped[list[str]] = mapped_column(JSON)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Issue 11 (migration 0008): what this node's runtime can restore (gVisor platform, network mode,
    # runtime version, ...); NULL until the node reports it.
    runtime: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Issue 12 (migration 0009): the node's warm pools as last reported, {template: ready count}.
    pools: Mapped[dict[str, int] | None] = mapped_column(JSON)


class EnrolmentToken(Base):
    """A token that enrols new nodes (ADR 0021): only its SHA-256 is kept; each enrolment uses one of
    `max_uses`, atomically, and an expired or used-up token enrols nothing."""

    __tablename__ = "enrolment_tokens"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    max_uses: Mapped[int] = mapped_column(Integer)
    uses: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Sandbox(Base):
    __tablename__ = "sandboxes"
    __table_args__ = (
        # Listings: one project's sandboxes in creation order, ties by id (sandbox_listing.py: the order and
        # the page tokens' position; migration 0010 added `id`, so no sort is left to do).
        Index("ix_sandboxes_project_id_created_at_id", "project_id", "created_at", "id"),
        # claim_work: rows whose retry time has come, oldest first; the state filter narrows further.
        Index("ix_sandboxes_next_attempt_at", "next_attempt_at"),
        Index("ix_sandboxes_state", "state"),
        # TTL sweep and per-node listings (node lost -> its sandboxes).
        Index("ix_sandboxes_expires_at", "expires_at"),
        Index("ix_sandboxes_node_id", "node_id"),
        CheckConstraint(_one_of("on_timeout", ON_TIMEOUT), name="on_timeout"),
        CheckConstraint(_one_of("isolation", ISOLATIONS), name="isolation"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"))
    template: Mapped[str] = mapped_column(String(64))
    env: Mapped[dict[str, str]] = mapped_column(JSON)
    limits: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(STATE_LENGTH))
    desired_state: Mapped[str] = mapped_column(String(STATE_LENGTH))
    generation: Mapped[int] = mapped_column(BigInteger)
    node_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("nodes.id"))
    forked_from: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    fork_snapshot_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    idle_timeout_s: Mapped[int | None] = mapped_column(Integer)
    ttl_s: Mapped[int | None] = mapped_column(Integer)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_activity_at: Mapped[datetime] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(String(ERROR_CODE_LENGTH))
    error_permanent: Mapped[bool] = mapped_column(Boolean)
    attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime())
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Issue 4 (migration 0002). The policy the snapshot scheduler applies (None: no scheduled snapshots).
    # none_as_null: "no policy" is SQL NULL, so the scheduler's `IS NOT NULL` finds only real policies.
    snapshot_policy: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Chosen and recorded BEFORE the node is asked to suspend, so a restarted control plane resumes the
    # same upload instead of starting a second one; kept while suspended (it is what restore reads).
    suspended_snapshot_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    suspended_prefix: Mapped[str | None] = mapped_column(String(512))
    # Crash recovery, shown to users: when and from which snapshot the sandbox was last recovered.
    recovered_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    recovered_from: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    crash_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    notice: Mapped[str | None] = mapped_column(Text)
    # The tenant key (KeyService key id) that wraps this sandbox's data keys.
    data_key_id: Mapped[str | None] = mapped_column(String(256))
    # Issue 11 (migration 0008): the generation at which the copy on `node_id` was made (created,
    # restored, recovered, forked): node deletes and orphan collection name it, so a stale request never
    # removes a newer copy. NULL: no copy on a node.
    incarnation: Mapped[int | None] = mapped_column(BigInteger)
    # Issue 12 (migration 0009): how the node made it: 'pool', 'warm' or 'cold' (NULL: not created by a
    # create request, or before 0009).
    created_from: Mapped[str | None] = mapped_column(String(8))
    # Issue 13 (migration 0010, ADR 0048). The user's labels, {key: value} (space.core.sandbox_options has
    # the bounds); list filters match them in SQL. The attribute is `metadata_` because declarative
    # classes reserve `metadata`; the column and the record field are `metadata`.
    metadata_: Mapped[dict[str, str]] = mapped_column("metadata", JSON, server_default=text("'{}'"))
    # What the deadline (expires_at) does: 'delete' the sandbox, or 'pause' it (kept suspended, or
    # paused where there is no object storage) and clear the deadline until it runs again.
    on_timeout: Mapped[str] = mapped_column(String(8), server_default=text("'delete'"))
    # Issue 15 (migration 0013, ADR 0076): 'gvisor' or 'microvm', fixed at create (forks and sandboxes
    # from its snapshots keep it); placement sends it only to nodes whose driver provides it.
    isolation: Mapped[str] = mapped_column(String(8), server_default=text("'gvisor'"))


class Snapshot(Base):
    __tablename__ = "snapshots"
    __table_args__ = (
        CheckConstraint(_one_of("kind", SNAPSHOT_KINDS), name="kind"),
        CheckConstraint(_one_of("state", SNAPSHOT_STATES), name="state"),
        Index("ix_snapshots_sandbox_id_created_at", "sandbox_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    sandbox_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("sandboxes.id"))
    kind: Mapped[str] = mapped_column(String(8))
    state: Mapped[str] = mapped_column(String(16))
    # NULL when the snapshot lives only in object storage.
    node_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("nodes.id"))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Issue 4 (migration 0002). Object-storage copy: its prefix and when its manifest was read back.
    prefix: Mapped[str | None] = mapped_column(String(512))
    uploaded_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    exclusive_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # True only once a copy is known complete (manifest read back / node reported it); restore and
    # recovery use nothing else.
    restorable: Mapped[bool] = mapped_column(Boolean, server_default=false())
    # The data key wrapping the uploaded copy: the tenant key id and the wrapped key (base64), so a
    # rotated key still opens old snapshots.
    data_key_id: Mapped[str | None] = mapped_column(String(256))
    wrapped_key: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # Who took it: "user", "policy" (the snapshot scheduler; retention prunes only these), "suspend".
    origin: Mapped[str | None] = mapped_column(String(16))
    # Issue 11 (migration 0008): the runtime a full checkpoint needs to be restored (platform, network
    # mode, runtime version, template version); NULL for disk snapshots and older rows.
    runtime: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Issue 13 (migration 0011): a user's name for a full snapshot (E2B's named snapshots); not unique: the
    # newest ready snapshot of a name in the project is the one it means.
    name: Mapped[str | None] = mapped_column(String(128), index=True)


class IdempotencyRecord(Base):
    __tablename__ = "idempotency_records"
    __table_args__ = (Index("ix_idempotency_records_created_at", "created_at"),)

    # (scope, key) is the primary key, hence unique: the constraint that makes concurrent begins safe.
    scope: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)  # NULL while the request is in progress
    response_body: Mapped[Any | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


# ==== Credentials, egress policies, audit log, tenant keys (issue 5; migration 0003) =====================
# Read and written by the repositories of store/credentials/. Values of credentials are never in these
# tables: only an opaque vault reference; the default vault keeps AES-GCM sealed values in `vault_secrets`.
CREDENTIAL_SCOPES = ("org", "project", "sandbox")
CREDENTIAL_METHODS = ("header", "bearer", "basic", "query", "login")
ORG_KEY_SERVICES = ("local", "kms")
ORG_KEY_STATES = ("active", "revoked")


class Credential(Base):
    __tablename__ = "credentials"
    __table_args__ = (
        CheckConstraint(_one_of("scope", CREDENTIAL_SCOPES), name="scope"),
        CheckConstraint(_one_of("method", CREDENTIAL_METHODS), name="method"),
        # One name per owner: scope_id is the org, project or sandbox id the credential belongs to.
        UniqueConstraint("scope_id", "name"),
        Index("ix_credentials_org_id_name", "org_id", "name"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"))
    project_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"))
    sandbox_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("sandboxes.id"))
    scope: Mapped[str] = mapped_column(String(16))
    scope_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    name: Mapped[str] = mapped_column(String(64))
    hosts: Mapped[list[str]] = mapped_column(JSON)
    method: Mapped[str] = mapped_column(String(16))
    header_name: Mapped[str | None] = mapped_column(String(128))
    header_template: Mapped[str | None] = mapped_column(Text)
    query_param: Mapped[str | None] = mapped_column(String(128))
    # method "login" (migration 0012, ADR 0063): origin, username_field, password_field, form_action
    login: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    env_var: Mapped[str] = mapped_column(String(128))
    placeholder: Mapped[str] = mapped_column(String(128), unique=True)
    vault: Mapped[str] = mapped_column(String(32))
    vault_ref: Mapped[str] = mapped_column(String(512))
    version: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    rate_per_minute: Mapped[int | None] = mapped_column(Integer)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    rotated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class VaultSecret(Base):
    __tablename__ = "vault_secrets"

    reference: Mapped[str] = mapped_column(String(256), primary_key=True)
    sealed: Mapped[bytes] = mapped_column(LargeBinary)  # version || nonce || AES-GCM ciphertext+tag
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CredentialAudit(Base):
    __tablename__ = "credential_audit"
    __table_args__ = (
        Index("ix_credential_audit_org_id_credential_name_id", "org_id", "credential_name", "id"),
        Index("ix_credential_audit_sandbox_id", "sandbox_id"),
    )

    # Autoincrement: the order entries were written in, also between entries of the same instant.
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    project_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    sandbox_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    # No foreign key: the log outlives deleted credentials.
    credential_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    credential_name: Mapped[str | None] = mapped_column(String(64))
    scope: Mapped[str | None] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(128))  # "key:<api key id>" or "node:<node id>"
    host: Mapped[str | None] = mapped_column(String(255))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


class SandboxEgress(Base):
    __tablename__ = "sandbox_egress"

    # No foreign key: written just BEFORE its sandbox row, so the reconciler never sees a sandbox without
    # its policy; a row whose sandbox was never created is harmless (no sandbox, no traffic).
    sandbox_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH), index=True)
    allow: Mapped[list[str]] = mapped_column(JSON)
    deny: Mapped[list[str]] = mapped_column(JSON)
    credentials: Mapped[list[str]] = mapped_column(JSON)  # bound credential names, resolved by scope
    version: Mapped[int] = mapped_column(Integer)  # +1 per change: nodes apply only newer policies
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class OrgKey(Base):
    __tablename__ = "org_keys"
    __table_args__ = (
        CheckConstraint(_one_of("service", ORG_KEY_SERVICES), name="service"),
        CheckConstraint(_one_of("state", ORG_KEY_STATES), name="state"),
    )

    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"), primary_key=True)
    service: Mapped[str] = mapped_column(String(16))
    key_id: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    rotated_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ProjectPrivateNetworks(Base):
    """The private networks an org admin opened for a project's egress allow lists (ADR 0026); no row:
    none (a tenant's allow list can name no private range)."""

    __tablename__ = "project_private_networks"

    project_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"), primary_key=True)
    networks: Mapped[list[str]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_by: Mapped[str] = mapped_column(String(128))


class LeaderLease(Base):
    """A named lease that at most one control-plane replica holds at a time (issue 11): jobs that must run
    once per cluster (the snapshot scheduler) run only on the holder. Times come from the claimer's clock."""

    __tablename__ = "leader_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SandboxEvent(Base):
    """What happened to a sandbox that its owner should see (issue 11): a node lost, a step re-planned, a
    recovery and its reason. Append-only, like the sandbox rows they belong to."""

    __tablename__ = "sandbox_events"
    __table_args__ = (Index("ix_sandbox_events_sandbox_id_id", "sandbox_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sandbox_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("sandboxes.id"))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(String(EVENT_KIND_LENGTH))
    message: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


# ==== User templates (issue 13; migration 0011; docs/adr/0055-templates-in-the-control-plane.md) ========
TEMPLATE_STATUSES = ("building", "ready", "failed", "deleting")  # space.core.template_states


class Template(Base):
    """A project's template: its build spec, where it was built and its status (space.core.template_states).
    Built-in templates have no row (the store synthesises them). Rows are hard-deleted once the nodes'
    copies are gone, so a name is free again; ids are random and never come back."""

    __tablename__ = "templates"
    __table_args__ = (
        CheckConstraint(_one_of("status", TEMPLATE_STATUSES), name="status"),
        UniqueConstraint("project_id", "name"),
        # The sweep of building rows whose driver's lease passed, and of deleting rows.
        Index("ix_templates_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(64))
    node_name: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The template it was built from, as the user named it ("python", a project template's name, "oci:...").
    source: Mapped[str] = mapped_column(String(512))
    node_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # the node that builds or built it
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    default_user: Mapped[str | None] = mapped_column(String(64))
    workdir: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # The control plane driving the build and until when its claim holds (renewed while the build runs).
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    log_bytes: Mapped[int] = mapped_column(BigInteger)  # what template_logs holds of it now
    log_truncated: Mapped[bool] = mapped_column(Boolean)  # older lines were dropped to keep the bound
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class TemplateLog(Base):
    """A template's build log, one row per line, its newest TEMPLATE_LOG_BYTES kept (store.templates)."""

    __tablename__ = "template_logs"
    __table_args__ = (Index("ix_template_logs_template_id_id", "template_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    template_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("templates.id"))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    line: Mapped[str] = mapped_column(Text)
