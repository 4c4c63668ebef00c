"""The isolation-driver interface: what a node needs from gVisor, a microVM or the fake.

Invariants:
- Every driver gives each sandbox a private byte-stream channel to its `spaced`; the node talks to the
  sandbox only through that channel (space.node.agent.channel.GuestChannel).
- Every operation is idempotent with respect to the runtime's actual state: stopping a stopped sandbox or
  destroying a missing one converges instead of failing, so a restarted agent can simply repeat the step.
- All drivers implement the same Driver protocol; the runsc driver is exercised by
  tests/runtime/test_runsc_*.py and the fake driver by tests/node/test_agent_fake.py.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel
from space.node.agent.runtime_names import RuntimeNames

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


@dataclass(frozen=True)
class StagedFiles:
    """Files a driver staged for the agent to upload (an export): `files` maps artifact entry names (plain
    "a/b" names) to sizes; each lives at `directory / name`. `metadata` is non-secret (no env, no data)."""

    directory: pathlib.Path
    files: dict[str, int]
    metadata: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)

    def path(self, name: str) -> pathlib.Path:
        return self.directory / name


class Driver(abc.ABC):
    name: str = "abstract"
    #: True only for drivers that give a sandbox its own kernel; the fake driver says False loudly.
    isolating: bool = True
    #: Whether create_warm/adopt_warm work (templates can start from a checkpoint instead of booting).
    warm_supported: bool = False
    #: The runtime names of a driver that keeps warm pools (space.node.agent.runtime_names); None: no pools.
    names: RuntimeNames | None = None
    #: Whether `checkpoint(leave_paused=True)` then `resume()` is the same as `checkpoint(keep_running=True)`
    #: with the same runtime and channel: the agent then answers a checkpoint before the resume (ADR 0077).
    resumes_after_checkpoint: bool = False

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

    #: Where a template's start command writes its output inside a sandbox (space.node.agent.template_start).
    start_log: str = "/tmp/space-start.log"

    async def start_command(self, template: str) -> str | None:
        """The `start_cmd` of `template`'s metadata (ADR 0054); None: it has none (or this driver keeps no
        template metadata)."""
        return None

    async def create_pooled(self, spec: SandboxSpec) -> GuestChannel:
        """Start a pooled sandbox under runtime id `spec.sandbox_id` (already a member of `names`), from the
        template's warm checkpoint when there is one; it belongs to nobody yet (no policy, no user env)."""
        raise NotImplementedError(f"{self.name} keeps no warm pools")

    async def bind_pooled(self, spec: SandboxSpec, channel: GuestChannel) -> None:
        """The pooled runtime claimed for `spec.sandbox_id` (space.node.agent.runtime_names) now belongs to
        it: later boots start with `spec.env` (the running daemon is given it by the caller, after this)."""
        raise NotImplementedError(f"{self.name} keeps no warm pools")

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
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True, leave_paused: bool = False
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        """Save processes + memory and a disk snapshot of one consistent moment; with keep_running the
        sandbox continues. A driver that had to replace the runtime to do so returns the new channel; None
        means the existing channel is still good. `leave_paused` (suspend): the sandbox may already be
        paused, and stays paused afterwards, so nothing runs after the captured moment."""

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

    async def discard(self, sandbox_id: str) -> None:
        """End every process when nothing of them is kept (the caller replaces the sandbox's files next: a
        rollback). A driver that can end them faster than a stop does (runsc: SIGKILL instead of `runsc
        kill`, ADR 0077) says so; by default a stop."""
        await self.stop(sandbox_id)

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Remove everything the sandbox has on this node."""

    @abc.abstractmethod
    async def state(self, sandbox_id: str) -> RuntimeState: ...

    @abc.abstractmethod
    async def list(self) -> list[RuntimeState]: ...

    @abc.abstractmethod
    async def usage(self, sandbox_id: str) -> dict[str, Any]: ...

    async def metrics(self, sandbox_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """One reading of running sandboxes for the metrics history (space.node.agent.metrics), in one pass:
        {sandbox_id: {"cpu_ns" (cumulative), "memory_bytes", "memory_cache_bytes", "disk_bytes", "source"
        (names the runtime the counters belong to)}}, unknown values None; ids it cannot read are left
        out. Default: none (a driver without counters keeps no history)."""
        return {}

    def state_file(self, name: str) -> pathlib.Path | None:
        """A file of the agent's own state (e.g. its sandboxes' incarnations), in a directory only the agent
        writes and that survives agent restarts; None: this driver keeps no agent state on disk."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook, most drivers hold nothing to release
        """Release client-side resources; sandboxes keep running."""

    # -- moving checkpoints and templates between nodes (object storage) -------------------------------------
    # The agent uploads and downloads; the driver only stages files on the node and takes them in. A driver
    # without these cannot suspend, restore from object storage or fetch templates.
    async def export_snapshot(self, sandbox_id: str, snapshot_id: str) -> StagedFiles:
        """Stage full checkpoint `snapshot_id` for upload (idempotent: a finished export is returned)."""
        raise NotImplementedError(f"{self.name} cannot export checkpoints")

    async def prepare_import(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        """An empty directory the agent downloads a checkpoint's entries into (by entry name)."""
        raise NotImplementedError(f"{self.name} cannot import checkpoints")

    async def import_snapshot(self, spec: SandboxSpec, snapshot_id: str) -> None:
        """Take in the downloaded checkpoint as the sandbox's own (disk, image, runtime config for `spec`),
        so that `restore(spec.sandbox_id, snapshot_id)` runs it. Repeatable after a crash."""
        raise NotImplementedError(f"{self.name} cannot import checkpoints")

    async def release_staging(  # noqa: B027 - optional hook: drivers that stage nothing release nothing
        self, kind: str, sandbox_id: str | None = None, snapshot_id: str | None = None
    ) -> None:
        """Drop a staging directory ("export" | "import" | "base-export" | "base-import"); idempotent."""

    async def storage_usage(self, sandbox_id: str, *, fresh: bool = True) -> dict[str, Any] | None:
        """{"used_bytes", "files_bytes", "images_bytes", "snapshots"}: everything the sandbox keeps on this
        node (files, what its snapshots pin, checkpoint images); None when the driver cannot tell.
        `fresh=False`: as of the filesystem's last commit (cheaper; exact right after a snapshot)."""
        return None

    async def disk_space(self) -> dict[str, int] | None:
        """{"total_bytes", "free_bytes"} of the filesystem the node's sandboxes live on; None: unknown."""
        return None

    async def snapshot_usage(self, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
        """{"exclusive_bytes", "referenced_bytes"} of a disk snapshot (None when unknown)."""
        return {"exclusive_bytes": None, "referenced_bytes": None}

    async def template_base_status(self) -> dict[str, Any] | None:
        """{"name", "version", "present", "identity", "publishable"} of the base every template and every
        exported delta build on; None for drivers whose templates need no shared base."""
        return None

    async def export_template_base(self) -> StagedFiles:
        raise NotImplementedError(f"{self.name} has no template base to export")

    async def prepare_base_import(self) -> pathlib.Path:
        raise NotImplementedError(f"{self.name} has no template base to import")

    async def import_template_base(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name} has no template base to import")


def staging_release_args(kind: str, sandbox_id: str | None, snapshot_id: str | None) -> dict[str, Any]:
    """The arguments of the helper's `staging.release` verb, for the drivers whose helper stages."""
    args: dict[str, Any] = {"kind": kind}
    if sandbox_id is not None:
        args["sandbox_id"] = sandbox_id
    if snapshot_id is not None:
        args["snapshot_id"] = snapshot_id
    return args
