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
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from space.core import errors
from space.core.ids import SANDBOX_ID_PATTERN, SNAPSHOT_ID_PATTERN, TEMPLATE_NAME_PATTERN
from space.core.settings import SandboxLimits
from space.node.helper import oci
from space.node.helper.runsc import Runsc
from space.node.layout import NodeLayout
from space.node.volumes import btrfs, filesystem, templates


def _anchored(pattern: str) -> str:
    # pydantic's `pattern` matches anywhere in the string; ids must match whole.
    return f"^(?:{pattern})$"


SandboxId = Annotated[str, StringConstraints(pattern=_anchored(SANDBOX_ID_PATTERN))]
SnapshotId = Annotated[str, StringConstraints(pattern=_anchored(SNAPSHOT_ID_PATTERN))]
TemplateName = Annotated[str, StringConstraints(pattern=_anchored(TEMPLATE_NAME_PATTERN))]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
EnvValue = Annotated[str, StringConstraints(max_length=32768, pattern=r"^[^\x00]*$")]

Progress = Callable[[str], None]
SOCKET_WAIT_S = 10.0
HOLDER_EXIT_WAIT_S = 30.0


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoParams(Params):
    pass


class TemplateParams(Params):
    name: TemplateName = "python"


class TemplateReceiveParams(Params):
    name: TemplateName
    stream: str = Field(description="a btrfs send stream inside the data directory")


class SandboxParams(Params):
    sandbox_id: SandboxId


class CreateParams(Params):
    sandbox_id: SandboxId
    template: TemplateName = "python"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)


class SnapshotParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class CheckpointParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    keep_running: bool = True


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
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)
    _holders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())


Handler = Callable[[HelperContext, Any, Progress], dict[str, Any]]


@dataclass(frozen=True)
class Verb:
    name: str
    params: type[Params]
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
    return {"fs": str(fs.root), "quota": btrfs.quota_mode(fs.root)}


def template_ensure(ctx: HelperContext, params: TemplateParams, progress: Progress) -> dict[str, Any]:
    with ctx.lock(f"template:{params.name}"):
        info = templates.ensure_template(ctx.layout.fs, params.name, progress=progress)
    return {"name": params.name, "path": str(info.path), "metadata": info.metadata}


def template_receive(
    ctx: HelperContext, params: TemplateReceiveParams, _progress: Progress
) -> dict[str, Any]:
    """Install a template from a `btrfs send` stream (how templates travel between nodes)."""
    stream = ctx.layout.confine(params.stream)
    if not stream.is_file():
        raise errors.NotFound(f"stream {params.stream!r} does not exist", field="stream")
    dest = ctx.layout.template(params.name)
    with ctx.lock(f"template:{params.name}"):
        if dest.exists():
            raise errors.AlreadyExists(f"template {params.name!r} is already on this node")
        staging = ctx.layout.templates / f".incoming-{params.name}"
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        received = btrfs.receive(stream, staging)
        received.rename(dest)
        staging.rmdir()
    return {"name": params.name, "path": str(dest)}


# -- sandbox runtime --------------------------------------------------------------------------------


