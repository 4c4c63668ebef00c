"""Request and response models of the node RPC (control plane / gateway -> node agent).

Invariants:
- Request models reject unknown fields and take numbers strictly, like space.core.settings: a typo in a
  reconciler's body is a 422 naming the field, never a silently ignored key.
- Data-plane shapes are those of the public data plane in docs/api.md, so the gateway can relay bodies
  without translating them; fields the daemon adds (stat entries, process entries) pass through as dicts.
- Times are Unix seconds (float) on this API; the control plane formats them for its own clients.
- These models are shared by the server (space.node.agent.routes) and the client (space.node.rpc_client),
  so both sides agree on the wire format by construction.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from space.core.ids import SANDBOX_ID_PATTERN, SNAPSHOT_ID_PATTERN, TEMPLATE_NAME_PATTERN
from space.core.settings import SandboxLimits
from space.protocol.commands import ONE_COMMAND, command_params

#: The path every node RPC route lives under.
API_PREFIX = "/node/v1"

_REQUEST = ConfigDict(extra="forbid")
# Answers may grow fields; an older client must keep working against a newer node.
_ANSWER = ConfigDict(extra="allow")

LifecycleAction = Literal["pause", "resume", "stop", "start"]
SnapshotKind = Literal["disk", "full"]


# -- lifecycle -------------------------------------------------------------------------------------------
class EgressBody(BaseModel):
    """A sandbox's egress policy as the node receives it (issue 5): domains/CIDRs, the names of bound
    credentials (their values the node fetches itself), and the control plane's version of it."""

    model_config = _REQUEST

    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    credentials: list[str] = Field(default_factory=list)
    version: int = Field(default=0, ge=0)


class CreateSandboxRequest(BaseModel):
    model_config = _REQUEST

    template: str = Field(default="python", pattern=f"^{TEMPLATE_NAME_PATTERN}$")
    env: dict[str, str] = Field(default_factory=dict)
    limits: SandboxLimits | None = None
    #: None: the node asks the control plane (if any) when the sandbox comes up; no policy = no egress.
    egress: EgressBody | None = None
    #: The control plane's generation at which this copy is placed (ADR 0032); None: not recorded.
    incarnation: int | None = Field(default=None, ge=0, le=2**63 - 1, strict=True)


class IncarnationBody(BaseModel):
    """The incarnation of the copy about to be placed on the node (before a restore or a fork, ADR 0032)."""

    model_config = _REQUEST

    incarnation: int = Field(ge=0, le=2**63 - 1, strict=True)


class IncarnationHeld(BaseModel):
    """Which incarnation of a sandbox the node holds (None: a copy from before incarnations)."""

    sandbox_id: str
    incarnation: int | None


class SnapshotRequest(BaseModel):
    model_config = _REQUEST

    full: bool = Field(default=False, strict=True)


class RollbackRequest(BaseModel):
    model_config = _REQUEST

    snapshot_id: str = Field(pattern=f"^{SNAPSHOT_ID_PATTERN}$")


