"""What a disk snapshot costs on the node's disk, and the usage records that answer it under simple quotas.

Full qgroups answer directly (the snapshot's exclusive bytes). Simple quotas charge every extent to the
subvolume that allocated it, so a snapshot (which allocates nothing) always shows ~0: there, what a snapshot
pins is what the sandbox wrote between the previous snapshot and it, read from the root filesystem's qgroup
at snapshot time (the snapshot's commit made those numbers current, so no extra sync is paid).

Invariants:
- A snapshot's usage record `snapshots/<sandbox>/.<snapshot>.usage.json` is written (atomically) right after
  the snapshot is taken, and counts only while the snapshot's subvolume exists.
- Without quotas no record is written and a snapshot is still taken: sizes are then unknown, not wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from typing import Any

from space.core import errors
from space.node.helper.context import HelperContext
from space.node.volumes import btrfs, btrfs_quota


def write_json(path: pathlib.Path, data: dict[str, Any], uid: int | None = None) -> None:
    """Replace `path` by `data` atomically (a reader sees the old or the new file, never a torn one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    if uid is not None:
        os.chown(tmp, uid, -1)
    tmp.replace(path)


def usage_file(ctx: HelperContext, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
    return ctx.layout.snapshots_root / sandbox_id / f".{snapshot_id}.usage.json"


def record_snapshot_usage(ctx: HelperContext, sandbox_id: str, snapshot_id: str) -> None:
    rootfs = ctx.layout.rootfs(sandbox_id)
    try:
        usage = btrfs_quota.qgroup_usage(rootfs, sync_first=False)
    except errors.SpaceError:
        return  # no quotas: the listing reports no size rather than failing the snapshot
    record = {"rootfs_exclusive": usage.exclusive, "rootfs_qgroup": usage.qgroup, "taken_at": time.time()}
    write_json(usage_file(ctx, sandbox_id, snapshot_id), record)


def snapshot_cost(ctx: HelperContext, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    if not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"snapshot {snapshot_id} of {sandbox_id} is not on this node")
    own = btrfs_quota.qgroup_usage(disk)
    mode = btrfs_quota.quota_mode(disk)
    result = {"exclusive_bytes": own.exclusive, "referenced_bytes": own.referenced,
              "qgroup_exclusive_bytes": own.exclusive, "quota_mode": mode}  # fmt: skip
    if mode != "simple":
        return result
    records = usage_records(ctx, sandbox_id)
    mine = records.get(snapshot_id)
    if mine is None:
        return result  # e.g. a received snapshot: it allocated its own delta, so its qgroup is right
    earlier = [r for r in records.values() if r["taken_at"] < mine["taken_at"]]
    previous = max(earlier, key=lambda r: r["taken_at"]) if earlier else None
    cost = int(mine["rootfs_exclusive"])
    if previous is not None and previous.get("rootfs_qgroup") == mine.get("rootfs_qgroup"):
        cost = max(0, cost - int(previous["rootfs_exclusive"]))
    result["exclusive_bytes"] = cost
    return result


def usage_records(ctx: HelperContext, sandbox_id: str) -> dict[str, dict[str, Any]]:
    """Usage records of the sandbox's snapshots that still exist."""
    found: dict[str, dict[str, Any]] = {}
    root = ctx.layout.snapshots_root / sandbox_id
    for path in root.glob(".*.usage.json") if root.is_dir() else []:
        snapshot_id = path.name[1 : -len(".usage.json")]
        if not btrfs.is_subvolume(root / snapshot_id):
            continue
        with contextlib.suppress(OSError, json.JSONDecodeError, TypeError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict):
                record["taken_at"] = float(record["taken_at"])
                found[snapshot_id] = record
    return found
