"""btrfs operations for the node helper: subvolumes, snapshots, read-only flags, quotas, send/receive.

Invariants:
- Runs only inside the root node helper. Nothing here goes through a shell: ioctls via `fcntl.ioctl`, and
  btrfs-progs (for quota enable/rescan and send/receive only) as argv lists.
- The frequent, latency-sensitive operations (create, snapshot, delete, read-only flag, subvolume id, quota
  limit, quota usage, sync) are ioctls on an open directory fd: no fork/exec, ~0.1-1 ms instead of
  ~5-10 ms for `btrfs subvolume ...` (measured, see docs/adr/0004-btrfs-volumes.md).
- Every failure leaves as a typed SpaceError (`raise ... from exc`): ENOENT → NotFound, EEXIST →
  AlreadyExists, ENOSPC/EDQUOT → ResourceExhausted, not-btrfs / not-a-subvolume / bad name →
  InvalidArgument, anything else → RuntimeFailure. Callers never see a bare OSError or CalledProcessError.
- Quota numbers are only as fresh as the last transaction commit; `qgroup_usage(..., sync=True)` (the
  default) commits first (BTRFS_IOC_SYNC flushes delalloc and commits), so what was just written counts.
- `btrfs receive` only ever runs with `--chroot` in a fresh, empty, root-only staging directory, fed
  through a pipe with bytes this process read once and checked (sendstream) against what the caller
  expects; the subvolume moves to its destination only after staging was found to hold it and nothing else
  (docs/adr/0023-confined-btrfs-receive.md). A stream that fails a check is a typed ArtifactCorrupt
  (NotFound when a delta names another parent).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import io
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, cast

from space.core.errors import (
    AlreadyExists,
    ArtifactCorrupt,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RuntimeFailure,
    SpaceError,
)
from space.node.volumes import sendstream

PathLike = str | os.PathLike[str]
RECEIVE_READ_BYTES = 1 << 20
STAGING_PREFIX = ".receive-"  # + helper pid + random: one per receive, beside its destination

BTRFS_SUPER_MAGIC = 0x9123683E
# Every subvolume's root directory is inode 256 (BTRFS_FIRST_FREE_OBJECTID); each subvolume also has its own
# anonymous st_dev, which is how nested subvolumes are told apart from plain directories.
BTRFS_FIRST_FREE_OBJECTID = 256
BTRFS_SUBVOL_RDONLY = 1 << 1
BTRFS_QUOTA_TREE_OBJECTID = 8
BTRFS_QGROUP_STATUS_KEY = 240
BTRFS_QGROUP_INFO_KEY = 242
BTRFS_QGROUP_STATUS_FLAG_ON = 1 << 0
BTRFS_QGROUP_STATUS_FLAG_RESCAN = 1 << 1
BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT = 1 << 2
BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE = 1 << 3
BTRFS_QUOTA_CTL_ENABLE_SIMPLE = 4
BTRFS_QGROUP_LIMIT_MAX_RFER = 1 << 0
BTRFS_QGROUP_LIMIT_MAX_EXCL = 1 << 1
U64_MAX = (1 << 64) - 1

# --- ioctl numbers (asm-generic/ioctl.h: dir<<30 | size<<16 | type<<8 | nr) -------------------------------
_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2
BTRFS_IOCTL_MAGIC = 0x94


def _ioc(direction: int, nr: int, size: int) -> int:
    assert size < (1 << 14)  # the size field is 14 bits wide
    return (direction << 30) | (size << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr


# struct btrfs_ioctl_vol_args { __s64 fd; char name[4088]; }  -> 4096 bytes
VOL_ARGS_NAME_MAX = 4088
VOL_ARGS_SIZE = 8 + VOL_ARGS_NAME_MAX
# struct btrfs_ioctl_vol_args_v2 { __s64 fd; __u64 transid; __u64 flags;
#   union { struct { __u64 size; struct btrfs_qgroup_inherit *qgroup_inherit; }; __u64 unused[4]; };
#   union { char name[BTRFS_SUBVOL_NAME_MAX + 1 = 4040]; __u64 devid; __u64 subvolid; }; }  -> 4096 bytes
VOL_ARGS_V2_NAME_MAX = 4040
VOL_ARGS_V2_HEAD = struct.Struct("=qQQ32x")
VOL_ARGS_V2_SIZE = VOL_ARGS_V2_HEAD.size + VOL_ARGS_V2_NAME_MAX
# struct btrfs_ioctl_ino_lookup_args { __u64 treeid; __u64 objectid; char name[4080]; } -> 4096 bytes
INO_LOOKUP_SIZE = 4096
# struct btrfs_ioctl_search_args { struct btrfs_ioctl_search_key key (104 bytes); char buf[3992]; } -> 4096
SEARCH_KEY = struct.Struct("=7Q4I4Q")
SEARCH_ARGS_SIZE = 4096
SEARCH_HEADER = struct.Struct("=3Q2I")
# struct btrfs_ioctl_qgroup_limit_args { __u64 qgroupid; struct btrfs_qgroup_limit { __u64 flags, max_rfer,
#   max_excl, rsv_rfer, rsv_excl; } } -> 48 bytes
QGROUP_LIMIT = struct.Struct("=6Q")
# struct btrfs_ioctl_quota_ctl_args { __u64 cmd; __u64 status; } -> 16 bytes
QUOTA_CTL = struct.Struct("=QQ")

BTRFS_IOC_SYNC = _ioc(_IOC_NONE, 8, 0)
BTRFS_IOC_SUBVOL_CREATE = _ioc(_IOC_WRITE, 14, VOL_ARGS_SIZE)
BTRFS_IOC_SNAP_DESTROY = _ioc(_IOC_WRITE, 15, VOL_ARGS_SIZE)
BTRFS_IOC_TREE_SEARCH = _ioc(_IOC_READ | _IOC_WRITE, 17, SEARCH_ARGS_SIZE)
BTRFS_IOC_INO_LOOKUP = _ioc(_IOC_READ | _IOC_WRITE, 18, INO_LOOKUP_SIZE)
BTRFS_IOC_SNAP_CREATE_V2 = _ioc(_IOC_WRITE, 23, VOL_ARGS_V2_SIZE)
BTRFS_IOC_SUBVOL_GETFLAGS = _ioc(_IOC_READ, 25, 8)
BTRFS_IOC_SUBVOL_SETFLAGS = _ioc(_IOC_WRITE, 26, 8)
BTRFS_IOC_QUOTA_CTL = _ioc(_IOC_READ | _IOC_WRITE, 40, QUOTA_CTL.size)
BTRFS_IOC_QGROUP_LIMIT = _ioc(_IOC_READ, 43, QGROUP_LIMIT.size)  # declared _IOR in the uapi header
BTRFS_IOC_SNAP_DESTROY_V2 = _ioc(_IOC_WRITE, 63, VOL_ARGS_V2_SIZE)

assert VOL_ARGS_SIZE == 4096 and VOL_ARGS_V2_SIZE == 4096 and SEARCH_KEY.size == 104
assert BTRFS_IOC_SNAP_CREATE_V2 == 0x50009417 and BTRFS_IOC_SUBVOL_CREATE == 0x5000940E

BTRFS = "btrfs"


# --- error translation ----------------------------------------------------------------------------------
def _translate(exc: OSError, op: str, path: PathLike) -> SpaceError:
    p = os.fspath(path)
    code = exc.errno
    if code == errno.ENOENT:
        return NotFound(f"{op}: {p} does not exist", path=p)
    if code == errno.EEXIST:
        return AlreadyExists(f"{op}: {p} already exists", path=p)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{op}: no space left for {p}", path=p, errno=code)
    if code in (errno.ENOTTY, errno.EXDEV):
        return InvalidArgument(f"{op}: {p} is not on the same btrfs filesystem", path=p, errno=code)
    if code == errno.EINVAL:
        return InvalidArgument(f"{op}: invalid target {p} (not a btrfs subvolume?)", path=p)
    if code == errno.ENOTDIR:
        return InvalidArgument(f"{op}: {p} is not a directory", path=p)
    return RuntimeFailure(f"{op} {p}: {exc.strerror or exc}", path=p, errno=code)


@contextlib.contextmanager
def _open_dir(path: PathLike, op: str) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _translate(exc, op, path) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _split(path: PathLike, max_len: int) -> tuple[Path, bytes]:
    p = Path(os.path.abspath(path))
    name = os.fsencode(p.name)
    if not name or name in (b".", b"..") or len(name) >= max_len:
        raise InvalidArgument(f"invalid subvolume name: {p.name!r}", path=str(p))
    return p.parent, name


def _vol_args(fd: int, name: bytes) -> bytearray:
    buf = bytearray(VOL_ARGS_SIZE)
    struct.pack_into("=q", buf, 0, fd)
    buf[8 : 8 + len(name)] = name
    return buf


def _vol_args_v2(fd: int, flags: int, name: bytes) -> bytearray:
    buf = bytearray(VOL_ARGS_V2_SIZE)
    VOL_ARGS_V2_HEAD.pack_into(buf, 0, fd, 0, flags)
    off = VOL_ARGS_V2_HEAD.size
    buf[off : off + len(name)] = name
    return buf


def _run(
    argv: list[str],
    op: str,
    path: PathLike,
    *,
    stdin: int | BinaryIO | None = None,
    stdout: int | BinaryIO | None = None,
) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            argv,
            check=True,
            stdin=stdin,
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        raise RuntimeFailure(f"{op}: {argv[0]} is not installed", path=os.fspath(path)) from exc
    except subprocess.CalledProcessError as exc:
        stderr = (exc.stderr or b"").decode(errors="replace").strip()
        raise _translate_progs(stderr, op, path) from exc


def _translate_progs(stderr: str, op: str, path: PathLike) -> SpaceError:
    p = os.fspath(path)
    low = stderr.lower()
    if "cannot find parent subvolume" in low or "no such file" in low:
        return NotFound(f"{op} {p}: {stderr}", path=p)
    if "file exists" in low or "already exists" in low:
        return AlreadyExists(f"{op} {p}: {stderr}", path=p)
    if "no space left" in low or "quota exceeded" in low:
        return ResourceExhausted(f"{op} {p}: {stderr}", path=p)
    if "not a btrfs" in low:
        return InvalidArgument(f"{op} {p}: {stderr}", path=p)
    return RuntimeFailure(f"{op} {p} failed: {stderr}", path=p)


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
        raise _translate(OSError(err, os.strerror(err)), "statfs", path)
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
        raise _translate(exc, "stat", path) from exc
    return stat.S_ISDIR(st.st_mode) and st.st_ino == BTRFS_FIRST_FREE_OBJECTID and is_btrfs(path)


def _require_subvolume(path: PathLike, op: str) -> None:
    if not os.path.lexists(path):
        raise NotFound(f"{op}: {os.fspath(path)} does not exist", path=os.fspath(path))
    if not is_subvolume(path):
        raise InvalidArgument(f"{op}: {os.fspath(path)} is not a btrfs subvolume", path=os.fspath(path))


def subvolume_id(path: PathLike) -> int:
    """The subvolume (tree) id of the subvolume containing `path`; its level-0 qgroup is 0/<id>."""
    with _open_dir(path, "subvolume id") as fd:
        buf = bytearray(INO_LOOKUP_SIZE)
        struct.pack_into("=QQ", buf, 0, 0, BTRFS_FIRST_FREE_OBJECTID)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_INO_LOOKUP, buf)
        except OSError as exc:
            raise _translate(exc, "subvolume id", path) from exc
        return int(struct.unpack_from("=Q", buf, 0)[0])


# --- subvolumes -----------------------------------------------------------------------------------------
def create_subvolume(path: PathLike) -> Path:
    """Create an empty subvolume at `path` (its parent must exist on btrfs)."""
    parent, name = _split(path, VOL_ARGS_NAME_MAX)
    with _open_dir(parent, "create subvolume") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, _vol_args(0, name))
        except OSError as exc:
            raise _translate(exc, "create subvolume", path) from exc
    return Path(os.path.abspath(path))


def snapshot(src: PathLike, dst: PathLike, *, readonly: bool = False) -> Path:
    """Snapshot subvolume `src` to `dst` (copy-on-write, O(1)); `readonly` makes it read-only atomically.

    Nested subvolumes inside `src` are not included (they appear as empty directories), as with btrfs-progs.
    """
    _require_subvolume(src, "snapshot")
    parent, name = _split(dst, VOL_ARGS_V2_NAME_MAX)
    flags = BTRFS_SUBVOL_RDONLY if readonly else 0
    with _open_dir(src, "snapshot") as src_fd, _open_dir(parent, "snapshot") as dst_fd:
        try:
            fcntl.ioctl(dst_fd, BTRFS_IOC_SNAP_CREATE_V2, _vol_args_v2(src_fd, flags, name))
        except OSError as exc:
            raise _translate(exc, "snapshot", dst) from exc
    return Path(os.path.abspath(dst))


def _destroy(path: Path) -> None:
    parent, name = _split(path, VOL_ARGS_V2_NAME_MAX)
    with _open_dir(parent, "delete subvolume") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SNAP_DESTROY_V2, _vol_args_v2(0, 0, name))
        except OSError as exc:
            if exc.errno != errno.ENOTTY:
                raise
            # Kernels before 5.7 have no _V2; the v1 call does the same for a by-name delete.
            fcntl.ioctl(fd, BTRFS_IOC_SNAP_DESTROY, _vol_args(0, name))


def _nested_subvolumes(root: Path) -> list[Path]:
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


def delete_subvolume(path: PathLike) -> None:
    """Delete the subvolume at `path` with all its files, and any subvolumes nested inside it.

    Raises NotFound if `path` does not exist (callers that want "ensure absent" catch it), InvalidArgument if
    it is not a subvolume. The space is reclaimed asynchronously by the kernel's cleaner thread.
    """
    p = Path(os.path.abspath(path))
    _require_subvolume(p, "delete subvolume")
    try:
        _destroy(p)
        return
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise _translate(exc, "delete subvolume", p) from exc
    # A nested subvolume blocks deletion: delete inner ones first (deepest first). A nested subvolume's
    # directory entry lives in its parent subvolume, which must be writable for the entry to go.
    try:
        for inner in _nested_subvolumes(p):
            holder = _subvolume_root_of(inner.parent)
            if get_readonly(holder):
                set_readonly(holder, False)
            _destroy(inner)
        if get_readonly(p):
            set_readonly(p, False)
        _destroy(p)
    except OSError as exc:
        raise _translate(exc, "delete subvolume", p) from exc


def get_readonly(path: PathLike) -> bool:
    with _open_dir(path, "get subvolume flags") as fd:
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf)
        except OSError as exc:
            raise _translate(exc, "get subvolume flags", path) from exc
        return bool(struct.unpack("=Q", buf)[0] & BTRFS_SUBVOL_RDONLY)


def set_readonly(path: PathLike, readonly: bool) -> None:
    """Set or clear the subvolume's read-only flag (a read-only subvolume refuses every write: EROFS)."""
    _require_subvolume(path, "set read-only")
    with _open_dir(path, "set read-only") as fd:
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf)
            flags = struct.unpack("=Q", buf)[0]
            new = (flags | BTRFS_SUBVOL_RDONLY) if readonly else (flags & ~BTRFS_SUBVOL_RDONLY)
            if new != flags:
                fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, struct.pack("=Q", new))
        except OSError as exc:
            raise _translate(exc, "set read-only", path) from exc


