"""The root helper's fixed table of privileged verbs, and nothing else.

Invariants:
- A verb exists only if it is in VERBS. Its arguments are parsed by a pydantic model with extra fields
  forbidden; ids are checked against space.core.ids' patterns, names against the template pattern, and
  the only path argument is confined to the data directory. No argument ever reaches a shell.
- Every path is derived by NodeLayout from validated ids.
- Verbs on one sandbox are serialised by a per-sandbox lock, so two agents (or an agent and its restarted
  self) cannot interleave a checkpoint with a destroy.
- Each verb converges when repeated after a crash: "create" of an existing sandbox and "destroy" of a missing
  one report what is there instead of failing half-way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from space.core import errors
from space.core.settings import SandboxLimits
from space.node.helper import network, oci, storage, transfer
from space.node.helper.params import EnvName, EnvValue, Params, SandboxId, SnapshotId, TemplateName
from space.node.helper.runsc import Runsc
from space.node.helper.runtime import Runtimes
from space.node.layout import NodeLayout
from space.node.volumes import btrfs, filesystem, sendstream, templates

Progress = Callable[[str], None]
SOCKET_WAIT_S = 10.0
HOLDER_EXIT_WAIT_S = 30.0


class NoParams(Params):
    pass


class TemplateParams(Params):
    name: TemplateName = "python"


class TemplateReceiveParams(Params):
    name: TemplateName
    stream: str = Field(description="a btrfs send stream inside the data directory")


class SandboxParams(Params):
    sandbox_id: SandboxId


class AdoptWarmParams(Params):
    name: TemplateName
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class CreateParams(Params):
    sandbox_id: SandboxId
    template: TemplateName = "python"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    warm: bool = False  # start from the template's warm checkpoint when it has one (create + start)


class SnapshotParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class CheckpointParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    keep_running: bool = True
    # Suspend: checkpoint a running or paused sandbox and leave it paused (nothing runs after the moment the
    # checkpoint captured, so the copy that leaves the node is the sandbox's last state).
    leave_paused: bool = False


class RestoreParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    source_sandbox_id: SandboxId | None = None
    limits: SandboxLimits | None = None


class ResetParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


@dataclass
class HelperContext:
    layout: NodeLayout
    runsc: Runsc
    owner_uid: int
    cgroup_parent: str = "space"
    network: network.SandboxNetworks | None = None  # None: sandboxes get no network (NodeSettings.network)
    runtimes: Runtimes = field(init=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.runtimes = Runtimes(self.layout, self.runsc, self.owner_uid, self.cgroup_parent)
        self.runtimes.network = self.network

    def lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())


Handler = Callable[[HelperContext, Any, Progress], dict[str, Any]]


@dataclass(frozen=True)
class Verb:
    name: str
    params: type[BaseModel]  # a Params subclass (or one of another verb module's, same config)
    handler: Handler
    sandbox_scoped: bool = False


# -- node and templates ------------------------------------------------------------------------------


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
        btrfs.enable_quota(fs.root)
    transfer.prepare_agent_dirs(ctx)
    ctx.runtimes.sweep()
    ctx.runtimes.prime()
    net = ctx.network.prepare() if ctx.network is not None else {"mode": "none"}
    return {"fs": str(fs.root), "quota": btrfs.quota_mode(fs.root), "network": net}


def template_ensure(ctx: HelperContext, params: TemplateParams, progress: Progress) -> dict[str, Any]:
    with ctx.lock(f"template:{params.name}"):
        info = templates.ensure_template(ctx.layout.fs, params.name, progress=progress)
    return {"name": params.name, "path": str(info.path), "metadata": info.metadata}


def template_receive(
    ctx: HelperContext, params: TemplateReceiveParams, _progress: Progress
) -> dict[str, Any]:
    """Install a template from a `btrfs send -p <base>` stream (how templates travel between nodes).

    The stream is opened once, beneath the data directory without following any symlink, and must be a
    delta onto this node's template base that creates exactly `params.name` (ADR 0023)."""
    stream_path = ctx.layout.confine(params.stream)
    dest = ctx.layout.template(params.name)
    with (
        ctx.lock(f"template:{params.name}"),
        transfer.open_beneath(ctx.layout.data_dir.resolve(), stream_path) as stream,
    ):
        if btrfs.is_subvolume(dest) or dest.exists():
            raise errors.AlreadyExists(f"template {params.name!r} is already on this node")
        expected = sendstream.Expected.delta(params.name, {transfer.base_identity(ctx)})
        try:
            btrfs.receive(stream, ctx.layout.templates, expected=expected)
        except errors.ArtifactCorrupt as exc:
            raise errors.InvalidArgument(exc.message, **{**exc.details, "field": "stream"}) from exc
    return {"name": params.name, "path": str(dest)}


