"""The QEMU microVM driver: each sandbox runs Debian's own Linux kernel in a QEMU `microvm` machine.

Every privileged step is one `microvm.*` verb of the root helper (space.node.helper.microvm_verbs); this
agent-side driver only asks for them and opens the channel socket the helper's holder hands it
(docs/adr/0068-qemu-microvm-driver.md).

Invariants:
- A sandbox starts by restoring its template's booted checkpoint (create); the template's checkpoint is
  made once per node by `ensure_template` (one cold boot, HELLO, then the checkpoint).
- The channel survives checkpoints and pauses: it is the holder's socket in front of QEMU's stdio chardev.
- What this driver does not do yet raises NotSupported (HTTP 409) with space.core.isolation's message for
  the operation, naming the microvm isolation (ADR 0068 lists them, ADR 0076 the errors); it never
  pretends: a disk-only snapshot is refused, not half done. A suspend exports memory image and whole disk
  through the helper (ADR 0081). A stopped sandbox boots cold from its own disk (`start`); `list` reports
  every microVM disk on the node.
- Warm pools as with gVisor (ADR 0047; ADR 0068 "Warm pools"): a pooled member is the template's
  checkpoint restored under a runtime id of its own, its network slot that runtime id's (ADR 0080); the
  helper client translates sandbox ids to runtime ids (`names`), so every verb and every path this driver
  builds names the runtime. The bind gives the member nothing the helper holds: the agent's usual
  personalisation (reseed, environment) and the egress wiring's policy for the runtime's slot are all of it.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, NoReturn

from space.core import errors, isolation
from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel
from space.node.agent.helper_client import HelperClient
from space.node.agent.identity import identity_dir
from space.node.agent.runtime_names import RuntimeNames
from space.node.drivers.base import (
    CheckpointInfo,
    Driver,
    Progress,
    RuntimeState,
    SandboxSpec,
    StagedFiles,
    staging_release_args,
)
from space.node.layout import NodeLayout

#: A cold boot under TCG on a busy 2-core machine took up to ~25 s; restores answer in well under 1 s.
COLD_BOOT_TIMEOUT_S = 300.0
RESTORE_TIMEOUT_S = 60.0
#: How long a stop waits for the guest to flush its files before the VM is ended anyway.
SYNC_TIMEOUT_S = 10.0


class QemuDriver(Driver):
    name = "qemu"
    isolating = True
    warm_supported = True  # every create is a restore of the template's checkpoint, or binds a pooled one
    networked = True  # a virtio-net device on a tap in the sandbox's slot (ADR 0080): egress as gVisor's

    def __init__(
        self, layout: NodeLayout, helper: HelperClient, *, memory_mb: int = 512, vcpus: int = 1
    ) -> None:
        self.layout = layout
        self.helper = helper
        self.machine = {"memory_mb": memory_mb, "vcpus": vcpus}
        # Pooled runtimes and the sandbox ids bound to them (ADR 0047): the helper client translates.
        self.names: RuntimeNames = RuntimeNames(self.state_file("runtime-names.json"))
        helper.names = self.names

    def state_file(self, name: str) -> pathlib.Path | None:
        # The agent's private 0700 directory, as for runsc (the helper's node.prepare makes it).
        return identity_dir(self.layout.data_dir) / name

    async def _channel(
        self, sandbox_id: str, socket_path: str, timeout: float = RESTORE_TIMEOUT_S
    ) -> GuestChannel:
        return await GuestChannel.connect_unix(socket_path, timeout=timeout, name=sandbox_id)

    async def prepare(self, progress: Progress | None = None) -> None:
        await self.helper.call("node.prepare", progress=progress, timeout=300.0)

    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        """The node's template `name` (built as for gVisor), then its microVM checkpoint, made once."""
        result = await self.helper.call("template.ensure", {"name": name}, progress=progress, timeout=1800.0)
        args = {"name": name, **self.machine}
        status = await self.helper.call("microvm.template_status", args)
        if not status["ready"]:
            booted = await self.helper.call("microvm.template_boot", args, progress=progress, timeout=600.0)
            channel = await self._channel(f"template {name}", str(booted["socket"]), COLD_BOOT_TIMEOUT_S)
            try:
                await _warm_up(channel)
            finally:
                await channel.close()
            await self.helper.call("microvm.template_adopt", args, timeout=600.0)
        return {**result, "microvm": {"accel": status["accel"], **self.machine}}

    async def create(self, spec: SandboxSpec) -> None:
        _refuse("cold_create")  # every create is create_warm: a restore of the template's checkpoint

    async def create_warm(self, spec: SandboxSpec) -> GuestChannel | None:
        """Restore the template's checkpoint as `spec.sandbox_id`. Like every warm start, the caller then
        gives the daemon its own randomness and environment (NodeAgent._personalise): the guest kernel's
        entropy pool and the daemon's environment came with the template's checkpoint."""
        result = await self.helper.call(
            "microvm.create", {"sandbox_id": spec.sandbox_id, "template": spec.template}, timeout=120.0
        )
        return await self._channel(spec.sandbox_id, str(result["socket"]))

    async def warm_ready(self, template: str) -> bool:
        return bool((await self.helper.call("microvm.template_status", {"name": template}))["ready"])

    async def start(self, sandbox_id: str) -> GuestChannel:
        """Boot a stopped sandbox from its own disk: a cold boot (the only one besides a template's)."""
        result = await self.helper.call("microvm.start", {"sandbox_id": sandbox_id}, timeout=120.0)
        return await self._channel(sandbox_id, str(result["socket"]), COLD_BOOT_TIMEOUT_S)

    async def connect(self, sandbox_id: str) -> GuestChannel:
        socket_path = self.layout.channel_socket(self.names.to_runtime(sandbox_id))
        return await self._channel(sandbox_id, str(socket_path))

    async def pause(self, sandbox_id: str) -> None:
        await self.helper.call("microvm.pause", {"sandbox_id": sandbox_id})

    async def resume(self, sandbox_id: str) -> None:
        await self.helper.call("microvm.resume", {"sandbox_id": sandbox_id})

    async def checkpoint(
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True, leave_paused: bool = False
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        result = await self.helper.call(
            "microvm.checkpoint",
            {
                "sandbox_id": sandbox_id,
                "snapshot_id": snapshot_id,
                "keep_running": keep_running and not leave_paused,
            },
            timeout=600.0,
        )
        info = CheckpointInfo(sandbox_id, snapshot_id, int(result["image_bytes"]), dict(result["timings"]))
        return info, None  # the same QEMU continues: the channel is still good

    async def restore(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        source_sandbox_id: str | None = None,
        limits: SandboxLimits | None = None,
    ) -> GuestChannel:
        args: dict[str, Any] = {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        if source_sandbox_id is not None:
            args["source_sandbox_id"] = source_sandbox_id
        result = await self.helper.call("microvm.restore", args, timeout=600.0)
        return await self._channel(sandbox_id, str(result["socket"]))

    async def disk_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        _refuse("disk_snapshot")

    async def reset_rootfs(self, sandbox_id: str, snapshot_id: str) -> None:
        _refuse("disk_rollback")  # a rollback restores a full checkpoint instead

    # -- warm pools (ADR 0047, ADR 0068 "Warm pools")
    async def create_pooled(self, spec: SandboxSpec) -> GuestChannel:
        """A member: the template's checkpoint restored under runtime id `spec.sandbox_id`, exactly as a
        warm create (its own disk, slot, uid and cgroups are that runtime id's), then its daemon's common
        calls run once. A restored QEMU starts with an empty TCG translation cache: under TCG the first
        reseed, exec and file read of a member cost about twice the later ones (first exec ~90 ms, then
        ~45 ms), paid here, ahead of the user. The bind reseeds again: this reseed's randomness is not
        what the user gets, it only has the reseed's code translated."""
        channel = await self.create_warm(spec)
        assert channel is not None  # this driver's create_warm always starts the microVM
        try:
            await _warm_up(channel, reseed=True)
        except BaseException:
            await channel.close()
            raise
        return channel

    async def bind_pooled(self, spec: SandboxSpec, channel: GuestChannel) -> None:
        """Nothing for the helper: a microVM keeps no boot environment outside its guest (a warm create
        hands the helper none either), and its slot stays the runtime's (the egress wiring gives the slot's
        address the sandbox's policy). The agent reseeds the guest and gives it the environment."""

    # -- not yet for microVMs (ADR 0068's list): refused by name instead of the base class's
    # NotImplementedError, so the agent answers a typed 409 and the reconciler does not retry them.
    async def adopt_warm(self, template: str, sandbox_id: str, snapshot_id: str) -> None:
        _refuse("template_checkpoint")  # ensure_template makes the checkpoint: warm_ready is then true

    # -- object storage (space.node.helper.microvm_transfer, ADR 0081): the agent uploads and downloads
    # exactly as for gVisor; the artifact's runtime descriptor is this node's (`qemu`).
    async def export_snapshot(self, sandbox_id: str, snapshot_id: str) -> StagedFiles:
        result = await self.helper.call(
            "microvm.export", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}, timeout=600.0
        )
        return StagedFiles(
            directory=pathlib.Path(str(result["dir"])),
            files={str(k): int(v) for k, v in dict(result["files"]).items()},
            metadata=dict(result.get("metadata") or {}),
            timings={str(k): float(v) for k, v in dict(result.get("timings") or {}).items()},
        )

    async def prepare_import(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        result = await self.helper.call(
            "staging.prepare", {"kind": "import", "sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )
        return pathlib.Path(str(result["dir"]))

    async def import_snapshot(self, spec: SandboxSpec, snapshot_id: str) -> None:
        """Take in the downloaded checkpoint (checked as hostile by the helper); `restore` then runs it."""
        await self.helper.call(
            "microvm.import",
            {"sandbox_id": spec.sandbox_id, "snapshot_id": snapshot_id, "template": spec.template},
            timeout=600.0,
        )

    async def release_staging(
        self, kind: str, sandbox_id: str | None = None, snapshot_id: str | None = None
    ) -> None:
        await self.helper.call("staging.release", staging_release_args(kind, sandbox_id, snapshot_id))

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        await self.helper.call(
            "microvm.snapshot_delete", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )

    async def list_snapshots(self, sandbox_id: str) -> list[dict[str, Any]]:
        return list(
            (await self.helper.call("microvm.snapshot_list", {"sandbox_id": sandbox_id}))["snapshots"]
        )

    async def disk_space(self) -> dict[str, int] | None:
        result = await self.helper.call("node.disk")  # the microVMs' disks live on the node's btrfs too
        return {"total_bytes": int(result["total_bytes"]), "free_bytes": int(result["free_bytes"])}

    async def stop(self, sandbox_id: str) -> None:
        """End the VM, keeping its disk. Its files may still sit in the guest's page cache (a real kernel,
        unlike gVisor's gofer, writes back later): flush them first when the guest still answers."""
        with contextlib.suppress(errors.SpaceError, OSError, TimeoutError):
            channel = await GuestChannel.connect_unix(
                str(self.layout.channel_socket(self.names.to_runtime(sandbox_id))),
                timeout=SYNC_TIMEOUT_S,
                name=sandbox_id,
            )
            try:
                from space.node.agent.guest import GuestSession

                await GuestSession(channel).exec(["sync"], timeout=SYNC_TIMEOUT_S)
            finally:
                await channel.close()
        await self.helper.call("microvm.stop", {"sandbox_id": sandbox_id})

    async def destroy(self, sandbox_id: str) -> None:
        await self.helper.call("microvm.destroy", {"sandbox_id": sandbox_id})

    async def state(self, sandbox_id: str) -> RuntimeState:
        return _runtime_state(await self.helper.call("microvm.state", {"sandbox_id": sandbox_id}))

    async def list(self) -> list[RuntimeState]:
        """Every microVM sandbox on this node (a restarted agent adopts the running ones)."""
        return [_runtime_state(raw) for raw in (await self.helper.call("microvm.list"))["sandboxes"]]

    async def usage(self, sandbox_id: str) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        await self.helper.close()


def _refuse(operation: str) -> NoReturn:
    isolation.refuse_unsupported("microvm", operation)
    raise AssertionError(f"{operation} is missing from space.core.isolation.UNSUPPORTED['microvm']")


def _runtime_state(raw: dict[str, Any]) -> RuntimeState:
    template = raw.get("template")
    return RuntimeState(
        sandbox_id=str(raw["sandbox_id"]), exists=bool(raw["exists"]), runtime=str(raw["runtime"]),
        channel_open=bool(raw["holder"]),
        spec=SandboxSpec(str(raw["sandbox_id"]), str(template)) if template else None,
    )  # fmt: skip


async def _warm_up(channel: GuestChannel, *, reseed: bool = False) -> None:
    """Have the template's daemon load the code of its common calls before the checkpoint: every sandbox
    restored from it then starts with that code in memory. Without it the first exec of each sandbox
    imported (and, under TCG, compiled) the daemon's process modules: ~400 ms instead of ~140 ms. A pool
    member runs the same calls (and a reseed) to have them translated again after its restore."""
    from space.node.agent.guest import GuestSession

    session = GuestSession(channel)
    if reseed:
        await session.reseed()
    for _ in range(2):
        await session.exec(["true"])
    await session.read_file("/etc/hostname")
