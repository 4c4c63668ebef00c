"""Checkpoints and the template base leaving and entering a node (root helper verbs).

A full checkpoint leaves a node as three things: the read-only disk snapshot as a `btrfs send -p <base>`
delta (the guest layer and everything the sandbox wrote; the base is the same subvolume on every node, see
space.node.volumes.templates), the runsc checkpoint image directory, and nothing else: the bundle config is
*derived* on the receiving node from the caller's validated spec (template, limits, env), never taken from
the artifact, so an artifact cannot add a mount, a capability or a hook.

Staging: `<fs>/staging/` (root, 0755) holds one directory per transfer, owned by the agent's uid (0700):
  export-<sandbox>-<snapshot>/   written here (disk.stream, image/...), read and uploaded by the agent
  import-<sandbox>-<snapshot>/   written by the agent (downloaded and verified), consumed here
  base-export/, base-import/     the template base's original full send stream
It lies on the node's btrfs filesystem, so image files are reflinked out and renamed in (no copies).

Invariants:
- Every path is derived from validated ids (NodeLayout); the agent names no path. Files the agent wrote are
  opened with O_NOFOLLOW and must be regular files with plain names: a symlink planted in staging cannot
  make the helper read or move anything else.
- An export is complete iff its `export.json` exists (written last); a repeat returns it, an incomplete one
  is rebuilt from scratch.
- An import is repeatable after a crash at any point: a disk subvolume counts as received only once it is
  read-only with a received UUID (what `btrfs receive` sets last), otherwise it is deleted and received
  again; the image directory is moved in by one rename;
  the bundle files are rewritten every time (config last). What is already complete is kept.
- A delta is received only onto the base it was made against (its parent UUID is checked first), and
  nothing is imported for a sandbox whose runtime is alive on this node. Staged streams are opened once
  and read only through that descriptor; `btrfs_receive.receive` confines and checks them (ADR 0023).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import shutil
import stat
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from space.core import errors
from space.node.helper import oci
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import ImportParams, NoTransferParams, StagingParams, TransferParams
from space.node.helper.usage import write_json
from space.node.volumes import btrfs, btrfs_receive, sendstream, template_base, templates

FICLONE = 0x40049409  # _IOW(0x94, 9, int): share the extents of one file with another (reflink)
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_IMAGE_FILES = 256
DISK_STREAM = "disk.stream"
BASE_STREAM = "base.stream"


# -- staging ---------------------------------------------------------------------------------------------
def _staging_dir(
    ctx: HelperContext, kind: str, sandbox_id: str | None, snapshot_id: str | None
) -> pathlib.Path:
    if kind in {"base-export", "base-import"}:
        return ctx.layout.base_export_dir() if kind == "base-export" else ctx.layout.base_import_dir()
    if sandbox_id is None or snapshot_id is None:
        raise errors.InvalidArgument(f"staging of kind {kind!r} needs sandbox_id and snapshot_id")
    if kind == "export":
        return ctx.layout.export_dir(sandbox_id, snapshot_id)
    return ctx.layout.import_dir(sandbox_id, snapshot_id)


def _fresh_dir(ctx: HelperContext, path: pathlib.Path) -> pathlib.Path:
    """An empty directory owned by the agent (0700) under the root-owned staging root."""
    root = ctx.layout.staging
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    os.chown(root, 0, 0)
    _remove(path)
    path.mkdir(mode=0o700)
    os.chown(path, ctx.owner_uid, -1)
    return path


def _remove(path: pathlib.Path) -> None:
    if os.path.islink(path) or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def staging_prepare(ctx: HelperContext, params: StagingParams, _progress: Progress) -> dict[str, Any]:
    if params.kind not in {"import", "base-import"}:
        raise errors.InvalidArgument("only import directories are prepared for the agent", field="kind")
    path = _staging_dir(ctx, params.kind, params.sandbox_id, params.snapshot_id)
    return {"dir": str(_fresh_dir(ctx, path))}


def staging_release(ctx: HelperContext, params: StagingParams, _progress: Progress) -> dict[str, Any]:
    path = _staging_dir(ctx, params.kind, params.sandbox_id, params.snapshot_id)
    existed = path.exists()
    _remove(path)
    return {"released": existed}


def discard_sandbox_staging(ctx: HelperContext, sandbox_id: str) -> None:
    """Every transfer directory of a sandbox (called when it is destroyed)."""
    root = ctx.layout.staging
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith((f"export-{sandbox_id}-", f"import-{sandbox_id}-")):
            _remove(entry)


def _chown_tree(root: pathlib.Path, uid: int) -> None:
    os.lchown(root, uid, -1)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, -1)


def _clone(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Reflink `src` to `dst` (same btrfs filesystem: O(1)); a plain copy where reflinks do not work."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError:
            shutil.copyfileobj(fin, fout, 1 << 20)


@contextlib.contextmanager
def _open_staged(directory: pathlib.Path, name: str) -> Iterator[BinaryIO]:
    """A regular file the agent staged, opened once without following symlinks."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise errors.NotFound(f"{name} was not staged in {directory.name}", field=name) from exc
    try:
        with _open_staged_at(dir_fd, name, name) as f:
            yield f
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _open_staged_at(dir_fd: int, name: str, shown: str) -> Iterator[BinaryIO]:
    """`name` in the directory `dir_fd`: no symlink (O_NOFOLLOW), no FIFO or device (O_NONBLOCK keeps a
    FIFO from hanging the open, then only a regular file is accepted)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise errors.NotFound(f"{shown} does not exist", field=name) from exc
    except OSError as exc:
        raise errors.InvalidArgument(f"{shown} cannot be opened: {exc.strerror}", field=name) from exc
    # Unbuffered: the fd itself is what `btrfs_receive.receive` reads (through its own buffer).
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise errors.InvalidArgument(f"{shown} is not a regular file", field=name)
        os.set_blocking(f.fileno(), True)
        yield f


@contextlib.contextmanager
def open_beneath(root: pathlib.Path, path: pathlib.Path) -> Iterator[BinaryIO]:
    """A regular file below `root`, opened once by walking from `root` one component at a time without
    following any symlink: a directory or file swapped for a link after `path` was checked cannot redirect
    the open (a check-then-open by path could be raced by whoever owns a directory on the way)."""
    try:
        parts = path.relative_to(root).parts
    except ValueError as exc:
        raise errors.InvalidArgument(f"{path} is not inside {root}", field="path") from exc
    if not parts or any(part in ("", ".", "..") for part in parts):
        raise errors.InvalidArgument(f"{path} is not a file inside {root}", field="path")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError as exc:
        raise errors.NotFound(f"{root} cannot be opened: {exc.strerror}", field="path") from exc
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, flags | os.O_DIRECTORY, dir_fd=dir_fd)
            except FileNotFoundError as exc:
                raise errors.NotFound(f"{path} does not exist", field="path") from exc
            except OSError as exc:
                raise errors.InvalidArgument(f"{part!r} on the way to {path} is not a plain directory",
                                             field="path") from exc  # fmt: skip
            os.close(dir_fd)
            dir_fd = next_fd
        with _open_staged_at(dir_fd, parts[-1], str(path)) as f:
            yield f
    finally:
        os.close(dir_fd)


def base_identity(ctx: HelperContext) -> str:
    """The UUID deltas name as their parent when made against this node's template base."""
    return _base(ctx)[1]


