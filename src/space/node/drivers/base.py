"""The isolation-driver interface: what a node needs from gVisor, a microVM or the fake.

Invariants:
- Every driver gives each sandbox a private byte-stream channel to its `spaced`; the node talks to the
  sandbox only through that channel (space.node.agent.channel.GuestChannel).
- Every operation is idempotent with respect to the runtime's actual state: stopping a stopped sandbox or
  destroying a missing one converges instead of failing, so a restarted agent can simply repeat the step.
- All drivers pass the same conformance suite (tests/integration/test_driver_conformance.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    template: str = "python"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeState:
    sandbox_id: str
    exists: bool  # the node holds its root filesystem
    runtime: str  # running | paused | stopped | created | absent
    channel_open: bool  # a holder keeps the channel (the runtime process is alive)
    exit: dict[str, Any] | None = None
    spec: SandboxSpec | None = None  # as created (template, limits, env), when the node kept it


@dataclass(frozen=True)
class CheckpointInfo:
    sandbox_id: str
    snapshot_id: str
    image_bytes: int
    timings: dict[str, float]


class Driver(abc.ABC):
    name: str = "abstract"
    #: True only for drivers that give a sandbox its own kernel; the fake driver says False loudly.
    isolating: bool = True
    #: Whether create_warm/adopt_warm work (templates can start from a checkpoint instead of booting).
    warm_supported: bool = False

    @abc.abstractmethod
    async def prepare(self, progress: Progress | None = None) -> None:
        """Make the node ready: storage, runtime state directories."""

    @abc.abstractmethod
    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        """Make template `name` available on this node (build or fetch it once)."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> None:
        """Give the sandbox its root filesystem and runtime configuration; nothing runs yet."""

    async def create_warm(self, spec: SandboxSpec) -> GuestChannel | None:
        """Create and start the sandbox from its template's warm checkpoint, if the driver has one; None
        means "no warm start here": the caller uses create() and start()."""
        return None

    async def warm_ready(self, template: str) -> bool:
        return False

    async def adopt_warm(self, template: str, sandbox_id: str, snapshot_id: str) -> None:
        """Make a full checkpoint of a freshly booted sandbox of `template` its warm start (the sandbox is
        consumed)."""
        raise NotImplementedError(f"{self.name} has no warm starts")

    @abc.abstractmethod
    async def start(self, sandbox_id: str) -> GuestChannel:
        """Boot the sandbox's init and return a channel on which it answered HELLO."""

    @abc.abstractmethod
    async def connect(self, sandbox_id: str) -> GuestChannel:
        """Re-attach to the channel of a sandbox that is already running (e.g. after an agent restart)."""

    @abc.abstractmethod
    async def pause(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    async def resume(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    async def checkpoint(
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        """Save processes + memory and a disk snapshot of one consistent moment; with keep_running the
        sandbox continues. A driver that had to replace the runtime to do so returns the new channel; None
        means the existing channel is still good."""

    @abc.abstractmethod
    async def restore(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        source_sandbox_id: str | None = None,
        limits: SandboxLimits | None = None,
    ) -> GuestChannel:
        """Run `sandbox_id` from a checkpoint of `source_sandbox_id` (itself when None)."""

    @abc.abstractmethod
    async def disk_snapshot(self, sandbox_id: str, snapshot_id: str) -> None: ...

    @abc.abstractmethod
    async def reset_rootfs(self, sandbox_id: str, snapshot_id: str) -> None:
        """Replace a stopped sandbox's files by a disk snapshot."""

    @abc.abstractmethod
    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None: ...

    @abc.abstractmethod
    async def list_snapshots(self, sandbox_id: str) -> list[dict[str, Any]]:
        """[{"snapshot_id", "kind": "disk"|"full", "created_at": unix time, "image_bytes"}] on this node."""

    @abc.abstractmethod
    async def stop(self, sandbox_id: str) -> None:
        """End every process; keep the disk."""

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Remove everything the sandbox has on this node."""

    @abc.abstractmethod
    async def state(self, sandbox_id: str) -> RuntimeState: ...

    @abc.abstractmethod
    async def list(self) -> list[RuntimeState]: ...

    @abc.abstractmethod
    async def usage(self, sandbox_id: str) -> dict[str, Any]: ...

    async def close(self) -> None:  # noqa: B027 - optional hook, most drivers hold nothing to release
        """Release client-side resources; sandboxes keep running."""
