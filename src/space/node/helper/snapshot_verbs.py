"""Verb handlers for a sandbox's snapshots: full checkpoints (memory image + disk snapshot), disk-only
snapshots, restore and rollback from them, and their listing, size and deletion.

Invariants:
- A checkpoint pauses the sandbox from the moment its state is saved until the disk snapshot is taken, so
  memory image and files are one consistent moment; one that fails half-way leaves nothing (ADR 0027).
- A restore always resets the root filesystem to the checkpoint's disk snapshot; its bundle config is the
  source sandbox's, with this node's limits and paths.
- Snapshots are read-only subvolumes under `snapshots/<sandbox>/`; images live under `checkpoints/`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from typing import Any

from space.core import errors
from space.node.helper import oci, usage
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import (
    CheckpointParams,
    ResetParams,
    RestoreParams,
    SandboxParams,
    SnapshotParams,
)
from space.node.helper.sandbox_verbs import stored_limits, tree_bytes
from space.node.volumes import btrfs, btrfs_quota


def sandbox_checkpoint(ctx: HelperContext, params: CheckpointParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    allowed = ("running", "paused") if params.leave_paused else ("running",)
    container = ctx.runtimes.require(sandbox_id, *allowed, event="checkpoint")
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    if image.exists() or disk.exists():
        raise errors.AlreadyExists(f"snapshot {snapshot_id} of {sandbox_id} already exists")
    image.mkdir(parents=True)
    disk.parent.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    # Held from the moment the state is saved until the disk snapshot is taken, so the memory image and
    # the files are one consistent moment: whatever runsc flushes while saving is in the snapshot, and no
    # process can write after it. `--leave-running` keeps the same runtime (and channel) afterwards.
    # A frozen runtime (a user's pause, ADR 0082) is thawed and held instead: runsc saves its state by
    # asking the sandbox, which a frozen one cannot answer. Its processes may run for the ~1 ms between
    # the two (ADR 0084).
    mark = time.monotonic()
    try:
        ctx.runtimes.thaw(sandbox_id)
        ctx.runtimes.hold(sandbox_id)
        try:
            timings["pause_ms"] = (time.monotonic() - mark) * 1000
            mark = time.monotonic()
            ctx.runsc.checkpoint(container, image, leave_running=True)
            timings["checkpoint_ms"] = (time.monotonic() - mark) * 1000
            mark = time.monotonic()
            btrfs.snapshot(ctx.layout.rootfs(sandbox_id), disk, readonly=True)
            timings["disk_snapshot_ms"] = (time.monotonic() - mark) * 1000
            usage.record_snapshot_usage(ctx, sandbox_id, snapshot_id)
        finally:
            mark = time.monotonic()
            if not params.leave_paused:
                ctx.runtimes.release(sandbox_id)
            timings["resume_ms"] = (time.monotonic() - mark) * 1000
    except BaseException:
        _discard_partial_checkpoint(ctx, sandbox_id, snapshot_id)
        raise
    image_bytes = tree_bytes(image)
    result: dict[str, Any] = {"image": str(image), "disk": str(disk), "image_bytes": image_bytes}
    if not params.keep_running:
        ctx.runtimes.stop(sandbox_id)
    result["timings"] = timings
    return result


def _discard_partial_checkpoint(ctx: HelperContext, sandbox_id: str, snapshot_id: str) -> None:
    """A checkpoint that failed half-way (e.g. the disk filled up while runsc wrote the image) leaves nothing:
    no partial image that would count against the sandbox's storage or pass for a checkpoint (ADR 0027)."""
    shutil.rmtree(ctx.layout.checkpoint_image(sandbox_id, snapshot_id), ignore_errors=True)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    with contextlib.suppress(errors.SpaceError):
        if btrfs.is_subvolume(disk):
            btrfs.delete_subvolume(disk)
    usage.usage_file(ctx, sandbox_id, snapshot_id).unlink(missing_ok=True)