def _image_files(image: pathlib.Path) -> list[pathlib.Path]:
    """The files of a checkpoint image directory (flat, plain names, regular files only)."""
    st = os.lstat(image)
    if not stat.S_ISDIR(st.st_mode):
        raise errors.InvalidArgument(f"{image.name} is not a directory")
    files = sorted(image.iterdir())
    if len(files) > MAX_IMAGE_FILES:
        raise errors.InvalidArgument(f"checkpoint image has {len(files)} files (at most {MAX_IMAGE_FILES})")
    for path in files:
        if _FILE_NAME.fullmatch(path.name) is None or not stat.S_ISREG(os.lstat(path).st_mode):
            raise errors.InvalidArgument(f"checkpoint image entry {path.name!r} is not a plain file")
    return files


def _take_ownership(directory: pathlib.Path) -> None:
    """Make a directory the agent staged root's own (0700, files 0600) without following any symlink:
    first the directory, so the agent can no longer add or swap entries, then each plain file."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.InvalidArgument(f"staged {directory.name} is not a plain directory") from exc
    try:
        os.fchown(dir_fd, 0, 0)
        os.fchmod(dir_fd, 0o700)
        for name in os.listdir(dir_fd):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                raise errors.InvalidArgument(f"staged entry {name!r} is not a plain file") from exc
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise errors.InvalidArgument(f"staged entry {name!r} is not a plain file")
                os.fchown(fd, 0, 0)
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


def _base(ctx: HelperContext) -> tuple[pathlib.Path, str]:
    status = template_base.base_status(ctx.layout.templates)
    if not status["present"]:
        raise errors.NotFound(f"the template base {template_base.BASE_NAME} is not on this node")
    return ctx.layout.templates / template_base.BASE_NAME, str(status["identity"])


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


# -- checkpoints -----------------------------------------------------------------------------------------
def snapshot_export(ctx: HelperContext, params: TransferParams, _progress: Progress) -> dict[str, Any]:
    """Stage a full checkpoint for upload: disk.stream (send -p base) and image/<files>."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    if not image.is_dir() or not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"full checkpoint {snapshot_id} of {sandbox_id} is not on this node")
    out = ctx.layout.export_dir(sandbox_id, snapshot_id)
    marker = out / "export.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        done = json.loads(marker.read_text())
        if isinstance(done, dict):
            return done
    _fresh_dir(ctx, out)
    base, identity = _base(ctx)
    timings: dict[str, float] = {}
    mark = time.monotonic()
    with open(out / DISK_STREAM, "wb") as f:
        btrfs_receive.send(disk, f, parent=base)
    timings["send_ms"] = (time.monotonic() - mark) * 1000
    with open(out / DISK_STREAM, "rb") as f:
        header = sendstream.read_header(f)
    if header.parent_uuid != identity:
        raise errors.RuntimeFailure(f"delta of {snapshot_id} names parent {header.parent_uuid}, not the base")
    mark = time.monotonic()
    (out / "image").mkdir()
    files = {DISK_STREAM: (out / DISK_STREAM).stat().st_size}
    for path in _image_files(image):
        _clone(path, out / "image" / path.name)
        files[f"image/{path.name}"] = path.stat().st_size
    timings["image_ms"] = (time.monotonic() - mark) * 1000
    _chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": files,
        "metadata": {
            "format": 1,
            "kind": "full-checkpoint",
            "sandbox_id": sandbox_id,
            "snapshot_id": snapshot_id,
            "base": template_base.BASE_NAME,
            "base_version": template_base.BASE_VERSION,
            "base_identity": identity,
            "disk_stream_bytes": files[DISK_STREAM],
            "image_bytes": sum(size for name, size in files.items() if name.startswith("image/")),
        },
        "timings": timings,
    }
    write_json(marker, result, ctx.owner_uid)
    return result


