"""btrfs subvolumes for the node helper: inspection, create, snapshot, delete, read-only flag, sync, and a
subvolume's identity. Quotas are in space.node.volumes.btrfs_quota, send/receive in
space.node.volumes.btrfs_receive, the ioctl layouts and error translation in space.node.volumes.btrfs_ioctl.

Invariants:
- Runs only inside the root node helper. Nothing here goes through a shell: ioctls via `fcntl.ioctl`, and
  btrfs-progs (for `subvolume show` only) as argv lists.
- The frequent, latency-sensitive operations (create, snapshot, delete, read-only flag, subvolume id,
  sync) are ioctls on an open directory fd: no fork/exec, ~0.1-1 ms instead of ~5-10 ms for
  `btrfs subvolume ...` (measured, see docs/adr/0004-btrfs-volumes.md).
- Every failure leaves as a typed SpaceError (space.node.volumes.btrfs_ioctl.translate).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from space.core import tracing
from space.core.errors import InvalidArgument, NotFound, RuntimeFailure
from space.node.volumes.btrfs_ioctl import (
    BTRFS,
    BTRFS_FIRST_FREE_OBJECTID,
    BTRFS_IOC_INO_LOOKUP,
    BTRFS_IOC_SNAP_CREATE_V2,
    BTRFS_IOC_SNAP_DESTROY,
    BTRFS_IOC_SNAP_DESTROY_V2,
    BTRFS_IOC_SUBVOL_CREATE,
    BTRFS_IOC_SUBVOL_GETFLAGS,
    BTRFS_IOC_SUBVOL_SETFLAGS,
    BTRFS_IOC_SYNC,
    BTRFS_SUBVOL_RDONLY,
    BTRFS_SUPER_MAGIC,
    INO_LOOKUP_SIZE,
    VOL_ARGS_NAME_MAX,
    VOL_ARGS_V2_NAME_MAX,
    PathLike,
    open_dir,
    run_progs,
    split_name,
    translate,
    vol_args,
    vol_args_v2,
)

LAYER = tracing.Layer("space.node.helper")  # btrfs calls are the helper's (ADR 0072)


# --- inspection -----------------------------------------------------------------------------------------
class _StatFs(ctypes.Structure):
    # Only f_type (the first field, a long on every Linux ABI) is read; the padding covers struct statfs.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def fs_type(path: PathLike) -> int:
    """statfs(2).f_type of the filesystem holding `path` (os.statvfs does not expose it)."""
    buf = _StatFs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise translate(OSError(err, os.strerror(err)), "statfs", path)
    return int(buf.f_type) & 0xFFFFFFFF


def is_btrfs(path: PathLike) -> bool:
    """True if `path` exists and lives on a btrfs filesystem."""
    try:
        return fs_type(path) == BTRFS_SUPER_MAGIC
    except NotFound:
        return False


def is_subvolume(path: PathLike) -> bool:
    """True if `path` is the root directory of a btrfs subvolume (not a plain directory, not a symlink)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise translate(exc, "stat", path) from exc
    return stat.S_ISDIR(st.st_mode) and st.st_ino == BTRFS_FIRST_FREE_OBJECTID and is_btrfs(path)


def require_subvolume(path: PathLike, op: str) -> None:
    if not os.path.lexists(path):
        raise NotFound(f"{op}: {os.fspath(path)} does not exist", path=os.fspath(path))
    if not is_subvolume(path):
        raise InvalidArgument(f"{op}: {os.fspath(path)} is not a btrfs subvolume", path=os.fspath(path))


def subvolume_id(path: PathLike) -> int:
    """The subvolume (tree) id of the subvolume containing `path`; its level-0 qgroup is 0/<id>."""
    with open_dir(path, "subvolume id") as fd:
        buf = bytearray(INO_LOOKUP_SIZE)
        struct.pack_into("=QQ", buf, 0, 0, BTRFS_FIRST_FREE_OBJECTID)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_INO_LOOKUP, buf)
        except OSError as exc:
            raise translate(exc, "subvolume id", path) from exc
        return int(struct.unpack_from("=Q", buf, 0)[0])


# --- subvolumes -----------------------------------------------------------------------------------------
@tracing.timed(LAYER, "btrfs.create_subvolume")
def create_subvolume(path: PathLike) -> Path:
    """Create an empty subvolume at `path` (its parent must exist on btrfs)."""
    parent, name = split_name(path, VOL_ARGS_NAME_MAX)
    with open_dir(parent, "create subvolume") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, vol_args(0, name))
        except OSError as exc:
            raise translate(exc, "create subvolume", path) from exc
    return Path(os.path.abspath(path))


@tracing.timed(LAYER, "btrfs.snapshot")
def snapshot(src: PathLike, dst: PathLike, *, readonly: bool = False) -> Path:
    """Snapshot subvolume `src` to `dst` (copy-on-write, O(1)); `readonly` makes it read-only atomically.

    Nested subvolumes inside `src` are not included (they appear as empty directories), as with btrfs-progs.
    """
    require_subvolume(src, "snapshot")
    parent, name = split_name(dst, VOL_ARGS_V2_NAME_MAX)
    flags = BTRFS_SUBVOL_RDONLY if readonly else 0
    with open_dir(src, "snapshot") as src_fd, open_dir(parent, "snapshot") as dst_fd:
        try:
            fcntl.ioctl(dst_fd, BTRFS_IOC_SNAP_CREATE_V2, vol_args_v2(src_fd, flags, name))
        except OSError as exc:
            raise translate(exc, "snapshot", dst) from exc
    return Path(os.path.abspath(dst))


