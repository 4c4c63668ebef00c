"""Verb handlers for a sandbox's life on this node: create, start, pause, resume, stop, destroy, and what
the node knows of it (state, list, usage).

Invariants:
- Every path comes from NodeLayout and validated ids (space.node.helper.params).
- `create` of an existing sandbox is refused before anything is written; `destroy` converges: it removes
  whatever is left (runtime, network slot, snapshots, checkpoints, root filesystem, bundle, staging) and a
  repeat finds nothing to do.
- The bundle's `limits.json` and `spec.json` are what the sandbox was created with; they are read back by
  restore, rollback and `state`.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
from typing import Any

from space.core import errors
from space.core.settings import SandboxLimits
from space.node.helper import oci, staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import ConfigureParams, CreateParams, NoParams, SandboxParams
from space.node.helper.warm import warm_ready
from space.node.volumes import btrfs, btrfs_quota, templates


def _init_argv_env(ctx: HelperContext, template: str) -> tuple[list[str], dict[str, str]]:
    if not btrfs.is_subvolume(ctx.layout.template(template)):
        raise errors.NotFound(f"template {template!r} is not on this node", template=template)
    # The template's default user, workdir and env (ADR 0057) travel in the daemon's boot environment.
    return templates.guest_command(), templates.guest_environment(ctx.layout.templates, template)


def _write_spec(
    ctx: HelperContext, sandbox_id: str, template: str, env: dict[str, str], limits: SandboxLimits
) -> None:
    """The bundle's spec.json and config.json: what `state` reports and what a boot starts with."""
    bundle = ctx.layout.bundle(sandbox_id)
    argv, base_env = _init_argv_env(ctx, template)
    (bundle / "spec.json").write_text(json.dumps({"template": template, "env": env}))
    config = oci.bundle_config(
        rootfs=ctx.layout.rootfs(sandbox_id), init_argv=argv, init_env={**base_env, **env}, limits=limits
    )
    oci.write_bundle_config(bundle, config)


def sandbox_create(ctx: HelperContext, params: CreateParams, _progress: Progress) -> dict[str, Any]:
    template_path = ctx.layout.template(params.template)
    bundle = ctx.layout.bundle(params.sandbox_id)
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    _init_argv_env(ctx, params.template)  # NotFound before anything is written
    if btrfs.is_subvolume(rootfs):
        raise errors.AlreadyExists(f"sandbox {params.sandbox_id} already has a root filesystem")
    warm = ctx.layout.warm(params.template)
    use_warm = params.warm and warm_ready(ctx, params.template)
    bundle.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(warm / "rootfs" if use_warm else template_path, rootfs, readonly=False)
    btrfs_quota.set_limit(rootfs, params.limits.disk_mb << 20)
    (bundle / "limits.json").write_text(params.limits.model_dump_json())
    _write_spec(ctx, params.sandbox_id, params.template, dict(params.env), params.limits)
    if use_warm:
        # Restored, not booted: the daemon comes up already initialised, so the sandbox answers sooner. The
        # config above (with the caller's env) is what a later `start` boots with.
        return {"bundle": str(bundle), "socket": ctx.runtimes.launch(params.sandbox_id, warm / "image")}
    return {"bundle": str(bundle)}


def sandbox_configure(ctx: HelperContext, params: ConfigureParams, _progress: Progress) -> dict[str, Any]:
    """Give an existing sandbox the environment its later boots start with (a pooled sandbox, bound to its
    user: its running processes get it from the agent, through the daemon). Template and limits stay."""
    bundle = ctx.layout.bundle(params.sandbox_id)
    if not (bundle / "config.json").exists():
        raise errors.NotFound(f"sandbox {params.sandbox_id} has no bundle on this node")
    template = str(_spec(ctx, params.sandbox_id)["template"])
    _write_spec(ctx, params.sandbox_id, template, dict(params.env), stored_limits(ctx, params.sandbox_id))
    return {}