def sync(path: PathLike) -> None:
    """Flush delalloc and commit the transaction of the filesystem holding `path` (BTRFS_IOC_SYNC)."""
    with _open_dir(path, "sync") as fd:
        try:
            fcntl.ioctl(fd, BTRFS_IOC_SYNC)
        except OSError as exc:
            raise _translate(exc, "sync", path) from exc


# --- quotas ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QgroupUsage:
    qgroup: str  # "0/<subvolume id>"
    referenced: int  # bytes reachable from the subvolume (shared with its template included)
    exclusive: int  # bytes only this subvolume references (what deleting it would free)


def enable_quota(mount: PathLike, *, simple: bool = True) -> str:
    """Enable quotas on the filesystem of `mount` (idempotent); return the mode in force: "simple"/"full".

    simple (default, kernel >= 6.7, one ioctl): "squota" charges every extent to the subvolume that allocated
    it, so a sandbox's exclusive == referenced == what it wrote since it was snapshotted; limits are enforced
    the same way. Measured here: snapshots stay as fast as without quotas (~6 ms), while full qgroups made
    snapshots under create/delete churn 6x slower (median 42 ms, p90 95 ms), because every shared-extent
    change is back-referenced at commit. Extents that existed before enabling are charged to no one, so
    enable it on a fresh filesystem (ensure_btrfs does).
    full (`simple=False`, or an older kernel): classic qgroups via btrfs-progs, then `quota rescan -w` so
    the numbers cover pre-existing data. Either way, a deleted subvolume's 0/<id> qgroup goes away by itself
    once the cleaner has freed it (kernel >= 6.7).
    """
    status = _quota_status(mount)
    if status & BTRFS_QGROUP_STATUS_FLAG_ON:
        return "simple" if status & BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE else "full"
    if simple:
        with _open_dir(mount, "enable quota") as fd:
            try:
                fcntl.ioctl(
                    fd, BTRFS_IOC_QUOTA_CTL, bytearray(QUOTA_CTL.pack(BTRFS_QUOTA_CTL_ENABLE_SIMPLE, 0))
                )
                return "simple"
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY):
                    raise _translate(exc, "enable quota", mount) from exc
                # Kernel without simple quotas: fall through to full qgroups.
    _run([BTRFS, "quota", "enable", os.fspath(mount)], "quota enable", mount)
    _run([BTRFS, "quota", "rescan", "-w", os.fspath(mount)], "quota rescan", mount)
    return "full"