def snapshot_import(ctx: HelperContext, params: ImportParams, _progress: Progress) -> dict[str, Any]:
    """Place a downloaded full checkpoint: the disk delta received onto the base, the image moved in, and
    the bundle written for the caller's spec. `sandbox.restore` then runs it."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    if ctx.runtimes.holder_alive(sandbox_id):
        raise errors.InvalidState(f"sandbox {sandbox_id} already runs on this node", state="running")
    staged = ctx.layout.import_dir(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    timings: dict[str, float] = {}
    if not _received(disk):
        _base_path, identity = _base(ctx)
        # Only a delta onto this node's base, creating exactly this snapshot, is applied (the parent check
        # raises NotFound naming both UUIDs; anything malformed or escaping is ArtifactCorrupt).
        expected = sendstream.Expected.delta(snapshot_id, {identity})
        with _open_staged(staged, DISK_STREAM) as stream:
            if btrfs.is_subvolume(disk):
                btrfs.delete_subvolume(disk)  # half-received by a killed import
            disk.parent.mkdir(parents=True, exist_ok=True)
            mark = time.monotonic()
            btrfs_receive.receive(stream, disk.parent, expected=expected)
            timings["receive_ms"] = (time.monotonic() - mark) * 1000
        if not _received(disk):
            raise errors.RuntimeFailure(f"receiving the disk of {snapshot_id} left no finished subvolume")
    if not image.is_dir():
        staged_image = staged / "image"
        _take_ownership(staged_image)
        if not _image_files(staged_image):
            raise errors.InvalidArgument(f"the checkpoint image of {snapshot_id} is empty")
        image.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staged_image, image)
    bundle = ctx.layout.bundle(sandbox_id)
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "limits.json").write_text(params.limits.model_dump_json())
    (bundle / "spec.json").write_text(json.dumps({"template": params.template, "env": params.env}))
    config = oci.bundle_config(
        rootfs=ctx.layout.rootfs(sandbox_id),
        init_argv=templates.guest_command(),
        init_env={**templates.GUEST_ENV, **params.env},
        limits=params.limits,
    )
    oci.write_bundle_config(bundle, config)
    _remove(staged)
    return {"disk": str(disk), "image": str(image), "timings": timings}


def _received(disk: pathlib.Path) -> bool:
    """A finished `btrfs receive`: it sets the received UUID and the read-only flag only at its very end."""
    if not btrfs.is_subvolume(disk) or not btrfs.get_readonly(disk):
        return False
    return btrfs.subvolume_identity(disk).received_uuid is not None


# -- the template base -----------------------------------------------------------------------------------
def base_status(ctx: HelperContext, _params: NoTransferParams, _progress: Progress) -> dict[str, Any]:
    return template_base.base_status(ctx.layout.templates)


def base_export(ctx: HelperContext, _params: NoTransferParams, _progress: Progress) -> dict[str, Any]:
    out = ctx.layout.base_export_dir()
    marker = out / "export.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        done = json.loads(marker.read_text())
        if isinstance(done, dict):
            return done
    _fresh_dir(ctx, out)
    info = template_base.export_base(ctx.layout.templates, out / BASE_STREAM)
    _chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": {BASE_STREAM: info["bytes"]},
        "metadata": {"format": 1, "kind": "template-base", "base": template_base.BASE_NAME,
                     "base_version": info["version"], "base_identity": info["identity"]},
        "timings": {},
    }  # fmt: skip
    write_json(marker, result, ctx.owner_uid)
    return result


def base_import(ctx: HelperContext, _params: NoTransferParams, progress: Progress) -> dict[str, Any]:
    staged = ctx.layout.base_import_dir()
    with _open_staged(staged, BASE_STREAM) as stream:
        result = template_base.import_base(ctx.layout.templates, stream, progress=progress)
    _remove(staged)
    return result
