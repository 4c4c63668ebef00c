"""Verb handlers for the node as a whole: prepare it (filesystem, quotas, directories, runtimes, network)
and tear it down (every sandbox, the network, the filesystem).

Invariants:
- `node.prepare` converges: every step finds what a previous run made and keeps it. Its one change to the
  machine beyond the data directory, cheap cgroup moves (ADR 0086), is best effort and can be declined.
- `node.teardown` destroys each sandbox under its own lock, then the node's network, then unmounts.
"""

from __future__ import annotations

import os
from typing import Any

from space.node.helper import cgroup_tuning
from space.node.helper.context import HelperContext, Progress
from space.node.helper.microvm import MicroVMs
from space.node.helper.params import NoParams, SandboxParams
from space.node.helper.sandbox_verbs import sandbox_destroy
from space.node.volumes import btrfs_quota, filesystem


def node_prepare(ctx: HelperContext, _params: NoParams, _progress: Progress) -> dict[str, Any]:
    fs = filesystem.ensure_btrfs(ctx.layout.data_dir)
    for path in (
        ctx.layout.templates,
        ctx.layout.sandboxes,
        ctx.layout.snapshots_root,
        ctx.layout.checkpoints_root,
    ):
        path.mkdir(parents=True, exist_ok=True)
    for path in (ctx.layout.run, ctx.layout.runsc_root):
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o755)
    if not fs.quota:
        btrfs_quota.enable_quota(fs.root)
    prepare_agent_dirs(ctx)
    ctx.runtimes.sweep()
    ctx.runtimes.prime()
    net = ctx.network.prepare() if ctx.network is not None else {"mode": "none"}
    moves = cgroup_tuning.favor_dynamic_moves() if ctx.favor_cgroup_moves else "not asked"
    return {
        "fs": str(fs.root),
        "quota": btrfs_quota.quota_mode(fs.root),
        "network": net,
        "cgroup_moves": moves,
    }


def node_teardown(ctx: HelperContext, _params: NoParams, progress: Progress) -> dict[str, Any]:
    """Destroy every sandbox and unmount the node's filesystem (tests, `space down --purge`)."""
    destroyed = []
    root = ctx.layout.sandboxes
    for entry in sorted(root.iterdir()) if root.exists() else []:
        with ctx.lock(entry.name):
            sandbox_destroy(ctx, SandboxParams(sandbox_id=entry.name), progress)
        destroyed.append(entry.name)
    destroyed += MicroVMs(ctx.layout, ctx.owner_uid).destroy_all()  # the qemu driver's (ADR 0068)
    ctx.runtimes.sweep()
    if ctx.network is not None:
        ctx.network.teardown()
    filesystem.unmount_btrfs(ctx.layout.data_dir)
    return {"destroyed": destroyed}


def prepare_agent_dirs(ctx: HelperContext) -> None:
    """The directories the agent keeps its own state in, owned by the agent (which cannot create them under
    the root-owned data directory itself): `objects`, the default local object store of a one-machine node
    (harmless when another store is used), `egress`, the egress gateway's CA and policies, and `identity`,
    the node's RPC token and enrolment identity (space.node.agent.identity)."""
    for name in ("objects", "egress", "identity"):
        root = ctx.layout.data_dir / name
        if root.is_symlink():
            continue
        root.mkdir(mode=0o700, exist_ok=True)
        if root.stat().st_uid != ctx.owner_uid:
            os.chown(root, ctx.owner_uid, -1)