def quota_enabled(mount: PathLike) -> bool:
    return bool(_quota_status(mount) & BTRFS_QGROUP_STATUS_FLAG_ON)


def quota_mode(mount: PathLike) -> str | None:
    """The quota mode in force: "simple", "full", or None when quotas are off."""
    status = _quota_status(mount)
    if not status & BTRFS_QGROUP_STATUS_FLAG_ON:
        return None
    return "simple" if status & BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE else "full"


def _tree_search(
    path: PathLike, tree: int, item_type: int, offset: int, op: str
) -> list[tuple[int, int, bytes]]:
    """Items (objectid, offset, data) of one key type at one offset in `tree` (BTRFS_IOC_TREE_SEARCH)."""
    with _open_dir(path, op) as fd:
        buf = bytearray(SEARCH_ARGS_SIZE)
        SEARCH_KEY.pack_into(
            buf, 0, tree, 0, 0, offset, offset, 0, U64_MAX, item_type, item_type, 16, 0, 0, 0, 0, 0
        )
        try:
            fcntl.ioctl(fd, BTRFS_IOC_TREE_SEARCH, buf)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # no such tree: quotas were never enabled
                return []
            raise _translate(exc, op, path) from exc
    nr_items = struct.unpack_from("=I", buf, 64)[0]
    out: list[tuple[int, int, bytes]] = []
    pos = SEARCH_KEY.size
    for _ in range(nr_items):
        _transid, objectid, off, typ, length = SEARCH_HEADER.unpack_from(buf, pos)
        pos += SEARCH_HEADER.size
        if typ == item_type:
            out.append((objectid, off, bytes(buf[pos : pos + length])))
        pos += length
    return out