def _destroy(path: Path) -> None:
    parent, name = split_name(path, VOL_ARGS_V2_NAME_MAX)
    with open_dir(parent, "delete subvolume") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SNAP_DESTROY_V2, vol_args_v2(0, 0, name))
        except OSError as exc:
            if exc.errno != errno.ENOTTY:
                raise
            # Kernels before 5.7 have no _V2; the v1 call does the same for a by-name delete.
            fcntl.ioctl(fd, BTRFS_IOC_SNAP_DESTROY, vol_args(0, name))


def nested_subvolumes(root: Path) -> list[Path]:
    """Subvolumes below `root`, deepest first. Only walked when a plain delete failed with ENOTEMPTY."""
    root_dev = os.lstat(root).st_dev
    found: list[Path] = []
    for dirpath, dirnames, _files in os.walk(root):
        keep = []
        for d in dirnames:
            full = Path(dirpath) / d
            st = os.lstat(full)
            if st.st_ino == BTRFS_FIRST_FREE_OBJECTID and st.st_dev != root_dev:
                found.append(full)
            keep.append(d)
        dirnames[:] = keep
    found.sort(key=lambda p: len(p.parts), reverse=True)
    return found


def _subvolume_root_of(path: Path) -> Path:
    """The root directory of the subvolume that holds directory `path` (the flags live there)."""
    p = path
    while os.lstat(p).st_ino != BTRFS_FIRST_FREE_OBJECTID and p != p.parent:
        p = p.parent
    return p


@tracing.timed(LAYER, "btrfs.delete_subvolume")
def delete_subvolume(path: PathLike) -> None:
    """Delete the subvolume at `path` with all its files, and any subvolumes nested inside it.

    Raises NotFound if `path` does not exist (callers that want "ensure absent" catch it), InvalidArgument if
    it is not a subvolume. The space is reclaimed asynchronously by the kernel's cleaner thread.
    """
    p = Path(os.path.abspath(path))
    require_subvolume(p, "delete subvolume")
    try:
        _destroy(p)
        return
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise translate(exc, "delete subvolume", p) from exc
    # A nested subvolume blocks deletion: delete inner ones first (deepest first). A nested subvolume's
    # directory entry lives in its parent subvolume, which must be writable for the entry to go.
    try:
        for inner in nested_subvolumes(p):
            holder = _subvolume_root_of(inner.parent)
            if get_readonly(holder):
                set_readonly(holder, False)
            _destroy(inner)
        if get_readonly(p):
            set_readonly(p, False)
        _destroy(p)
    except OSError as exc:
        raise translate(exc, "delete subvolume", p) from exc


def get_readonly(path: PathLike) -> bool:
    with open_dir(path, "get subvolume flags") as fd:
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf)
        except OSError as exc:
            raise translate(exc, "get subvolume flags", path) from exc
        return bool(struct.unpack("=Q", buf)[0] & BTRFS_SUBVOL_RDONLY)


def set_readonly(path: PathLike, readonly: bool) -> None:
    """Set or clear the subvolume's read-only flag (a read-only subvolume refuses every write: EROFS)."""
    require_subvolume(path, "set read-only")
    with open_dir(path, "set read-only") as fd:
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf)
            flags = struct.unpack("=Q", buf)[0]
            new = (flags | BTRFS_SUBVOL_RDONLY) if readonly else (flags & ~BTRFS_SUBVOL_RDONLY)
            if new != flags:
                fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, struct.pack("=Q", new))
        except OSError as exc:
            raise translate(exc, "set read-only", path) from exc


def sync(path: PathLike) -> None:
    """Flush delalloc and commit the transaction of the filesystem holding `path` (BTRFS_IOC_SYNC)."""
    with open_dir(path, "sync") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SYNC)
        except OSError as exc:
            raise translate(exc, "sync", path) from exc


# --- identities (which subvolume a delta needs as its parent) -----------------------------------------------
@dataclass(frozen=True)
class SubvolumeIdentity:
    uuid: str
    received_uuid: str | None  # set on a subvolume made by `btrfs receive`: the sender's UUID


def subvolume_identity(subvol: PathLike) -> SubvolumeIdentity:
    """UUID and received UUID of a subvolume (`btrfs subvolume show`; only used off the hot path)."""
    require_subvolume(subvol, "subvolume show")
    out = run_progs([BTRFS, "subvolume", "show", os.fspath(subvol)], "subvolume show", subvol).stdout.decode()
    fields: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    uuid = fields.get("UUID", "")
    received = fields.get("Received UUID", "-")
    if not uuid or uuid == "-":
        raise RuntimeFailure("subvolume show reported no UUID", path=os.fspath(subvol))
    return SubvolumeIdentity(uuid=uuid, received_uuid=None if received in ("", "-") else received)