def sandbox_start(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id = params.sandbox_id
    if not (ctx.layout.bundle(sandbox_id) / "config.json").exists():
        raise errors.NotFound(f"sandbox {sandbox_id} has no bundle on this node")
    if ctx.runtimes.holder_alive(sandbox_id):
        return {"socket": str(ctx.layout.channel_socket(sandbox_id)), "already_running": True}
    ctx.runtimes.stop(sandbox_id)  # retires a leftover stopped container, if any
    return {"socket": ctx.runtimes.launch(sandbox_id), "already_running": False}


def sandbox_pause(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    if ctx.runtimes.status(params.sandbox_id) == "paused":
        return {"status": "paused"}
    ctx.runtimes.pause(params.sandbox_id)
    return {"status": "paused"}


def sandbox_resume(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    if ctx.runtimes.status(params.sandbox_id) == "running":
        return {"status": "running"}
    ctx.runtimes.resume(params.sandbox_id)
    return {"status": "running"}


def sandbox_stop(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    ctx.runtimes.stop(params.sandbox_id)
    return {"status": "stopped"}


def sandbox_discard(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    """Stop a sandbox whose files are replaced next (a rollback): its processes SIGKILLed (ADR 0077)."""
    ctx.runtimes.discard(params.sandbox_id)
    return {"status": "stopped"}


def sandbox_destroy(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id = params.sandbox_id
    ctx.runtimes.stop(sandbox_id)
    ctx.runtimes.settle(sandbox_id)
    if ctx.network is not None:
        ctx.network.release(sandbox_id)
    snapshots_dir = ctx.layout.snapshots_root / sandbox_id
    if snapshots_dir.exists():
        for snap in snapshots_dir.iterdir():
            if btrfs.is_subvolume(snap):
                btrfs.delete_subvolume(snap)
        shutil.rmtree(snapshots_dir, ignore_errors=True)
    shutil.rmtree(ctx.layout.checkpoints_root / sandbox_id, ignore_errors=True)
    rootfs = ctx.layout.rootfs(sandbox_id)
    if btrfs.is_subvolume(rootfs):
        btrfs.delete_subvolume(rootfs)
    shutil.rmtree(ctx.layout.bundle(sandbox_id), ignore_errors=True)
    shutil.rmtree(ctx.layout.run_dir(sandbox_id), ignore_errors=True)
    staging.discard_sandbox_staging(ctx, sandbox_id)
    return {}


def _spec(ctx: HelperContext, sandbox_id: str) -> dict[str, Any]:
    try:
        spec = json.loads((ctx.layout.bundle(sandbox_id) / "spec.json").read_text())
    except (OSError, json.JSONDecodeError):
        spec = {}
    return {"template": spec.get("template", "python"), "env": spec.get("env", {}),
            "limits": stored_limits(ctx, sandbox_id).model_dump()}  # fmt: skip


def sandbox_state(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id = params.sandbox_id
    return {
        "spec": _spec(ctx, sandbox_id),
        "sandbox_id": sandbox_id,
        "exists": ctx.layout.bundle(sandbox_id).exists(),
        "runtime": ctx.runtimes.status(sandbox_id),
        "holder": ctx.runtimes.holder_alive(sandbox_id),
        "container": ctx.runtimes.container(sandbox_id),
        "socket": str(ctx.layout.channel_socket(sandbox_id)),
        "exit": ctx.runtimes.exit_info(sandbox_id),
    }


def sandbox_list(ctx: HelperContext, _params: NoParams, progress: Progress) -> dict[str, Any]:
    root = ctx.layout.sandboxes
    entries = sorted(root.iterdir()) if root.exists() else []
    return {"sandboxes": [sandbox_state(ctx, SandboxParams(sandbox_id=e.name), progress) for e in entries]}


def sandbox_usage(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    cgroup = ctx.runtimes.cgroup_name(params.sandbox_id)
    memory_bytes: int | None = None
    if cgroup is not None:
        with contextlib.suppress(OSError, ValueError):
            memory_bytes = int(
                (pathlib.Path("/sys/fs/cgroup/memory") / cgroup / "memory.usage_in_bytes").read_text()
            )
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    disk = btrfs_quota.exclusive_bytes(rootfs) if btrfs.is_subvolume(rootfs) else None
    return {"memory_bytes": memory_bytes, "disk_exclusive_bytes": disk, "cgroup": cgroup}


def tree_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def stored_limits(ctx: HelperContext, sandbox_id: str) -> SandboxLimits:
    path = ctx.layout.bundle(sandbox_id) / "limits.json"
    return SandboxLimits.model_validate_json(path.read_text()) if path.exists() else SandboxLimits()