def _quota_status(path: PathLike) -> int:
    items = _tree_search(path, BTRFS_QUOTA_TREE_OBJECTID, BTRFS_QGROUP_STATUS_KEY, 0, "quota status")
    if not items:
        return 0
    # struct btrfs_qgroup_status_item { __le64 version, generation, flags, rescan; }
    return int(struct.unpack_from("<4Q", items[0][2])[2])


def set_limit(
    subvol: PathLike, limit_bytes: int | None, *, kind: Literal["exclusive", "referenced"] = "exclusive"
) -> None:
    """Limit the subvolume's 0/<id> qgroup; `None` removes the limit. Quotas must be enabled.

    "exclusive" (default) limits what the sandbox itself adds on top of its template, so the template's size
    does not eat the sandbox's allowance; writes beyond it fail with EDQUOT inside the subvolume.
    """
    _require_subvolume(subvol, "set quota limit")
    if limit_bytes is not None and limit_bytes <= 0:
        raise InvalidArgument("quota limit must be positive", limit_bytes=limit_bytes)
    if not quota_enabled(subvol):
        raise InvalidArgument("quotas are not enabled on this filesystem", path=os.fspath(subvol))
    value = U64_MAX if limit_bytes is None else limit_bytes
    if kind == "exclusive":
        args = QGROUP_LIMIT.pack(0, BTRFS_QGROUP_LIMIT_MAX_EXCL, 0, value, 0, 0)
    else:
        args = QGROUP_LIMIT.pack(0, BTRFS_QGROUP_LIMIT_MAX_RFER, value, 0, 0, 0)
    with _open_dir(subvol, "set quota limit") as fd:
        try:
            # qgroupid 0 means "the subvolume this fd is in", i.e. 0/<its id>.
            fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, bytearray(args))
        except OSError as exc:
            raise _translate(exc, "set quota limit", subvol) from exc