def _holder_alive(ctx: HelperContext, sandbox_id: str) -> bool:
    info_path = ctx.layout.run_dir(sandbox_id) / "holder.json"
    if not ctx.layout.channel_socket(sandbox_id).exists() or not info_path.exists():
        return False
    try:
        pid = int(json.loads(info_path.read_text())["holder_pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return False
    return True


def _spawn_holder(ctx: HelperContext, sandbox_id: str, runtime_argv: list[str]) -> str:
    run_dir = ctx.layout.run_dir(sandbox_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o755)
    socket_path = ctx.layout.channel_socket(sandbox_id)
    for stale in ("exit.json", "holder.json", "channel.sock"):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / stale).unlink()
    log_path = run_dir / "runtime.log"
    src_dir = pathlib.Path(__file__).resolve().parents[3]
    # -S: the holder needs nothing from site-packages, and its start-up time is part of sandbox creation.
    boot = (
        f"import sys; sys.path.insert(0, {str(src_dir)!r}); "
        "from space.node.helper.holder import main; raise SystemExit(main())"
    )
    with open(log_path, "ab") as log:
        holder = subprocess.Popen(
            [sys.executable, "-S", "-c", boot, str(socket_path), str(ctx.owner_uid), str(log_path), "--",
             *runtime_argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
            close_fds=True,
        )  # fmt: skip
    ctx._holders[sandbox_id] = holder
    threading.Thread(target=holder.wait, name=f"reap-{sandbox_id}", daemon=True).start()
    deadline = time.monotonic() + SOCKET_WAIT_S
    while not socket_path.exists():
        if holder.poll() is not None:
            raise errors.RuntimeFailure(f"holder of {sandbox_id} exited early: {_log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise errors.RuntimeFailure(f"holder of {sandbox_id} did not open its socket")
        time.sleep(0.001)
    return str(socket_path)


def _log_tail(path: pathlib.Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_holder_exit(ctx: HelperContext, sandbox_id: str, timeout: float = HOLDER_EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while _holder_alive(ctx, sandbox_id):
        if time.monotonic() > deadline:
            raise errors.RuntimeFailure(f"runtime of {sandbox_id} did not exit")
        time.sleep(0.002)


def _runtime_status(ctx: HelperContext, sandbox_id: str) -> str:
    """'running', 'paused', 'created' or 'stopped' per runsc; 'absent' if runsc does not know it."""
    state = ctx.runsc.state(sandbox_id)
    if state is None:
        return "absent"
    return str(state.get("status", "unknown"))


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
    bundle.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(template_path, rootfs, readonly=False)
    btrfs.set_limit(rootfs, params.limits.disk_mb << 20)
    (bundle / "limits.json").write_text(params.limits.model_dump_json())
    config = oci.bundle_config(
        sandbox_id=params.sandbox_id,
        rootfs=rootfs,
        init_argv=argv,
        init_env={**env, **params.env},
        limits=params.limits,
    )
    oci.write_bundle_config(bundle, config)
    return {"bundle": str(bundle)}


def sandbox_start(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    bundle = ctx.layout.bundle(params.sandbox_id)
    if not (bundle / "config.json").exists():
        raise errors.NotFound(f"sandbox {params.sandbox_id} has no bundle on this node")
    if _holder_alive(ctx, params.sandbox_id):
        return {"socket": str(ctx.layout.channel_socket(params.sandbox_id)), "already_running": True}
    _forget_runtime(ctx, params.sandbox_id)
    socket_path = _spawn_holder(ctx, params.sandbox_id, ctx.runsc.run_argv(bundle, params.sandbox_id))
    return {"socket": socket_path, "already_running": False}


def sandbox_pause(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    status = _runtime_status(ctx, params.sandbox_id)
    if status == "paused":
        return {"status": status}
    if status != "running":
        raise errors.InvalidState(f"runtime of {params.sandbox_id} is {status}", state=status, event="pause")
    ctx.runsc.pause(params.sandbox_id)
    return {"status": "paused"}


def sandbox_resume(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    status = _runtime_status(ctx, params.sandbox_id)
    if status == "running":
        return {"status": status}
    if status != "paused":
        raise errors.InvalidState(f"runtime of {params.sandbox_id} is {status}", state=status, event="resume")
    ctx.runsc.resume(params.sandbox_id)
    return {"status": "running"}


def _forget_runtime(ctx: HelperContext, sandbox_id: str) -> None:
    """Make runsc forget a container that is no longer running, so its id can be used again."""
    if _runtime_status(ctx, sandbox_id) != "absent":
        with contextlib.suppress(errors.RuntimeFailure):
            ctx.runsc.delete(sandbox_id)


def _stop_runtime(ctx: HelperContext, sandbox_id: str) -> None:
    status = _runtime_status(ctx, sandbox_id)
    if status == "paused":
        with contextlib.suppress(errors.RuntimeFailure):
            ctx.runsc.resume(sandbox_id)  # a paused sandbox does not act on SIGKILL until resumed
    if status in {"running", "paused", "created"}:
        with contextlib.suppress(errors.RuntimeFailure):
            ctx.runsc.kill(sandbox_id)
    _forget_runtime(ctx, sandbox_id)
    _wait_holder_exit(ctx, sandbox_id)


def sandbox_stop(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    _stop_runtime(ctx, params.sandbox_id)
    return {"status": "stopped"}


def sandbox_checkpoint(ctx: HelperContext, params: CheckpointParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    status = _runtime_status(ctx, sandbox_id)
    if status != "running":
        raise errors.InvalidState(
            f"runtime of {sandbox_id} is {status}; only a running sandbox can be checkpointed",
            state=status, event="checkpoint",
        )  # fmt: skip
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    if image.exists() or disk.exists():
        raise errors.AlreadyExists(f"snapshot {snapshot_id} of {sandbox_id} already exists")
    image.mkdir(parents=True)
    disk.parent.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.monotonic()
    ctx.runsc.checkpoint(sandbox_id, image)  # the container stops once its state is saved
    timings["checkpoint_ms"] = (time.monotonic() - started) * 1000
    mark = time.monotonic()
    btrfs.snapshot(ctx.layout.rootfs(sandbox_id), disk, readonly=True)
    timings["disk_snapshot_ms"] = (time.monotonic() - mark) * 1000
    _forget_runtime(ctx, sandbox_id)
    _wait_holder_exit(ctx, sandbox_id)
    image_bytes = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
    result: dict[str, Any] = {"image": str(image), "disk": str(disk), "image_bytes": image_bytes}
    if params.keep_running:
        mark = time.monotonic()
        bundle = ctx.layout.bundle(sandbox_id)
        result["socket"] = _spawn_holder(ctx, sandbox_id, ctx.runsc.restore_argv(bundle, image, sandbox_id))
        timings["restore_spawn_ms"] = (time.monotonic() - mark) * 1000
    result["timings"] = timings
    return result


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
    if source != sandbox_id:
        source_config = ctx.layout.bundle(source) / "config.json"
        if not source_config.exists():
            raise errors.NotFound(f"sandbox {source} has no bundle on this node")
        config = json.loads(source_config.read_text())
    else:
        config = json.loads((bundle / "config.json").read_text())
        _stop_runtime(ctx, sandbox_id)
    bundle.mkdir(parents=True, exist_ok=True)
    if btrfs.is_subvolume(rootfs):
        btrfs.delete_subvolume(rootfs)
    btrfs.snapshot(disk, rootfs, readonly=False)
    limits = params.limits or _limits(ctx, source)
    btrfs.set_limit(rootfs, limits.disk_mb << 20)
    (bundle / "limits.json").write_text(limits.model_dump_json())
    config["linux"]["resources"] = oci.bundle_config(
        sandbox_id=sandbox_id, rootfs=rootfs, init_argv=[], init_env={}, limits=limits
    )["linux"]["resources"]
    config["root"]["path"] = str(rootfs)
    config["linux"]["cgroupsPath"] = f"/space/{sandbox_id}"
    oci.write_bundle_config(bundle, config)
    _forget_runtime(ctx, sandbox_id)
    socket_path = _spawn_holder(ctx, sandbox_id, ctx.runsc.restore_argv(bundle, image, sandbox_id))
    return {"socket": socket_path}


def _limits(ctx: HelperContext, sandbox_id: str) -> SandboxLimits:
    path = ctx.layout.bundle(sandbox_id) / "limits.json"
    return SandboxLimits.model_validate_json(path.read_text()) if path.exists() else SandboxLimits()


def sandbox_disk_snapshot(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if disk.exists():
        raise errors.AlreadyExists(f"snapshot {params.snapshot_id} of {params.sandbox_id} already exists")
    disk.parent.mkdir(parents=True, exist_ok=True)
    btrfs.snapshot(ctx.layout.rootfs(params.sandbox_id), disk, readonly=True)
    return {"disk": str(disk)}


def sandbox_reset_rootfs(ctx: HelperContext, params: ResetParams, _progress: Progress) -> dict[str, Any]:
    """Replace a stopped sandbox's files by a disk snapshot (rollback of files; the caller restarts it)."""
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"snapshot {params.snapshot_id} of {params.sandbox_id} is not on this node")
    status = _runtime_status(ctx, params.sandbox_id)
    if status not in {"absent", "stopped"} or _holder_alive(ctx, params.sandbox_id):
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
    _stop_runtime(ctx, sandbox_id)
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
    _remove_cgroups(sandbox_id)
    return {}


def _remove_cgroups(sandbox_id: str) -> None:
    """runsc removes its cgroups on delete; this sweeps up after a runtime that was killed hard."""
    base = pathlib.Path("/sys/fs/cgroup")
    for controller_dir in base.iterdir() if base.exists() else []:
        leaf = controller_dir / "space" / sandbox_id
        if leaf.is_dir():
            with contextlib.suppress(OSError):
                leaf.rmdir()


def sandbox_state(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    sandbox_id = params.sandbox_id
    exit_path = ctx.layout.run_dir(sandbox_id) / "exit.json"
    exit_info = json.loads(exit_path.read_text()) if exit_path.exists() else None
    return {
        "sandbox_id": sandbox_id,
        "exists": ctx.layout.bundle(sandbox_id).exists(),
        "runtime": _runtime_status(ctx, sandbox_id),
        "holder": _holder_alive(ctx, sandbox_id),
        "socket": str(ctx.layout.channel_socket(sandbox_id)),
        "exit": exit_info,
    }


def sandbox_list(ctx: HelperContext, _params: NoParams, _progress: Progress) -> dict[str, Any]:
    found = []
    root = ctx.layout.sandboxes
    for entry in sorted(root.iterdir()) if root.exists() else []:
        found.append(sandbox_state(ctx, SandboxParams(sandbox_id=entry.name), _progress))
    return {"sandboxes": found}


def sandbox_usage(ctx: HelperContext, params: SandboxParams, _progress: Progress) -> dict[str, Any]:
    memory = pathlib.Path("/sys/fs/cgroup/memory/space") / params.sandbox_id / "memory.usage_in_bytes"
    try:
        memory_bytes: int | None = int(memory.read_text())
    except (OSError, ValueError):
        memory_bytes = None
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    disk = btrfs.exclusive_bytes(rootfs) if btrfs.is_subvolume(rootfs) else None
    return {"memory_bytes": memory_bytes, "disk_exclusive_bytes": disk}


def snapshot_usage(ctx: HelperContext, params: SnapshotParams, _progress: Progress) -> dict[str, Any]:
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"snapshot {params.snapshot_id} of {params.sandbox_id} is not on this node")
    return {"exclusive_bytes": btrfs.exclusive_bytes(disk), "referenced_bytes": btrfs.referenced_bytes(disk)}


def node_teardown(ctx: HelperContext, _params: NoParams, progress: Progress) -> dict[str, Any]:
    """Destroy every sandbox and unmount the node's filesystem (tests, `space down --purge`)."""
    destroyed = []
    root = ctx.layout.sandboxes
    for entry in sorted(root.iterdir()) if root.exists() else []:
        params = SandboxParams(sandbox_id=entry.name)
        with ctx.lock(entry.name):
            sandbox_destroy(ctx, params, progress)
        destroyed.append(entry.name)
    filesystem.unmount_btrfs(ctx.layout.data_dir)
    return {"destroyed": destroyed}


VERBS: dict[str, Verb] = {
    verb.name: verb
    for verb in (
        Verb("node.prepare", NoParams, node_prepare),
        Verb("node.teardown", NoParams, node_teardown),
        Verb("template.ensure", TemplateParams, template_ensure),
        Verb("template.receive", TemplateReceiveParams, template_receive),
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
        Verb("sandbox.list", NoParams, sandbox_list),
        Verb("snapshot.delete", SnapshotParams, snapshot_delete, sandbox_scoped=True),
        Verb("snapshot.usage", SnapshotParams, snapshot_usage),
    )
}
