"""The staging directories through which checkpoints and the template base leave and enter a node, and
the only ways the root helper opens what the agent put there.

`<fs>/staging/` (root, 0755) holds one directory per transfer, owned by the agent's uid (0700):
  export-<sandbox>-<snapshot>/   written by the helper (disk.stream, image/...), uploaded by the agent
  import-<sandbox>-<snapshot>/   written by the agent (downloaded and verified), consumed by the helper
  base-export/, base-import/     the template base's original full send stream
  template-export-<t>/, template-import-<t>/, oci-import-<t>/   a user template travelling (ADR 0056)
It lies on the node's btrfs filesystem, so image files are reflinked out and renamed in (no copies).

Invariants:
- Every path is derived from validated ids (NodeLayout); the agent names no path. Files the agent wrote are
  opened with O_NOFOLLOW and must be regular files with plain names: a symlink planted in staging cannot
  make the helper read or move anything else.
- A directory the agent staged becomes root's (0700, files 0600) before anything in it is used, so the
  agent can no longer add or swap entries.
- Only import directories are prepared for the agent; a sandbox's directories go when it is destroyed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from space.core import errors
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import StagingParams

FICLONE = 0x40049409  # _IOW(0x94, 9, int): share the extents of one file with another (reflink)
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_IMAGE_FILES = 256


#: A user template's transfer directories (ADR 0056), one per template and kind.
TEMPLATE_KINDS = ("template-export", "template-import", "oci-import")
IMPORT_KINDS = {"import", "base-import", "template-import", "oci-import"}


def template_dir(ctx: HelperContext, kind: str, template: str) -> pathlib.Path:
    """`<staging>/<kind>-<template>` for a validated template name."""
    assert kind in TEMPLATE_KINDS
    return ctx.layout.staging / f"{kind}-{template}"


def _staging_dir(
    ctx: HelperContext,
    kind: str,
    sandbox_id: str | None,
    snapshot_id: str | None,
    template: str | None = None,
) -> pathlib.Path:
    if kind in {"base-export", "base-import"}:
        return ctx.layout.base_export_dir() if kind == "base-export" else ctx.layout.base_import_dir()
    if kind in TEMPLATE_KINDS:
        if template is None:
            raise errors.InvalidArgument(f"staging of kind {kind!r} needs template", field="template")
        return template_dir(ctx, kind, template)
    if sandbox_id is None or snapshot_id is None:
        raise errors.InvalidArgument(f"staging of kind {kind!r} needs sandbox_id and snapshot_id")
    if kind == "export":
        return ctx.layout.export_dir(sandbox_id, snapshot_id)
    return ctx.layout.import_dir(sandbox_id, snapshot_id)


def fresh_dir(ctx: HelperContext, path: pathlib.Path) -> pathlib.Path:
    """An empty directory owned by the agent (0700) under the root-owned staging root."""
    root = ctx.layout.staging
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    os.chown(root, 0, 0)
    remove(path)
    path.mkdir(mode=0o700)
    os.chown(path, ctx.owner_uid, -1)
    return path


def remove(path: pathlib.Path) -> None:
    if os.path.islink(path) or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def staging_prepare(ctx: HelperContext, params: StagingParams, _progress: Progress) -> dict[str, Any]:
    if params.kind not in IMPORT_KINDS:
        raise errors.InvalidArgument("only import directories are prepared for the agent", field="kind")
    path = _staging_dir(ctx, params.kind, params.sandbox_id, params.snapshot_id, params.template)
    return {"dir": str(fresh_dir(ctx, path))}


def staging_release(ctx: HelperContext, params: StagingParams, _progress: Progress) -> dict[str, Any]:
    path = _staging_dir(ctx, params.kind, params.sandbox_id, params.snapshot_id, params.template)
    existed = path.exists()
    remove(path)
    return {"released": existed}


def discard_sandbox_staging(ctx: HelperContext, sandbox_id: str) -> None:
    """Every transfer directory of a sandbox (called when it is destroyed)."""
    root = ctx.layout.staging
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith((f"export-{sandbox_id}-", f"import-{sandbox_id}-")):
            remove(entry)


def chown_tree(root: pathlib.Path, uid: int) -> None:
    os.lchown(root, uid, -1)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, -1)


def clone(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Reflink `src` to `dst` (same btrfs filesystem: O(1)); a plain copy where reflinks do not work."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError:
            shutil.copyfileobj(fin, fout, 1 << 20)


@contextlib.contextmanager
def open_staged(directory: pathlib.Path, name: str) -> Iterator[BinaryIO]:
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


def image_files(image: pathlib.Path) -> list[pathlib.Path]:
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


def take_ownership(directory: pathlib.Path) -> None:
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