def qgroup_usage(subvol: PathLike, *, sync_first: bool = True) -> QgroupUsage:
    """Referenced and exclusive bytes of the subvolume's 0/<id> qgroup, read from the quota tree.

    With `sync_first` the filesystem commits first: qgroup accounting happens at commit, so without it
    recently written data may not be counted yet.
    """
    _require_subvolume(subvol, "quota usage")
    if sync_first:
        sync(subvol)
    status = _quota_status(subvol)
    if not status & BTRFS_QGROUP_STATUS_FLAG_ON:
        raise InvalidArgument("quotas are not enabled on this filesystem", path=os.fspath(subvol))
    sid = subvolume_id(subvol)
    items = _tree_search(subvol, BTRFS_QUOTA_TREE_OBJECTID, BTRFS_QGROUP_INFO_KEY, sid, "quota usage")
    if not items:
        raise NotFound(f"no qgroup 0/{sid} for {os.fspath(subvol)}", path=os.fspath(subvol))
    # struct btrfs_qgroup_info_item { __le64 generation, rfer, rfer_cmpr, excl, excl_cmpr; }
    _gen, rfer, _rfer_c, excl, _excl_c = struct.unpack_from("<5Q", items[0][2])
    return QgroupUsage(qgroup=f"0/{sid}", referenced=rfer, exclusive=excl)


