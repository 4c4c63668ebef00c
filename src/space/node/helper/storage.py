"""What a sandbox keeps on the node's disk, and how much disk the node has (helper verbs, read-only).

Invariants (docs/adr/0027-disk-budgets.md):
- A sandbox's `used_bytes` = the bytes charged to every qgroup of its lineage + the bytes allocated by its
  checkpoint images. Its lineage is every root-filesystem incarnation it ever had (a rollback or restore
  makes a new one; the old one's data lives on while a snapshot pins it), the incarnations its snapshots'
  usage records name, and its snapshot subvolumes themselves (a received snapshot allocates its own data).
  Under simple quotas every extent is charged to the subvolume that allocated it, until it is freed, so
  this sum is exactly what the sandbox wrote that is still on disk, wherever it is referenced from; its
  template's extents are charged to the template, never to it. A qgroup the kernel removed (all freed)
  counts zero. With full qgroups the sum is an estimate (shared extents are in nobody's exclusive bytes);
  without quotas only images are counted (`files_bytes` None).
- The lineage is remembered in `snapshots/<sandbox>/.lineage.json`, updated at every reading (the agent
  reads before every snapshot), and goes with the sandbox's snapshot directory when it is destroyed.
- `node_disk` reports the capacity the node can really use: on a sparse loop image, free space is the
  smaller of the image's and the host filesystem's, so a nearly full host is seen even if the image is not.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any

from space.core import errors
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import DiskParams, StorageParams
from space.node.helper.usage import usage_records
from space.node.volumes import btrfs, btrfs_quota

LINEAGE_FILE = ".lineage.json"


def allocated_bytes(root: pathlib.Path) -> int:
    """Bytes the files under `root` occupy on disk (blocks, so sparse files count what they hold)."""
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def _qgroup_id(name: object) -> int | None:
    if isinstance(name, str) and name.startswith("0/") and name[2:].isdigit():
        return int(name[2:])
    return None


def _lineage(ctx: HelperContext, sandbox_id: str) -> set[int]:
    """The qgroup ids of every subvolume the sandbox's data may be charged to (remembered + present)."""
    snapdir = ctx.layout.snapshots_root / sandbox_id
    path = snapdir / LINEAGE_FILE
    remembered: set[int] = set()
    with contextlib.suppress(OSError, ValueError, TypeError):
        remembered = {int(i) for i in json.loads(path.read_text())}
    found = set(remembered)
    rootfs = ctx.layout.rootfs(sandbox_id)
    if btrfs.is_subvolume(rootfs):
        found.add(btrfs.subvolume_id(rootfs))
    for snap in snapdir.iterdir() if snapdir.is_dir() else []:
        if btrfs.is_subvolume(snap):
            found.add(btrfs.subvolume_id(snap))
    for record in usage_records(ctx, sandbox_id).values():
        qgroup = _qgroup_id(record.get("rootfs_qgroup"))
        if qgroup is not None:
            found.add(qgroup)
    if found != remembered and (snapdir.is_dir() or btrfs.is_subvolume(rootfs)):
        snapdir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(sorted(found)))
        os.replace(tmp, path)
    return found


def sandbox_storage(ctx: HelperContext, params: StorageParams, _progress: Progress) -> dict[str, Any]:
    """{"used_bytes", "files_bytes", "images_bytes", "snapshots", "quota_mode"} of one sandbox."""
    sandbox_id = params.sandbox_id
    fs = ctx.layout.fs
    if not ctx.layout.bundle(sandbox_id).exists() and not (ctx.layout.snapshots_root / sandbox_id).exists():
        raise errors.NotFound(f"sandbox {sandbox_id} has nothing on this node")
    images = allocated_bytes(ctx.layout.checkpoints_root / sandbox_id)
    snapdir = ctx.layout.snapshots_root / sandbox_id
    count = sum(1 for p in snapdir.iterdir() if btrfs.is_subvolume(p)) if snapdir.is_dir() else 0
    mode = btrfs_quota.quota_mode(fs)
    files: int | None = None
    if mode is not None:
        if params.sync:
            btrfs.sync(fs)  # accounting happens at commit: one commit, then every qgroup is current
        files = 0
        for qgroup in _lineage(ctx, sandbox_id):
            usage = btrfs_quota.qgroup_usage_by_id(fs, qgroup)
            files += usage.exclusive if usage is not None else 0
    return {
        "used_bytes": (files or 0) + images,
        "files_bytes": files,
        "images_bytes": images,
        "snapshots": count,
        "quota_mode": mode,
    }


def node_disk(ctx: HelperContext, _params: DiskParams, _progress: Progress) -> dict[str, Any]:
    """{"total_bytes", "free_bytes", "fs_total_bytes"}: the usable capacity and free space of the node's
    filesystem (bytes an unprivileged writer may use, f_bavail)."""
    fs = ctx.layout.fs
    try:
        own = os.statvfs(fs)
    except OSError as exc:
        raise errors.Unavailable(f"cannot read the free space of {fs}: {exc}") from exc
    fs_total = own.f_blocks * own.f_frsize
    fs_free = own.f_bavail * own.f_frsize
    free = fs_free
    if ctx.layout.image.exists():
        # A sparse image grows on the host as it fills: the host's free space bounds it too.
        with contextlib.suppress(OSError):
            host = os.statvfs(ctx.layout.data_dir)
            free = min(free, host.f_bavail * host.f_frsize)
    in_use = max(0, fs_total - fs_free)
    return {"total_bytes": min(fs_total, in_use + free), "free_bytes": free, "fs_total_bytes": fs_total}
