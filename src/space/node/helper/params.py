"""The arguments of the root helper's verbs: one definition of what an id, a template name or an environment
entry may be, and the parameter model of every verb in the table (space.node.helper.verbs). This module is
the helper's input boundary: everything the agent sends is parsed by one of these models before a handler
runs, so auditing what root accepts means reading this file.

Invariants:
- Ids and names match their space.core.ids pattern as a whole (pydantic's `pattern` alone would accept
  a match anywhere in the string).
- Every verb's parameter model forbids extra fields, is strict (no coercion) and frozen.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from space.core.ids import SANDBOX_ID_PATTERN, SNAPSHOT_ID_PATTERN, TEMPLATE_NAME_PATTERN
from space.core.settings import SandboxLimits


def _anchored(pattern: str) -> str:
    return f"^(?:{pattern})$"


SandboxId = Annotated[str, StringConstraints(pattern=_anchored(SANDBOX_ID_PATTERN))]
SnapshotId = Annotated[str, StringConstraints(pattern=_anchored(SNAPSHOT_ID_PATTERN))]
TemplateName = Annotated[str, StringConstraints(pattern=_anchored(TEMPLATE_NAME_PATTERN))]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
EnvValue = Annotated[str, StringConstraints(max_length=32768, pattern=r"^[^\x00]*$")]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoParams(Params):
    pass


# -- node and templates (node_verbs, template_verbs) -------------------------------------------------------


class TemplateParams(Params):
    name: TemplateName = "python"


class TemplateReceiveParams(Params):
    name: TemplateName
    stream: str = Field(description="a btrfs send stream inside the data directory")


class AdoptWarmParams(Params):
    name: TemplateName
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


AbsPath = Annotated[str, StringConstraints(max_length=1024, pattern=r"^/[^\x00]*$")]
UserName = Annotated[str, StringConstraints(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]


class TemplateCommitParams(Params):
    """Commit a stopped build sandbox's root filesystem as user template `name` (template_build_verbs)."""

    name: TemplateName
    sandbox_id: SandboxId
    base: TemplateName  # the template the build sandbox was made from (its guest code is the template's)
    spec_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    default_user: UserName | None = None
    workdir: AbsPath | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=64)
    start_cmd: Annotated[str, StringConstraints(max_length=4096, pattern=r"^[^\x00]+$")] | None = None


class TemplateClaimParams(Params):
    """Record (or, without sandbox_id, drop) the build sandbox of user template `name` (crash recovery)."""

    name: TemplateName
    sandbox_id: SandboxId | None = None


# -- sandboxes and snapshots (sandbox_verbs, snapshot_verbs) ------------------------------------------------


class SandboxParams(Params):
    sandbox_id: SandboxId


class CreateParams(Params):
    sandbox_id: SandboxId
    template: TemplateName = "python"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    warm: bool = False  # start from the template's warm checkpoint when it has one (create + start)


class ConfigureParams(Params):
    """A pooled sandbox bound to its user (ADR 0047): the environment its later boots start with."""

    sandbox_id: SandboxId
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)


class SnapshotParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class CheckpointParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    keep_running: bool = True
    # Suspend: checkpoint a running or paused sandbox and leave it paused (nothing runs after the moment the
    # checkpoint captured, so the copy that leaves the node is the sandbox's last state).
    leave_paused: bool = False


class RestoreParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    source_sandbox_id: SandboxId | None = None
    limits: SandboxLimits | None = None


class ResetParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


# -- transfers through object storage (transfer) ----------------------------------------------------------


class TransferParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class ImportParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    template: TemplateName = "python"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)


class StagingParams(Params):
    # template-*/oci-import: a user template travelling (ADR 0056), named by `template`
    kind: Literal[
        "export", "import", "base-export", "base-import", "template-export", "template-import", "oci-import"
    ]
    sandbox_id: SandboxId | None = None
    snapshot_id: SnapshotId | None = None
    template: TemplateName | None = None


class NoTransferParams(Params):
    pass


# -- disk budgets (storage) ----------------------------------------------------------------------------------


class StorageParams(Params):
    sandbox_id: SandboxId
    # Commit first, so that data written since the last commit is counted. Not needed right after a
    # snapshot (creating one flushes the sandbox's data and commits): the agent's checks skip it.
    sync: bool = True


class DiskParams(Params):
    pass


# -- the node's network (network_verbs) ----------------------------------------------------------------------


class GatewayPorts(BaseModel):
    """The node egress gateway's listening ports on gateway_addr (TCP, and UDP for dns)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    proxy: int = Field(ge=1, le=65535)
    transparent_http: int = Field(ge=1, le=65535)
    transparent_tls: int = Field(ge=1, le=65535)
    dns: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> GatewayPorts:
        values = [self.proxy, self.transparent_http, self.transparent_tls, self.dns]
        if len(set(values)) != len(values):
            raise ValueError("gateway ports must be four different ports")
        return self


class NetworkConfigureParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ports: GatewayPorts