def qgroup_usage_by_id(mount: PathLike, subvolume_id: int) -> QgroupUsage | None:
    """Usage of qgroup 0/<subvolume_id> on the filesystem of `mount`, also after its subvolume was deleted
    (its extents still pinned elsewhere keep it charged); None when it no longer exists (all freed) or
    quotas are off. No commit first: call `sync` once before reading many."""
    items = _tree_search(mount, BTRFS_QUOTA_TREE_OBJECTID, BTRFS_QGROUP_INFO_KEY, subvolume_id, "quota usage")
    if not items:
        return None
    _gen, rfer, _rfer_c, excl, _excl_c = struct.unpack_from("<5Q", items[0][2])
    return QgroupUsage(qgroup=f"0/{subvolume_id}", referenced=rfer, exclusive=excl)


def exclusive_bytes(subvol: PathLike) -> int:
    return qgroup_usage(subvol).exclusive


def referenced_bytes(subvol: PathLike) -> int:
    return qgroup_usage(subvol).referenced


def qgroup_show(mount: PathLike) -> dict[str, tuple[int, int]]:
    """`btrfs qgroup show --raw` parsed to {qgroupid: (referenced, exclusive)}; a cross-check of the ioctl."""
    out = _run([BTRFS, "qgroup", "show", "--raw", os.fspath(mount)], "qgroup show", mount).stdout.decode()
    result: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        m = re.match(r"^\s*(\d+/\d+)\s+(\d+)\s+(\d+)", line)
        if m:
            result[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return result


# --- send / receive -------------------------------------------------------------------------------------
StreamTarget = PathLike | int | BinaryIO


def send(subvol: PathLike, out: StreamTarget, *, parent: PathLike | None = None) -> None:
    """Write a `btrfs send` stream of read-only `subvol` to `out` (a path, an fd, or a binary file object).

    With `parent` (read-only, e.g. the template), the stream is a delta that `receive` can apply only where a
    subvolume with the parent's UUID or received UUID exists.
    """
    _require_subvolume(subvol, "send")
    if not get_readonly(subvol):
        raise InvalidArgument("send needs a read-only subvolume", path=os.fspath(subvol))
    argv = [BTRFS, "send", "-q"]
    if parent is not None:
        _require_subvolume(parent, "send parent")
        if not get_readonly(parent):
            raise InvalidArgument("send parent must be read-only", path=os.fspath(parent))
        argv += ["-p", os.fspath(parent)]
    if isinstance(out, (str, os.PathLike)):
        _run([*argv, "-f", os.fspath(out), os.fspath(subvol)], "send", subvol)
    else:
        _run([*argv, os.fspath(subvol)], "send", subvol, stdout=out)


def open_stream(path: PathLike) -> BinaryIO:
    """Open a send stream once: no symlink as its last component, no FIFO or device (O_NONBLOCK keeps a
    FIFO from blocking the open), a regular file only. Callers hand the returned file to `receive` and
    never open the path again."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise NotFound("send stream not found", path=p) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArgument("send stream is a symlink", path=p) from exc
        raise _translate(exc, "open send stream", p) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidArgument("send stream is not a regular file", path=p)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


def _stream_reader(stream: PathLike | int | BinaryIO) -> tuple[BinaryIO, bool]:
    """(a buffered reader over `stream`, whether this function opened it and must close it)."""
    if isinstance(stream, (str, os.PathLike)):
        raw = cast(io.RawIOBase, open_stream(stream))  # an unbuffered FileIO
        return cast(BinaryIO, io.BufferedReader(raw, RECEIVE_READ_BYTES)), True
    if isinstance(stream, io.RawIOBase):  # e.g. an unbuffered file: read its fd through a buffer
        stream = stream.fileno()
    if isinstance(stream, int):
        if not stat.S_ISREG(os.fstat(stream).st_mode):
            raise InvalidArgument("send stream is not a regular file")
        return cast(
            BinaryIO, io.BufferedReader(io.FileIO(stream, "rb", closefd=False), RECEIVE_READ_BYTES)
        ), True
    return stream, False


def _clear_staging(staging: Path) -> None:
    """Remove a receive's staging directory and everything in it, whatever a failed stream left there
    (a half-received subvolume, files that went through a symlink to the chroot's root)."""
    if not os.path.lexists(staging):
        return
    for entry in staging.iterdir():
        if is_subvolume(entry):
            delete_subvolume(entry)
        elif entry.is_dir() and not entry.is_symlink():
            for inner in _nested_subvolumes(entry):
                delete_subvolume(inner)
            shutil.rmtree(entry)
        else:
            entry.unlink()
    staging.rmdir()


def _sweep_stale_staging(dest_root: Path) -> None:
    """Staging directories that a killed helper (another pid) left beside the destinations."""
    mine = f"{STAGING_PREFIX}{os.getpid()}-"
    for entry in dest_root.iterdir():
        if entry.name.startswith(STAGING_PREFIX) and not entry.name.startswith(mine):
            with contextlib.suppress(SpaceError, OSError):
                _clear_staging(entry)


def receive(stream: PathLike | int | BinaryIO, dest_dir: PathLike, *, expected: sendstream.Expected) -> Path:
    """Apply a send stream (path, fd or binary file object) as `dest_dir/<expected.name>`; return it.

    The stream is read once, here, and checked command by command (space.node.volumes.sendstream) while
    it is piped into `btrfs receive -e --chroot` running in a fresh, empty, root-only staging directory
    beside the destination; a refused command is never forwarded (the receive is killed instead). Then the
    staging directory must hold exactly the expected subvolume, read-only, with the stream's UUID as its
    received UUID, and nothing else (anything else was written through a symlink to the chroot's root);
    only then is the subvolume moved to its destination. Staging is removed in every case.

    The result is read-only and records the sender's UUID as its received UUID.
    """
    dest_root = Path(os.path.abspath(dest_dir))
    if not is_btrfs(dest_root):
        raise InvalidArgument("receive target is not on btrfs", path=os.fspath(dest_root))
    reader, owned = _stream_reader(stream)
    try:
        checked = sendstream.CheckedStream(reader, expected)
        header = checked.header
        dest = dest_root / header.name
        if os.path.lexists(dest):
            raise AlreadyExists(f"receive: {dest} already exists", path=str(dest))
        _sweep_stale_staging(dest_root)
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=dest_root))  # 0700
        try:
            _receive_into(checked, staging)
            received = staging / header.name
            entries = sorted(entry.name for entry in staging.iterdir())
            if entries != [header.name] or not is_subvolume(received):
                raise ArtifactCorrupt(
                    f"send stream refused: it left {entries[:8]} in staging, not just {header.name!r} "
                    "(a write went outside its subvolume)", entries=entries[:8],
                )  # fmt: skip
            identity = subvolume_identity(received)
            if not get_readonly(received) or identity.received_uuid != header.uuid:
                raise ArtifactCorrupt(f"send stream refused: {header.name!r} was not received completely")
            # A read-only subvolume cannot change directories (its ".." would change: EROFS), so the flag
            # is lifted for the rename only. The raw ioctl keeps the received UUID (btrfs-progs'
            # `property set ro false` would clear it).
            set_readonly(received, False)
            try:
                os.rename(received, dest)
            except OSError as exc:
                set_readonly(received, True)
                raise _translate(exc, "receive: move into place", dest) from exc
            set_readonly(dest, True)
        finally:
            _clear_staging(staging)
        return dest
    finally:
        if owned:
            reader.close()