def sandbox_restore(ctx: HelperContext, params: RestoreParams, _progress: Progress) -> dict[str, Any]:
    """Start `sandbox_id` from a full checkpoint of `source_sandbox_id` (itself by default: rollback/recover;
    another sandbox: fork). The root filesystem is always reset to the checkpoint's disk snapshot, because
    the restored processes expect the files as they were at that moment."""
    sandbox_id = params.sandbox_id
    source = params.source_sandbox_id or sandbox_id
    image = ctx.layout.checkpoint_image(source, params.snapshot_id)
    disk = ctx.layout.snapshot(source, params.snapshot_id)
    if not image.is_dir() or not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"checkpoint {params.snapshot_id} of {source} is not on this node")
    bundle = ctx.layout.bundle(sandbox_id)
    rootfs = ctx.layout.rootfs(sandbox_id)
    config_source = ctx.layout.bundle(source) / "config.json"
    if not config_source.exists():
        raise errors.NotFound(f"sandbox {source} has no bundle on this node")
    config = json.loads(config_source.read_text())
    if source == sandbox_id:
        ctx.runtimes.discard(sandbox_id)  # its files are replaced below: nothing of it is kept (ADR 0077)
    elif btrfs.is_subvolume(rootfs):
        raise errors.AlreadyExists(f"sandbox {sandbox_id} already exists on this node")
    bundle.mkdir(parents=True, exist_ok=True)
    if btrfs.is_subvolume(rootfs):
        btrfs.delete_subvolume(rootfs)
    btrfs.snapshot(disk, rootfs, readonly=False)
    limits = params.limits or stored_limits(ctx, source)
    btrfs_quota.set_limit(rootfs, limits.disk_mb << 20)
    (bundle / "limits.json").write_text(limits.model_dump_json())
    source_spec = ctx.layout.bundle(source) / "spec.json"
    if source != sandbox_id and source_spec.exists():
        (bundle / "spec.json").write_text(source_spec.read_text())
    config["linux"]["resources"] = oci.resources(limits)
    config["root"]["path"] = str(rootfs)
    oci.write_bundle_config(bundle, config)
    return {"socket": ctx.runtimes.launch(sandbox_id, image)}


def sandbox_disk_snapshot(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if disk.exists():
        raise errors.AlreadyExists(f"snapshot {params.snapshot_id} of {params.sandbox_id} already exists")
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    if not btrfs.is_subvolume(rootfs):
        raise errors.NotFound(f"sandbox {params.sandbox_id} has no root filesystem on this node")
    disk.parent.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(rootfs, disk, readonly=True)
    usage.record_snapshot_usage(ctx, params.sandbox_id, params.snapshot_id)
    return {"disk": str(disk)}


def sandbox_reset_rootfs(ctx: HelperContext, params: ResetParams, _progress: Progress) -> dict[str, Any]:
    """Replace a stopped sandbox's files by a disk snapshot (rollback of files; the caller restarts it)."""
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"snapshot {params.snapshot_id} of {params.sandbox_id} is not on this node")
    if ctx.runtimes.holder_alive(params.sandbox_id):
        status = ctx.runtimes.status(params.sandbox_id)
        raise errors.InvalidState(
            f"runtime of {params.sandbox_id} is {status}; stop it first", state=status, event="rollback"
        )
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    if btrfs.is_subvolume(rootfs):
        btrfs.delete_subvolume(rootfs)
    btrfs.snapshot(disk, rootfs, readonly=False)
    btrfs_quota.set_limit(rootfs, stored_limits(ctx, params.sandbox_id).disk_mb << 20)
    return {"rootfs": str(rootfs)}


def snapshot_delete(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    image = ctx.layout.checkpoint_image(params.sandbox_id, params.snapshot_id)
    removed = False
    if btrfs.is_subvolume(disk):
        btrfs.delete_subvolume(disk)
        removed = True
    if image.exists():
        shutil.rmtree(image)
        removed = True
    if not removed:
        raise errors.NotFound(f"snapshot {params.snapshot_id} of {params.sandbox_id} is not on this node")
    return {}


def snapshot_usage(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    """Size on disk of a snapshot: `exclusive_bytes` is what it pins (see usage.snapshot_cost for the
    meaning under simple quotas), `referenced_bytes` everything it reaches."""
    return usage.snapshot_cost(ctx, params.sandbox_id, params.snapshot_id)


def snapshot_list(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    """The snapshots on this node's disk, so an agent that restarted can rebuild its records."""
    found = []
    root = ctx.layout.snapshots_root / params.sandbox_id
    for disk in sorted(root.iterdir()) if root.exists() else []:
        if not btrfs.is_subvolume(disk):
            continue
        image = ctx.layout.checkpoint_image(params.sandbox_id, disk.name)
        image_bytes = tree_bytes(image) if image.is_dir() else 0
        found.append(
            {
                "snapshot_id": disk.name,
                "kind": "full" if image.is_dir() else "disk",
                "created_at": disk.stat().st_mtime,
                "image_bytes": image_bytes,
            }
        )
    return {"snapshots": found}