# -- sandbox runtime --------------------------------------------------------------------------------


def _init_argv_env(ctx: HelperContext, template: str) -> tuple[list[str], dict[str, str]]:
    if not btrfs.is_subvolume(ctx.layout.template(template)):
        raise errors.NotFound(f"template {template!r} is not on this node", template=template)
    return templates.guest_command(), dict(templates.GUEST_ENV)


def sandbox_create(ctx: HelperContext, params: CreateParams, _progress: Progress) -> dict[str, Any]:
    template_path = ctx.layout.template(params.template)
    bundle = ctx.layout.bundle(params.sandbox_id)
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    argv, env = _init_argv_env(ctx, params.template)
    if btrfs.is_subvolume(rootfs):
        raise errors.AlreadyExists(f"sandbox {params.sandbox_id} already has a root filesystem")
    warm = ctx.layout.warm(params.template)
    use_warm = params.warm and _warm_ready(ctx, params.template)
    bundle.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(warm / "rootfs" if use_warm else template_path, rootfs, readonly=False)
    btrfs.set_limit(rootfs, params.limits.disk_mb << 20)
    (bundle / "limits.json").write_text(params.limits.model_dump_json())
    (bundle / "spec.json").write_text(json.dumps({"template": params.template, "env": params.env}))
    config = oci.bundle_config(
        rootfs=rootfs, init_argv=argv, init_env={**env, **params.env}, limits=params.limits
    )
    oci.write_bundle_config(bundle, config)
    if use_warm:
        # Restored, not booted: the daemon comes up already initialised, so the sandbox answers sooner. The
        # config above (with the caller's env) is what a later `start` boots with.
        return {"bundle": str(bundle), "socket": ctx.runtimes.launch(params.sandbox_id, warm / "image")}
    return {"bundle": str(bundle)}


def _template_stamp(ctx: HelperContext, template: str) -> str:
    """Changes whenever the template is rebuilt (its metadata file is rewritten last on every build)."""
    meta = ctx.layout.templates / f"{template}.json"
    try:
        # A checkpoint made with networking restores only with networking (and the reverse).
        mode = b"" if ctx.network is None else b"network=sandbox"
        return hashlib.sha256(meta.read_bytes() + mode).hexdigest()
    except OSError:
        return ""