class ForkRequest(BaseModel):
    """`child_ids` lets the control plane choose the children's ids, which makes a repeated fork idempotent
    (children that already exist are returned as they are); without it the node picks fresh ids."""

    model_config = _REQUEST

    count: int = Field(default=1, ge=1, le=100, strict=True)
    snapshot_id: str | None = Field(default=None, pattern=f"^{SNAPSHOT_ID_PATTERN}$")
    child_ids: list[str] | None = None

    @field_validator("child_ids")
    @classmethod
    def _valid_ids(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for item in value:
            if re.fullmatch(SANDBOX_ID_PATTERN, item) is None:
                raise ValueError(f"{item!r} is not a sandbox id")
        if len(set(value)) != len(value):
            raise ValueError("child_ids must be distinct")
        return value

    @model_validator(mode="after")
    def _count_matches(self) -> ForkRequest:
        if self.child_ids is not None and len(self.child_ids) != self.count:
            raise ValueError("child_ids must hold exactly `count` ids")
        return self


class SnapshotInfo(BaseModel):
    """`exclusive_bytes`: what the snapshot's disk pins on the node (for a disk snapshot: what the sandbox
    wrote since the previous snapshot); None when the node cannot tell (no quotas, fake driver)."""

    model_config = _ANSWER

    snapshot_id: str
    sandbox_id: str
    kind: SnapshotKind
    created_at: float
    image_bytes: int = 0
    exclusive_bytes: int | None = None


class SnapshotList(BaseModel):
    model_config = _ANSWER

    snapshots: list[SnapshotInfo]


class SandboxObserved(BaseModel):
    """What the node sees of one sandbox, for the reconciler and the heartbeat.

    `state` is the node's lifecycle state; `runtime` what the driver reports (running, paused, stopped,
    created, absent; None when the driver could not be asked); `channel_open` whether the agent holds a
    working channel to the daemon. `last_activity_at` is the newest data-plane request the node served
    for it; `guest` is the daemon's sys.info answer (running sandboxes only, None otherwise).
    """

    model_config = _ANSWER

    id: str
    state: str
    template: str
    limits: SandboxLimits
    created_at: float
    runtime: str | None = None
    exists: bool = True
    channel_open: bool = False
    last_activity_at: float | None = None
    guest: dict[str, Any] | None = None
    snapshots: list[SnapshotInfo] = Field(default_factory=list)
    #: Why a `crashed` sandbox's runtime ended, for people (e.g. its memory limit; ADR 0036); else None.
    crash_reason: str | None = None
    #: How this node made it on a create request: "pool" (a pooled sandbox was bound to it), "warm" (restored
    #: from the template's warm checkpoint on request) or "cold" (booted); None for other sandboxes.
    created_from: Literal["pool", "warm", "cold"] | None = None


class SandboxList(BaseModel):
    """`unmanaged`: ids the driver still holds something for that the agent does not manage (leftovers of
    a step that failed half-way); DELETE /node/v1/sandboxes/{id} removes them."""

    model_config = _ANSWER

    sandboxes: list[SandboxObserved]
    unmanaged: list[str] = Field(default_factory=list)


class DeleteResult(BaseModel):
    model_config = _ANSWER

    id: str
    state: Literal["deleted"] = "deleted"
    existed: bool


class Resources(BaseModel):
    model_config = _ANSWER

    cpus: float
    memory_mb: int
    # Disk (docs/adr/0027-disk-budgets.md): as capacity, the usable size, free space and reserve of the
    # node's filesystem; as used, the sum of its sandboxes' disk_mb. None: the driver cannot tell.
    disk_mb: int | None = None
    disk_free_mb: int | None = None
    disk_reserve_mb: int | None = None


class NodeInfo(BaseModel):
    model_config = _ANSWER

    driver: str
    isolating: bool
    capacity: Resources
    used: Resources
    sandbox_count: int
    templates: list[str]
    time: float
    store_url: str | None = None  # the only object store suspend/restore requests may name on this node
    #: What this node's runtime restores (space.core.runtimes; None: not known yet). ADR 0035.
    runtime: dict[str, str | None] | None = None
    pools: dict[str, int] = Field(default_factory=dict)  # ready pooled sandboxes per template (ADR 0047)
    space_version: str | None = None  # the SPACE release this agent runs (space.core.versions, ADR 0079)


# -- data plane ------------------------------------------------------------------------------------------
class CommandBody(BaseModel):
    """A command in an HTTP body (the gateway's and the node's): the fields of space.protocol.commands."""

    model_config = _REQUEST

    cmd: str | None = None
    argv: list[str] | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | int | None = None
    timeout: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_command(self) -> CommandBody:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError(ONE_COMMAND)
        return self

    @property
    def command(self) -> str | list[str]:
        return self.cmd if self.cmd is not None else list(self.argv or [])

    def params(self) -> dict[str, Any]:
        """This command as spaced receives it (space.protocol.commands)."""
        return command_params(self.command, self.env, self.cwd, self.user, self.timeout)


#: Output a non-streamed exec keeps per stream: the default, and the most a request may ask for (the rest is
#: read and dropped, and the answer's stdout_truncated / stderr_truncated say so).
EXEC_OUTPUT_DEFAULT = 1 << 20
EXEC_OUTPUT_MAX = 16 << 20


class ExecRequest(CommandBody):
    stdin_b64: str | None = None
    stream: bool = False
    max_output_bytes: int = Field(default=EXEC_OUTPUT_DEFAULT, ge=0, le=EXEC_OUTPUT_MAX, strict=True)

    @field_validator("stdin_b64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError("stdin_b64 must be standard base64") from exc
        return value

    @property
    def stdin(self) -> bytes | None:
        return None if self.stdin_b64 is None else base64.b64decode(self.stdin_b64)


class ExecResponse(BaseModel):
    model_config = _ANSWER

    exit_code: int | None
    stdout_b64: str
    stderr_b64: str
    stdout: str
    stderr: str
    process_id: str
    timed_out: bool
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def stdout_bytes(self) -> bytes:
        return base64.b64decode(self.stdout_b64)

    @property
    def stderr_bytes(self) -> bytes:
        return base64.b64decode(self.stderr_b64)


class PtySize(BaseModel):
    model_config = _REQUEST

    rows: int = Field(default=24, ge=1, le=1000, strict=True)
    cols: int = Field(default=80, ge=1, le=1000, strict=True)


class ProcessStartRequest(CommandBody):
    """A background process. `stdin: true` keeps a pipe open for POST …/stdin (a PTY always has one)."""

    tag: str | None = None
    pty: PtySize | None = None
    stdin: bool = False


class ProcessStarted(BaseModel):
    model_config = _ANSWER

    process_id: str
    pid: int | None = None


class ProcessList(BaseModel):
    model_config = _ANSWER

    processes: list[dict[str, Any]]


class SignalRequest(BaseModel):
    model_config = _REQUEST

    signal: str | int = "SIGTERM"


class ResizeRequest(BaseModel):
    model_config = _REQUEST

    rows: int = Field(ge=1, le=1000, strict=True)
    cols: int = Field(ge=1, le=1000, strict=True)


class StdinWritten(BaseModel):
    model_config = _ANSWER

    written: int


class FileWritten(BaseModel):
    model_config = _ANSWER

    size: int


class FileList(BaseModel):
    model_config = _ANSWER

    entries: list[dict[str, Any]]


#: The in-sandbox user a file call creates files as: a name or a uid (ADR 0057); absent: the template's
#: default user (root in `python`).
FILE_USER_PATTERN = r"^(?:[A-Za-z_][A-Za-z0-9._-]{0,63}|[0-9]{1,9})$"


class MkdirRequest(BaseModel):
    model_config = _REQUEST

    path: str = Field(min_length=1)
    parents: bool = True
    mode: int = Field(default=0o755, ge=0, le=0o7777, strict=True)
    user: str | None = Field(default=None, pattern=FILE_USER_PATTERN)


class RenameRequest(BaseModel):
    model_config = _REQUEST

    src: str = Field(min_length=1)
    dst: str = Field(min_length=1)


# -- node -> control plane ---------------------------------------------------------------------------------
class RegisterRequest(BaseModel):
    """POST {control plane}/v1/nodes/register (Authorization: Bearer <cluster bootstrap token>); the answer
    carries the node's id as "node_id" (or "id") and "identity", the per-node secret every later call of this
    node presents (ADR 0019). Registering again (after a restart) is idempotent by url and issues a new
    identity. `token` is the token the control plane must present on this node's RPC."""

    model_config = _ANSWER

    url: str
    token: str
    capacity: Resources
    templates: list[str]
    driver: str
    isolating: bool
    runtime: dict[str, str | None] | None = None  # as in NodeInfo (ADR 0035)
    space_version: str | None = None  # as in NodeInfo (ADR 0079)
    protocol_min: int = 1  # the node protocol versions this node speaks (space.protocol.node_protocol,
    protocol_max: int = 1  # ADR 0071)


class Heartbeat(BaseModel):
    """POST {control plane}/v1/nodes/{node_id}/heartbeat every 2 s (Authorization: Bearer <node identity>);
    a 401/404 answer makes the node register again. `activity` maps sandbox id -> last data-plane activity
    (Unix seconds) for the sandboxes that had any; `sandboxes` is the observed state of each, without the
    daemon's sys.info (polling every daemon every 2 s would count as their activity)."""

    model_config = _ANSWER

    node_id: str
    url: str
    driver: str
    isolating: bool
    capacity: Resources
    used: Resources
    sandbox_count: int
    templates: list[str]
    time: float
    activity: dict[str, float]
    sandboxes: list[SandboxObserved]
    unmanaged: list[str] = Field(default_factory=list)
    runtime: dict[str, str | None] | None = None  # as in NodeInfo (ADR 0035)
    pools: dict[str, int] = Field(default_factory=dict)  # ready pooled per template (issue 12)
    space_version: str | None = None  # as in NodeInfo (ADR 0079)


# -- suspend / restore / recover (object storage) -----------------------------------------------------------
_PREFIX = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"


def _b64(value: str, field: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{field} is not base64") from exc


class DataKeyBody(BaseModel):
    """A per-artifact data key: the plaintext (used now, never stored) and its wrapped form (stored in the
    manifest, opened later by the key service)."""

    model_config = _REQUEST

    key_id: str = Field(min_length=1, max_length=256)
    wrapped_b64: str = Field(min_length=1, max_length=8192)
    plaintext_b64: str = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _valid(self) -> DataKeyBody:
        _b64(self.wrapped_b64, "wrapped_b64")
        if len(_b64(self.plaintext_b64, "plaintext_b64")) != 32:
            raise ValueError("plaintext_b64 must hold a 32-byte key")
        return self


class _StoreTarget(BaseModel):
    model_config = _REQUEST

    store_url: str = Field(min_length=1, max_length=2048)
    prefix: str = Field(min_length=1, max_length=512, pattern=_PREFIX)

    @field_validator("prefix")
    @classmethod
    def _no_dot_segments(cls, value: str) -> str:
        if any(part in {".", ".."} for part in value.split("/")):
            raise ValueError("prefix must not contain '.' or '..' segments")
        return value


class SuspendRequest(_StoreTarget):
    snapshot_id: str = Field(pattern=f"^{SNAPSHOT_ID_PATTERN}$")
    data_key: DataKeyBody | None = None


class UploadRequest(_StoreTarget):
    data_key: DataKeyBody | None = None


class RestoreRequest(_StoreTarget):
    sandbox_id: str = Field(pattern=f"^{SANDBOX_ID_PATTERN}$")
    data_key_b64: str | None = Field(default=None, max_length=64)
    template: str = Field(default="python", pattern=f"^{TEMPLATE_NAME_PATTERN}$")
    limits: SandboxLimits | None = None
    env: dict[str, str] = Field(default_factory=dict)
    #: As on create: None lets a node with a control plane ask it; no policy means no egress.
    egress: EgressBody | None = None

    @field_validator("data_key_b64")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        if value is not None and len(_b64(value, "data_key_b64")) != 32:
            raise ValueError("data_key_b64 must hold a 32-byte key")
        return value


class RecoverRequest(BaseModel):
    model_config = _REQUEST

    snapshot_id: str | None = Field(default=None, pattern=f"^{SNAPSHOT_ID_PATTERN}$")


class TransferResult(BaseModel):
    """A suspend or upload: the checkpoint, where it is, its stored size, how long each step took."""

    model_config = _ANSWER

    snapshot_id: str
    prefix: str
    stored_bytes: int
    timings: dict[str, float] = Field(default_factory=dict)
