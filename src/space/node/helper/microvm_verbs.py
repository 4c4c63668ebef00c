"""The root helper's verbs for microVM sandboxes (the `qemu` driver, docs/adr/0068-qemu-microvm-driver.md).

Invariants:
- Arguments are the table's usual validated ids and names (space.node.helper.params); no verb takes a path.
- A template's microVM checkpoint is made from the node's own template of that name (a read-only subvolume
  the helper already holds); the verbs that make a QEMU run are `guarded` by the node's lease in the table.
- MicroVMs holds no state between calls: every verb reads what it needs from the node's files.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from space.core import errors
from space.node.helper import staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.microvm import Machine, MicroVMs
from space.node.helper.params import NoParams, Params, SandboxId, SandboxParams, SnapshotId, TemplateName
from space.node.volumes import btrfs, templates


class MicrovmTemplateParams(Params):
    name: TemplateName
    memory_mb: int = Field(default=512, ge=128, le=65536)
    vcpus: int = Field(default=1, ge=1, le=64)


class MicrovmCreateParams(Params):
    sandbox_id: SandboxId
    template: TemplateName


class MicrovmCheckpointParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    keep_running: bool = True


class MicrovmRestoreParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    source_sandbox_id: SandboxId | None = None


def _vms(ctx: HelperContext) -> MicroVMs:
    return MicroVMs(ctx.layout, ctx.owner_uid, network=ctx.network)


def template_boot(ctx: HelperContext, params: MicrovmTemplateParams, progress: Progress) -> dict[str, Any]:
    """Build the template's disk image and initrd and cold-boot it; the agent waits for HELLO on the
    returned socket, then calls microvm.template_adopt."""
    rootfs = ctx.layout.template(params.name)
    if not btrfs.is_subvolume(rootfs):
        raise errors.NotFound(f"template {params.name!r} is not on this node", template=params.name)
    vms = _vms(ctx)
    progress(f"space: building the microVM disk of template {params.name}")
    vms.build_template_disk(
        params.name, rootfs, templates.guest_environment(ctx.layout.templates, params.name)
    )
    progress(f"space: cold-booting template {params.name} under {vms.accel}")
    return {"socket": vms.boot_template(params.name, Machine(params.memory_mb, params.vcpus))}


def template_adopt(ctx: HelperContext, params: MicrovmTemplateParams, _progress: Progress) -> dict[str, Any]:
    return _vms(ctx).adopt_template(params.name, Machine(params.memory_mb, params.vcpus))


def template_status(ctx: HelperContext, params: MicrovmTemplateParams, _progress: Progress) -> dict[str, Any]:
    vms = _vms(ctx)
    return {
        "ready": vms.template_ready(params.name, Machine(params.memory_mb, params.vcpus)),
        "accel": vms.accel,
    }


def sandbox_create(ctx: HelperContext, params: MicrovmCreateParams, _progress: Progress) -> dict[str, Any]:
    return {"socket": _vms(ctx).create(params.sandbox_id, params.template)}


def sandbox_pause(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    _require(ctx, params.sandbox_id, "running", "paused", event="pause")
    _vms(ctx).pause(params.sandbox_id)
    return {}


def sandbox_resume(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    _require(ctx, params.sandbox_id, "running", "paused", event="resume")
    _vms(ctx).resume(params.sandbox_id)
    return {}


def sandbox_checkpoint(
    ctx: HelperContext, params: MicrovmCheckpointParams, _progress: Progress
) -> dict[str, Any]:
    _require(ctx, params.sandbox_id, "running", "paused", event="checkpoint")
    return _vms(ctx).checkpoint(params.sandbox_id, params.snapshot_id, keep_running=params.keep_running)


def sandbox_restore(ctx: HelperContext, params: MicrovmRestoreParams, _progress: Progress) -> dict[str, Any]:
    socket_path = _vms(ctx).restore(params.sandbox_id, params.snapshot_id, params.source_sandbox_id)
    return {"socket": socket_path}


def sandbox_start(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    return {"socket": _vms(ctx).boot(params.sandbox_id)}


def sandbox_list(ctx: HelperContext, _params: NoParams, progress: Progress) -> dict[str, Any]:
    vms = _vms(ctx)
    return {
        "sandboxes": [
            sandbox_state(ctx, SandboxParams(sandbox_id=sid), progress) for sid in vms.sandbox_ids()
        ]
    }


class MicrovmSnapshotParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


def snapshot_list(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    return {"snapshots": _vms(ctx).snapshots(params.sandbox_id)}


def snapshot_delete(ctx: HelperContext, params: MicrovmSnapshotParams, _progress: Progress) -> dict[str, Any]:
    return {"deleted": _vms(ctx).delete_checkpoint(params.sandbox_id, params.snapshot_id)}


def sandbox_stop(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    _vms(ctx).stop(params.sandbox_id)
    return {}


def sandbox_destroy(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    _vms(ctx).destroy(params.sandbox_id)
    staging.discard_sandbox_staging(ctx, params.sandbox_id)  # an export or import left half-way (ADR 0081)
    return {}


def sandbox_state(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    vms = _vms(ctx)
    exists = (vms.sandbox_dir(params.sandbox_id) / "meta.json").is_file()
    status = vms.status(params.sandbox_id)
    state: dict[str, Any] = {"sandbox_id": params.sandbox_id, "exists": exists,
                             "runtime": status if status != "absent" or not exists else "stopped",
                             "holder": status != "absent"}  # fmt: skip
    if exists:
        state["template"] = str(vms.machine_of(params.sandbox_id)[1].get("template", ""))
    return state


def _require(ctx: HelperContext, sandbox_id: str, *allowed: str, event: str) -> None:
    status = _vms(ctx).status(sandbox_id)
    if status not in allowed:
        raise errors.InvalidState(f"microVM of {sandbox_id} is {status}", state=status, event=event)