def _receive_into(checked: sendstream.CheckedStream, staging: Path) -> None:
    argv = [BTRFS, "receive", "-e", "--chroot", os.fspath(staging)]
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log)
        except FileNotFoundError as exc:
            raise RuntimeFailure(f"receive: {BTRFS} is not installed", path=str(staging)) from exc
        assert proc.stdin is not None
        refused: BaseException | None = None
        broken = False
        try:
            for chunk in checked.chunks():
                try:
                    proc.stdin.write(chunk)
                except BrokenPipeError:
                    broken = True  # btrfs gave up on an earlier command; its log says why
                    break
        except BaseException as exc:
            refused = exc
            proc.kill()
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            rc = proc.wait()
        if refused is not None:
            raise refused
        if rc != 0 or broken:
            log.seek(0)
            tail = log.read()[-4000:].decode(errors="replace").strip()
            tail = "\n".join(line for line in tail.splitlines() if not line.startswith("Chroot to "))
            raise _translate_receive_failure(tail or f"exit status {rc}", staging)


def _translate_receive_failure(stderr: str, staging: Path) -> SpaceError:
    """btrfs receive stopped on a stream that passed the checks: a missing parent (NotFound, another node's
    base), a full disk (ResourceExhausted), or a stream that cannot be applied as it claims (a path that
    does not exist, e.g. through a parent's symlink, a bad crc later on): ArtifactCorrupt."""
    low = stderr.lower()
    if "cannot find parent subvolume" in low:
        return NotFound(f"receive: the stream's parent is not on this filesystem: {stderr}", field="parent")
    if "no space left" in low or "quota exceeded" in low or "disk quota" in low:
        return ResourceExhausted(f"receive: no space left: {stderr}", path=str(staging))
    return ArtifactCorrupt(f"send stream refused: btrfs receive could not apply it: {stderr}")


# --- identities (which subvolume a delta needs as its parent) -----------------------------------------------
@dataclass(frozen=True)
class SubvolumeIdentity:
    uuid: str
    received_uuid: str | None  # set on a subvolume made by `btrfs receive`: the sender's UUID


def subvolume_identity(subvol: PathLike) -> SubvolumeIdentity:
    """UUID and received UUID of a subvolume (`btrfs subvolume show`; only used off the hot path)."""
    _require_subvolume(subvol, "subvolume show")
    out = _run([BTRFS, "subvolume", "show", os.fspath(subvol)], "subvolume show", subvol).stdout.decode()
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