def _warm_ready(ctx: HelperContext, template: str) -> bool:
    try:
        info = json.loads((ctx.layout.warm(template) / "warm.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(info.get("template_stamp")) and info.get("template_stamp") == _template_stamp(ctx, template)


def template_warm_status(ctx: HelperContext, params: TemplateParams, _progress: Progress) -> dict[str, Any]:
    return {"name": params.name, "ready": _warm_ready(ctx, params.name)}


def template_adopt_warm(ctx: HelperContext, params: AdoptWarmParams, progress: Progress) -> dict[str, Any]:
    """Turn a full checkpoint of a freshly booted sandbox of the template into the template's warm start,
    then destroy that sandbox. warm.json is written last: a half-adopted warm start is never used."""
    image = ctx.layout.checkpoint_image(params.sandbox_id, params.snapshot_id)
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if not image.is_dir() or not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"checkpoint {params.snapshot_id} of {params.sandbox_id} is not on this node")
    with ctx.lock(f"template:{params.name}"):
        warm = ctx.layout.warm(params.name)
        _discard_warm(ctx, params.name)
        warm.mkdir(parents=True)
        with ctx.lock(params.sandbox_id):
            ctx.runtimes.stop(params.sandbox_id)
            image.rename(warm / "image")
            btrfs.snapshot(disk, warm / "rootfs", readonly=True)  # a read-only subvolume cannot be moved
            shutil.copy2(ctx.layout.bundle(params.sandbox_id) / "config.json", warm / "config.json")
            sandbox_destroy(ctx, SandboxParams(sandbox_id=params.sandbox_id), progress)
        (warm / "warm.json").write_text(json.dumps({"template_stamp": _template_stamp(ctx, params.name)}))
    return {"name": params.name, "ready": True}


def _discard_warm(ctx: HelperContext, template: str) -> None:
    warm = ctx.layout.warm(template)
    if not warm.exists():
        return
    (warm / "warm.json").unlink(missing_ok=True)
    if btrfs.is_subvolume(warm / "rootfs"):
        btrfs.delete_subvolume(warm / "rootfs")
    shutil.rmtree(warm, ignore_errors=True)


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
    container = ctx.runtimes.require(params.sandbox_id, "running", event="pause")
    ctx.runsc.pause(container)
    return {"status": "paused"}


def sandbox_resume(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    if ctx.runtimes.status(params.sandbox_id) == "running":
        return {"status": "running"}
    container = ctx.runtimes.require(params.sandbox_id, "paused", event="resume")
    ctx.runsc.resume(container)
    return {"status": "running"}


def sandbox_stop(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    ctx.runtimes.stop(params.sandbox_id)
    return {"status": "stopped"}


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
    # Paused from the moment the state is saved until the disk snapshot is taken, so the memory image and
    # the files are one consistent moment: whatever runsc flushes while saving is in the snapshot, and no
    # process can write after it. `--leave-running` keeps the same runtime (and channel) afterwards.
    mark = time.monotonic()
    try:
        if ctx.runtimes.status(sandbox_id) != "paused":
            ctx.runsc.pause(container)
        try:
            timings["pause_ms"] = (time.monotonic() - mark) * 1000
            mark = time.monotonic()
            ctx.runsc.checkpoint(container, image, leave_running=True)
            timings["checkpoint_ms"] = (time.monotonic() - mark) * 1000
            mark = time.monotonic()
            btrfs.snapshot(ctx.layout.rootfs(sandbox_id), disk, readonly=True)
            timings["disk_snapshot_ms"] = (time.monotonic() - mark) * 1000
            transfer.record_snapshot_usage(ctx, sandbox_id, snapshot_id)
        finally:
            mark = time.monotonic()
            if not params.leave_paused and ctx.runtimes.status(sandbox_id) == "paused":
                ctx.runsc.resume(container)
            timings["resume_ms"] = (time.monotonic() - mark) * 1000
    except BaseException:
        _discard_partial_checkpoint(ctx, sandbox_id, snapshot_id)
        raise
    image_bytes = _tree_bytes(image)
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
    transfer._usage_file(ctx, sandbox_id, snapshot_id).unlink(missing_ok=True)


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
        ctx.runtimes.stop(sandbox_id)
    elif btrfs.is_subvolume(rootfs):
        raise errors.AlreadyExists(f"sandbox {sandbox_id} already exists on this node")
    bundle.mkdir(parents=True, exist_ok=True)
    if btrfs.is_subvolume(rootfs):
        btrfs.delete_subvolume(rootfs)
    btrfs.snapshot(disk, rootfs, readonly=False)
    limits = params.limits or _limits(ctx, source)
    btrfs.set_limit(rootfs, limits.disk_mb << 20)
    (bundle / "limits.json").write_text(limits.model_dump_json())
    source_spec = ctx.layout.bundle(source) / "spec.json"
    if source != sandbox_id and source_spec.exists():
        (bundle / "spec.json").write_text(source_spec.read_text())
    config["linux"]["resources"] = oci.resources(limits)
    config["root"]["path"] = str(rootfs)
    oci.write_bundle_config(bundle, config)
    return {"socket": ctx.runtimes.launch(sandbox_id, image)}


def _tree_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _limits(ctx: HelperContext, sandbox_id: str) -> SandboxLimits:
    path = ctx.layout.bundle(sandbox_id) / "limits.json"
    return SandboxLimits.model_validate_json(path.read_text()) if path.exists() else SandboxLimits()


def sandbox_disk_snapshot(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if disk.exists():
        raise errors.AlreadyExists(f"snapshot {params.snapshot_id} of {params.sandbox_id} already exists")
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    if not btrfs.is_subvolume(rootfs):
        raise errors.NotFound(f"sandbox {params.sandbox_id} has no root filesystem on this node")
    disk.parent.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(rootfs, disk, readonly=True)
    transfer.record_snapshot_usage(ctx, params.sandbox_id, params.snapshot_id)
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
    btrfs.set_limit(rootfs, _limits(ctx, params.sandbox_id).disk_mb << 20)
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
    transfer.discard_sandbox_staging(ctx, sandbox_id)
    return {}


def _spec(ctx: HelperContext, sandbox_id: str) -> dict[str, Any]:
    try:
        spec = json.loads((ctx.layout.bundle(sandbox_id) / "spec.json").read_text())
    except (OSError, json.JSONDecodeError):
        spec = {}
    return {"template": spec.get("template", "python"), "env": spec.get("env", {}),
            "limits": _limits(ctx, sandbox_id).model_dump()}  # fmt: skip


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
    disk = btrfs.exclusive_bytes(rootfs) if btrfs.is_subvolume(rootfs) else None
    return {"memory_bytes": memory_bytes, "disk_exclusive_bytes": disk, "cgroup": cgroup}


def snapshot_usage(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    """Size on disk of a snapshot: `exclusive_bytes` is what it pins (see transfer.snapshot_cost for the
    meaning under simple quotas), `referenced_bytes` everything it reaches."""
    return transfer.snapshot_cost(ctx, params.sandbox_id, params.snapshot_id)


def snapshot_list(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    """The snapshots on this node's disk, so an agent that restarted can rebuild its records."""
    found = []
    root = ctx.layout.snapshots_root / params.sandbox_id
    for disk in sorted(root.iterdir()) if root.exists() else []:
        if not btrfs.is_subvolume(disk):
            continue
        image = ctx.layout.checkpoint_image(params.sandbox_id, disk.name)
        image_bytes = _tree_bytes(image) if image.is_dir() else 0
        found.append(
            {
                "snapshot_id": disk.name,
                "kind": "full" if image.is_dir() else "disk",
                "created_at": disk.stat().st_mtime,
                "image_bytes": image_bytes,
            }
        )
    return {"snapshots": found}


def node_teardown(ctx: HelperContext, _params: NoParams, progress: Progress) -> dict[str, Any]:
    """Destroy every sandbox and unmount the node's filesystem (tests, `space down --purge`)."""
    destroyed = []
    root = ctx.layout.sandboxes
    for entry in sorted(root.iterdir()) if root.exists() else []:
        with ctx.lock(entry.name):
            sandbox_destroy(ctx, SandboxParams(sandbox_id=entry.name), progress)
        destroyed.append(entry.name)
    ctx.runtimes.sweep()
    if ctx.network is not None:
        ctx.network.teardown()
    filesystem.unmount_btrfs(ctx.layout.data_dir)
    return {"destroyed": destroyed}


VERBS: dict[str, Verb] = {
    verb.name: verb
    for verb in (
        Verb("node.prepare", NoParams, node_prepare),
        Verb("node.teardown", NoParams, node_teardown),
        Verb("template.ensure", TemplateParams, template_ensure),
        Verb("template.receive", TemplateReceiveParams, template_receive),
        Verb("template.warm_status", TemplateParams, template_warm_status),
        Verb("template.adopt_warm", AdoptWarmParams, template_adopt_warm),
        Verb("sandbox.create", CreateParams, sandbox_create, sandbox_scoped=True),
        Verb("sandbox.start", SandboxParams, sandbox_start, sandbox_scoped=True),
        Verb("sandbox.pause", SandboxParams, sandbox_pause, sandbox_scoped=True),
        Verb("sandbox.resume", SandboxParams, sandbox_resume, sandbox_scoped=True),
        Verb("sandbox.stop", SandboxParams, sandbox_stop, sandbox_scoped=True),
        Verb("sandbox.checkpoint", CheckpointParams, sandbox_checkpoint, sandbox_scoped=True),
        Verb("sandbox.restore", RestoreParams, sandbox_restore, sandbox_scoped=True),
        Verb("sandbox.disk_snapshot", SnapshotParams, sandbox_disk_snapshot, sandbox_scoped=True),
        Verb("sandbox.reset_rootfs", ResetParams, sandbox_reset_rootfs, sandbox_scoped=True),
        Verb("sandbox.destroy", SandboxParams, sandbox_destroy, sandbox_scoped=True),
        Verb("sandbox.state", SandboxParams, sandbox_state),
        Verb("sandbox.usage", SandboxParams, sandbox_usage),
        # disk budgets (space.node.helper.storage, docs/adr/0027-disk-budgets.md)
        Verb("sandbox.storage", storage.StorageParams, storage.sandbox_storage),
        Verb("node.disk", storage.DiskParams, storage.node_disk),
        Verb("sandbox.list", NoParams, sandbox_list),
        Verb("snapshot.delete", SnapshotParams, snapshot_delete, sandbox_scoped=True),
        Verb("snapshot.usage", SnapshotParams, snapshot_usage),
        Verb("snapshot.list", SandboxParams, snapshot_list),
        # per-sandbox network namespaces and the node's nftables table (space.node.helper.network)
        Verb("sandbox.network", SandboxParams, network.verb_sandbox_network),
        Verb("network.info", NoParams, network.verb_network_info),
        Verb("network.configure", network.NetworkConfigureParams, network.verb_network_configure),
        # suspend / restore / templates through object storage (space.node.helper.transfer)
        Verb("snapshot.export", transfer.TransferParams, transfer.snapshot_export, sandbox_scoped=True),
        Verb("snapshot.import", transfer.ImportParams, transfer.snapshot_import, sandbox_scoped=True),
        Verb("staging.prepare", transfer.StagingParams, transfer.staging_prepare, sandbox_scoped=True),
        Verb("staging.release", transfer.StagingParams, transfer.staging_release, sandbox_scoped=True),
        Verb("template.base_status", transfer.NoTransferParams, transfer.base_status),
        Verb("template.base_export", transfer.NoTransferParams, transfer.base_export),
        Verb("template.base_import", transfer.NoTransferParams, transfer.base_import),
    )
}
