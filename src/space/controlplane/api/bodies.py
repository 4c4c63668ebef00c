"""Request bodies of the public API (and of the node-facing audit route), validated before any route runs.

Invariants:
- Every public body forbids unknown fields (a typo is a 422, not a silently ignored setting).
- A credential's value is write-only: it never appears in a repr, a log line or an answer.
- The node-facing audit event is lenient on purpose (best-effort channel): a malformed event is rejected on
  its own by the route instead of failing the whole batch.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from space.controlplane.credentials import spec
from space.core.isolation import Isolation
from space.core.retention import SnapshotPolicy
from space.core.sandbox_options import MAX_TIMEOUT_S, OnTimeout
from space.core.settings import SandboxLimits

#: Most events one node audit batch may carry.
MAX_NODE_AUDIT_EVENTS = 1000

Scope = Literal["org", "project", "sandbox"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- sandboxes and snapshots ---------------------------------------------------------------------------------
class EgressSpec(_Body):
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    credentials: list[str] = Field(default_factory=list)


#: A snapshot's name: at most 128 characters, no path or tag separators (and never an id's `snap-` shape:
#: checked by api/snapshots.take_snapshot, as pydantic's patterns have no look-ahead).
SNAPSHOT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


class CreateSandbox(_Body):
    template: str = "python"
    env: dict[str, str] = Field(default_factory=dict)
    limits: SandboxLimits | None = None
    idle_timeout_s: int | None = Field(default=None, gt=0)
    ttl_s: int | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    wait: bool = True
    allow: list[str] = Field(default_factory=list)
    credentials: list[str] = Field(default_factory=list)
    egress: EgressSpec | None = None  # issue 5: {"allow", "deny", "credentials"}; merged with the two above
    snapshot_policy: SnapshotPolicy | None = None  # issue 4: scheduled snapshots + retention
    # Issue 13 (ADR 0048): labels to filter lists by (bounds: space.core.sandbox_options, checked by the
    # store: 400 naming `metadata`), and what the deadline (ttl_s, or a timeout set later) does.
    metadata: dict[str, str] = Field(default_factory=dict)
    on_timeout: OnTimeout = "delete"
    # Issue 15 (ADR 0076): gVisor (the default) or a QEMU microVM; placed only on nodes that run it. Strict
    # names: "microvm\n", "MICROVM" or a driver's name ("qemu") are 422s.
    isolation: Isolation = "gvisor"
    # A full snapshot's id or name: the sandbox starts from that checkpoint (api/snapshot_sandboxes.py).
    from_snapshot: str | None = Field(default=None, min_length=1, max_length=128)


class TimeoutBody(_Body):
    """The sandbox's deadline becomes now + timeout_s (0: now); with extend_only it only moves later."""

    timeout_s: int = Field(ge=0, le=MAX_TIMEOUT_S, strict=True)  # "5", 5.0 or true are no number of seconds
    extend_only: bool = False


class PatchSandbox(_Body):
    # Explicit null removes the policy; an absent field leaves it as it is.
    snapshot_policy: SnapshotPolicy | None = None


class ForkBody(_Body):
    count: int = Field(default=1, ge=1, le=100)
    # The children's own; None: their source's (the store checks the bounds, as at create).
    metadata: dict[str, str] | None = None
    on_timeout: OnTimeout | None = None


class RollbackBody(_Body):
    snapshot_id: str


class SnapshotBody(_Body):
    full: bool = False
    # A name for a full snapshot: `from_snapshot` and E2B's templateID accept it (api/snapshot_sandboxes.py).
    name: str | None = Field(default=None, pattern=SNAPSHOT_NAME_PATTERN)


class PtyParameters(_Body):
    """The PTY's query string (a WebSocket route: validated by the route, not by FastAPI)."""

    rows: int = Field(default=24, ge=1, le=1000)
    cols: int = Field(default=80, ge=1, le=1000)
    cmd: str = Field(default="/bin/bash", min_length=1, max_length=4096)


# -- projects and keys ---------------------------------------------------------------------------------------
class ProjectBody(_Body):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class KeyBody(_Body):
    project: str
    role: Literal["admin", "member", "read-only"] = "member"
    # "e2b": the secret in E2B's shape (`e2b_` + hex) for E2B SDKs that check it; otherwise the same key.
    shape: Literal["space", "e2b"] = "space"


# -- credentials, egress, private networks, tenant keys ------------------------------------------------------
class LoginFormBody(_Body):
    origin: str = Field(max_length=300)
    username_field: str = Field(max_length=128)
    password_field: str = Field(max_length=128)
    form_action: str | None = Field(default=None, max_length=1024)


class PutCredential(_Body):
    value: str | None = Field(default=None, max_length=64 << 10, repr=False)  # write-only: never in a repr
    # method "login" (ADR 0063): write-only like value, both given at create and at each rotation
    username: str | None = Field(default=None, max_length=4096, repr=False)
    password: str | None = Field(default=None, max_length=4096, repr=False)
    login: LoginFormBody | None = None
    hosts: list[str] | None = None
    method: Literal["header", "bearer", "basic", "query", "login"] | None = None
    header: str | None = Field(default=None, max_length=4096)
    query_param: str | None = None
    env_var: str | None = None
    scope: Scope = "project"
    sandbox_id: str | None = None
    project: str | None = None
    expires_at: datetime | None = None
    rate_per_minute: int | None = None


class EgressBody(_Body):
    allow: list[str] | None = None
    deny: list[str] | None = None
    credentials: list[str] | None = None


class PrivateNetworksBody(_Body):
    allowed_private_networks: list[str] = Field(max_length=spec.MAX_PRIVATE_NETWORKS)


class OrgKeyBody(_Body):
    service: Literal["local", "kms"] = "local"
    key_id: str | None = Field(default=None, min_length=1, max_length=256)


# -- node-facing ---------------------------------------------------------------------------------------------
class NodeAuditEvent(BaseModel):
    """One gateway record. Lenient on purpose (best-effort channel): a malformed event is counted as
    rejected on its own instead of failing the whole batch, and long hosts are cut, not refused."""

    model_config = ConfigDict(extra="ignore")

    sandbox_id: str | None = None
    action: str = ""
    credential: str | None = None
    host: str | None = None
    at: float | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class NodeAuditBody(BaseModel):
    events: list[NodeAuditEvent] = Field(max_length=MAX_NODE_AUDIT_EVENTS)
