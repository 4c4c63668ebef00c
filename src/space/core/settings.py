"""Settings models: sandbox resource limits and a node's configuration (pure: pydantic, no I/O).

Invariants:
- Models are frozen and reject unknown fields, so a typo in a request or config file is an error, not a
  silently ignored key.
- Numbers are strict: a bool or a string is never taken for a number (`true` must not mean 1 CPU), and
  cpus must be finite. Bounds are inclusive.
- Paths are validated as *absolute* pure paths only; nothing here looks at the file system.
- `parse_limits` turns pydantic's ValidationError into space.core.errors.InvalidArgument naming each
  bad field, so callers see one error type.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from space.core.errors import InvalidArgument

Platform = Literal["systrap", "ptrace"]

# A runsc binary is a bare command name looked up on PATH, or an absolute path; no shell metacharacters
# or whitespace, because it ends up in argv built by the node helper.
_BINARY_RE: Final = re.compile(r"[A-Za-z0-9._+-]{1,64}|/[A-Za-z0-9._+/-]{1,4095}")

_FROZEN: Final = ConfigDict(frozen=True, extra="forbid")

STORAGE_PER_DISK: Final = 2  # default storage budget per MB of disk
STORAGE_MB_MAX: Final = 2 * 1048576  # 2 TiB: twice the largest disk
#: A node hands out this many times its CPUs to sandboxes' `cpus` limits (the scheduler's admission and a
#: node's own warm-pool refills count the same way).
CPU_OVERCOMMIT: Final = 4


class SandboxLimits(BaseModel):
    """Resources one sandbox may use (enforced by the driver: cgroups for runsc, -smp/-m for QEMU)."""

    model_config = _FROZEN

    cpus: float = Field(default=1.0, ge=0.1, le=64.0, strict=True, allow_inf_nan=False)
    memory_mb: int = Field(default=512, ge=64, le=65536, strict=True)
    pids: int = Field(default=512, ge=16, le=65536, strict=True)
    disk_mb: int = Field(default=2048, ge=64, le=1048576, strict=True)
    # Everything the sandbox keeps on its node: its files, what its snapshots pin and its checkpoint images
    # (docs/adr/0027-disk-budgets.md). Absent or null: STORAGE_PER_DISK x disk_mb.
    storage_mb: int = Field(default=2 * 2048, ge=64, le=STORAGE_MB_MAX, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _default_storage(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("storage_mb") is None:
            disk = data.get("disk_mb", 2048)
            if isinstance(disk, int) and not isinstance(disk, bool):
                data = {**data, "storage_mb": min(STORAGE_MB_MAX, max(64, STORAGE_PER_DISK * disk))}
        return data


class DiskReserve(BaseModel):
    """Free space a node keeps for itself: creates, snapshots, checkpoints and imports are refused when they
    would leave less than `min(percent of the disk, mb)` free (docs/adr/0027-disk-budgets.md)."""

    model_config = _FROZEN

    percent: float = Field(default=5.0, ge=0.0, le=50.0, strict=True, allow_inf_nan=False)
    mb: int = Field(default=2048, ge=0, le=1048576, strict=True)

    def bytes_for(self, total_bytes: int) -> int:
        return min(int(total_bytes * self.percent / 100), self.mb << 20)


def _absolute(value: Path, field: str) -> Path:
    if not value.is_absolute() or "\x00" in str(value):
        raise ValueError(f"{field} must be an absolute path")
    return value


class NodeSettings(BaseModel):
    """Configuration of one node agent and its helper."""

    model_config = _FROZEN

    data_dir: Path = Path("/var/lib/space")
    runsc_binary: str = "runsc"
    platform: Platform = "ptrace"  # measured faster and leaner here: docs/adr/0007-gvisor-platform.md
    # "sandbox": each sandbox gets its own network namespace whose only way out is the node's egress gateway
    # (docs/adr/0015-sandbox-network.md); "none": no network at all.
    network: Literal["none", "sandbox"] = "sandbox"
    helper_socket: Path = Path("/run/space/helper.sock")
    default_limits: SandboxLimits = Field(default_factory=SandboxLimits)
    # The object store this node reads templates from and writes suspended sandboxes to ("file:///dir" or
    # "s3://bucket/prefix?endpoint=..."); a suspend/restore request naming another store is refused.
    store_url: str | None = Field(default=None, pattern=r"^(file|s3)://\S+$", max_length=2048)
    # Free space the node keeps (creates, snapshots, checkpoints and imports refused below it).
    disk_reserve: DiskReserve = Field(default_factory=DiskReserve)

    @field_validator("data_dir")
    @classmethod
    def _data_dir_absolute(cls, value: Path) -> Path:
        return _absolute(value, "data_dir")

    @field_validator("helper_socket")
    @classmethod
    def _socket_absolute(cls, value: Path) -> Path:
        return _absolute(value, "helper_socket")

    @field_validator("runsc_binary")
    @classmethod
    def _binary_name(cls, value: str) -> str:
        if _BINARY_RE.fullmatch(value) is None or ".." in value.split("/"):
            raise ValueError("runsc_binary must be a command name or an absolute path without '..'")
        return value


def _describe(exc: ValidationError) -> tuple[str, list[dict[str, str]]]:
    problems = [
        {
            "field": ".".join(str(part) for part in err["loc"]) or "(root)",
            # pydantic prefixes our own validators' messages with "Value error, "; users need not see it.
            "problem": err["msg"].removeprefix("Value error, "),
        }
        for err in exc.errors(include_url=False)
    ]
    return "; ".join(f"{p['field']}: {p['problem']}" for p in problems), problems


def parse_limits(data: Any, *, field: str = "limits") -> SandboxLimits:
    """SandboxLimits from request data (None means all defaults); InvalidArgument naming each bad field."""
    if data is None:
        return SandboxLimits()
    try:
        return SandboxLimits.model_validate(data)
    except ValidationError as exc:
        summary, problems = _describe(exc)
        raise InvalidArgument(f"invalid {field}: {summary}", field=field, errors=problems) from exc


def parse_node_settings(data: Any) -> NodeSettings:
    """NodeSettings from already-loaded config data; InvalidArgument naming each bad field."""
    try:
        return NodeSettings.model_validate(data)
    except ValidationError as exc:
        summary, problems = _describe(exc)
        raise InvalidArgument(f"invalid node settings: {summary}", field="node", errors=problems) from exc
