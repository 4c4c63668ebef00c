"""Request bodies of E2B's control API, with E2B's field names (its `NewSandbox`, `NewSandboxV2`,
`ConnectSandbox`, `SandboxPauseRequest`, `SandboxTimeoutRequest`, `SandboxForkRequest`,
`SandboxSnapshotRequest`, `SandboxNetworkUpdateConfig`).

Invariants:
- Fields E2B's SDK may send and SPACE cannot honour are refused (400 naming them) when set, never
  silently dropped: `mcp`, `iam`, `volumeMounts`, `autoResume.enabled: false`, `egressProxy`, network
  `rules`. `autoResume.enabled: true` is SPACE's own behaviour (a paused or suspended sandbox is brought
  back by its next use: `deps.running_sandbox`), so it is accepted; opting out of it cannot be honoured.
  Unknown fields are ignored (E2B adds optional fields between versions; ignoring an unknown optional
  field is what E2B's own server does).
- Every size is bounded here: timeouts (0 < t <= 365 days at create), counts, list lengths, names.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from space.core import errors

MAX_TIMEOUT_S = 365 * 24 * 3600
#: E2B's default sandbox timeout (its SDK's `default_sandbox_timeout`; 2.63 no longer sends one).
DEFAULT_TIMEOUT_S = 300
MAX_NETWORK_ENTRIES = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class AutoResume(_Body):
    enabled: bool


class Network(_Body):
    allow_out: list[str] | None = Field(default=None, alias="allowOut", max_length=MAX_NETWORK_ENTRIES)
    deny_out: list[str] | None = Field(default=None, alias="denyOut", max_length=MAX_NETWORK_ENTRIES)
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    egress_proxy: Any = Field(default=None, alias="egressProxy")
    rules: Any = None
    allow_internet_access: bool | None = None

    def refuse_unsupported(self) -> None:
        unsupported = {"egressProxy": self.egress_proxy, "rules": self.rules}
        refuse_set(unsupported, "network")


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    secure: bool | None = None  # every sandbox has an envd access token (access.py)
    allow_internet_access: bool | None = None
    network: Network | None = None
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_pause_memory: bool = Field(default=True, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    mcp: Any = None
    iam: Any = None
    volume_mounts: Any = Field(default=None, alias="volumeMounts")

    def refuse_unsupported(self) -> None:
        refuse_set({"mcp": self.mcp, "iam": self.iam, "volumeMounts": self.volume_mounts}, None)
        if self.auto_resume is not None and not self.auto_resume.enabled:
            raise errors.InvalidArgument(
                "autoResume cannot be turned off: SPACE resumes a paused sandbox when it is used",
                field="autoResume",
            )
        if self.network is not None:
            self.network.refuse_unsupported()


class ConnectBody(_Body):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    memory: bool | None = None


class PauseBody(_Body):
    memory: bool = True
    require_healthy_guest: bool = Field(default=False, alias="requireHealthyGuest")


class TimeoutBody(_Body):
    timeout: int = Field(ge=0, le=MAX_TIMEOUT_S)


class ForkBody(_Body):
    timeout: int = Field(default=15, gt=0, le=MAX_TIMEOUT_S)
    count: int = Field(default=1, ge=1, le=100)


class SnapshotBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=256)


def refuse_set(values: dict[str, Any], within: str | None) -> None:
    """InvalidArgument naming the first field of `values` that is set (not None, not empty)."""
    for name, value in values.items():
        if value not in (None, [], {}):
            where = f"{within}.{name}" if within else name
            raise errors.InvalidArgument(f"{where} is not supported by SPACE's E2B front", field=where)
