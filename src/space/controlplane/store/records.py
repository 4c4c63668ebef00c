"""What the store hands out: frozen, detached snapshots of rows.

Invariants:
- A record is a value read inside one committed transaction; changing the database goes through Store
  methods only (there is no "save" on a record), so nobody mutates a detached ORM object and expects it
  to be persisted.
- Sandbox states are `space.core.lifecycle.State` values, limits are `SandboxLimits`; a row that does not
  parse is a bug and fails loudly on read rather than reaching the API.
- No record carries a secret: API keys and node tokens expose only their hash/prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from space.core.isolation import Isolation
from space.core.lifecycle import State
from space.core.sandbox_options import OnTimeout
from space.core.settings import SandboxLimits

Role = Literal["admin", "member", "read-only"]
NodeStatus = Literal["ready", "lost", "draining", "offline"]
SnapshotKind = Literal["disk", "full"]
SnapshotState = Literal["creating", "ready", "deleting"]
TemplateStatusName = Literal["building", "ready", "failed", "deleting"]  # space.core.template_states
#: How a node made a sandbox on a create request (migration 0009): a pooled sandbox bound to it, a restore
#: of the template's warm checkpoint, or a boot.
CreatedFrom = Literal["pool", "warm", "cold"]


@dataclass(frozen=True, slots=True)
class OrgRecord:
    id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ProjectRecord:
    id: str
    org_id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: str
    project_id: str | None  # None: an org-level key
    org_id: str
    role: Role
    prefix: str  # the first characters of the secret, for display ("space_ab12…")
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


#: The key of a node row's runtime column under which its heartbeat keeps the SPACE release it runs (ADR
#: 0079): no schema change, and the mapper takes it out of the record's runtime descriptor again.
RELEASE_KEY: Final = "space_version"


@dataclass(frozen=True, slots=True)
class NodeRecord:
    id: str
    url: str
    capacity: dict[str, Any]  # {"cpus": float, "memory_mb": int, "sandboxes": int}
    used: dict[str, Any]
    templates: list[str]
    labels: dict[str, str]
    status: NodeStatus
    last_heartbeat_at: datetime
    registered_at: datetime
    runtime: dict[str, Any] | None = None  # what this node can restore (None: not reported)
    pools: dict[str, int] | None = None  # ready pooled sandboxes per template (None: not reported)
    space_version: str | None = None  # the SPACE release its agent reports (ADR 0079; None: not reported)


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    id: str
    project_id: str
    template: str
    env: dict[str, str]
    limits: SandboxLimits
    state: State
    desired_state: State
    generation: int
    node_id: str | None
    forked_from: str | None
    fork_snapshot_id: str | None
    idle_timeout_s: int | None
    ttl_s: int | None
    expires_at: datetime | None
    last_activity_at: datetime
    error: str | None
    error_permanent: bool
    attempts: int
    next_attempt_at: datetime
    lease_owner: str | None
    lease_until: datetime | None
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None
    # Issue 4: snapshot policy, suspend bookkeeping, crash recovery facts, tenant key.
    snapshot_policy: dict[str, Any] | None = None
    suspended_snapshot_id: str | None = None
    suspended_prefix: str | None = None
    recovered_at: datetime | None = None
    recovered_from: str | None = None
    crash_count: int = 0
    notice: str | None = None
    data_key_id: str | None = None
    # The typed code (space.core.errors) of the failure in `error`, so callers decide on the code, never
    # on the text.
    error_code: str | None = None
    incarnation: int | None = None  # the generation at which the copy on node_id was made
    created_from: CreatedFrom | None = None  # how the node made it (None: not by a create request)
    # Issue 13 (ADR 0048): the user's labels, and what the deadline (expires_at) does.
    metadata: dict[str, str] = field(default_factory=dict)
    on_timeout: OnTimeout = "delete"
    # Issue 15 (ADR 0076): gVisor or a QEMU microVM; fixed at create, and what placement matches nodes on.
    isolation: Isolation = "gvisor"


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    id: str
    sandbox_id: str
    kind: SnapshotKind
    state: SnapshotState
    node_id: str | None
    size_bytes: int | None
    created_at: datetime
    prefix: str | None = None  # object-storage prefix of its uploaded copy (None: not uploaded)
    uploaded_at: datetime | None = None
    exclusive_bytes: int | None = None
    restorable: bool = False  # the uploaded copy's manifest was read back: restore/recovery may use it
    data_key_id: str | None = None
    wrapped_key: str | None = None  # base64 of the wrapped data key of the uploaded copy
    error: str | None = None
    origin: str | None = None  # "user" | "policy" | "suspend"
    runtime: dict[str, Any] | None = None  # what restoring this full checkpoint needs (None: unknown)
    name: str | None = None  # a user's name for a full snapshot (migration 0011; E2B's named snapshots)

    @property
    def locations(self) -> list[str]:
        """Where the snapshot's data is: "node:<id>" while a node holds it, "objectstore" once uploaded."""
        where = [f"node:{self.node_id}"] if self.node_id else []
        if self.restorable and self.prefix:
            where.append("objectstore")
        return where


@dataclass(frozen=True, slots=True)
class IdempotencyRecordView:
    scope: str
    key: str
    request_hash: str
    status_code: int | None  # None while the first request is still in progress
    response_body: Any
    created_at: datetime


@dataclass(frozen=True, slots=True)
class IdempotentBegin:
    """The answer of Store.begin_idempotent.

    - outcome "new": this caller owns the key; do the work, then finish_idempotent (or abandon_idempotent).
    - outcome "replay": the work was done; answer `status_code` and `body` again.
    - outcome "in_progress": another request with this key is running; answer 409 (retry later).
    """

    outcome: Literal["new", "replay", "in_progress"]
    record: IdempotencyRecordView
    status_code: int | None = None
    body: Any = None


@dataclass(frozen=True, slots=True)
class TemplateRecord:
    """A project's template (migration 0011). `project_id` None: a built-in, synthesised (no row)."""

    id: str  # tpl_<hex>; a built-in's id is its name
    project_id: str | None
    name: str
    node_name: str  # what sandboxes, node RPCs and subvolumes use
    status: TemplateStatusName
    spec: dict[str, Any]
    source: str
    node_id: str | None
    size_bytes: int | None
    default_user: str | None
    workdir: str | None
    error: str | None
    lease_owner: str | None
    lease_until: datetime | None
    log_bytes: int
    log_truncated: bool
    created_at: datetime | None
    updated_at: datetime | None

    @property
    def builtin(self) -> bool:
        return self.project_id is None


@dataclass(frozen=True, slots=True)
class TemplateLogLine:
    id: int  # increasing: a follower asks for the lines after the last one it saw
    at: datetime
    line: str
