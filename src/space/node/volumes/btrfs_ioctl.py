"""The kernel and btrfs-progs interface of the volume layer: ioctl numbers and argument layouts, error
translation, and the one way btrfs-progs is run (space.node.volumes.btrfs and its siblings build on it).

Invariants:
- Nothing here goes through a shell: ioctls via `fcntl.ioctl`, btrfs-progs as argv lists.
- Every failure leaves as a typed SpaceError (`raise ... from exc`): ENOENT → NotFound, EEXIST →
  AlreadyExists, ENOSPC/EDQUOT → ResourceExhausted, not-btrfs / not-a-subvolume / bad name →
  InvalidArgument, anything else → RuntimeFailure. Callers never see a bare OSError or CalledProcessError.
- The argument layouts are checked against the uapi sizes at import (a wrong size is a wrong ioctl number).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from space.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RuntimeFailure,
    SpaceError,
)

PathLike = str | os.PathLike[str]

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
# errno -> (error type, message with {op} and {p}, whether the details carry the errno)
_ERRNO_ERRORS: dict[int, tuple[type[SpaceError], str, bool]] = {
    errno.ENOENT: (NotFound, "{op}: {p} does not exist", False),
    errno.EEXIST: (AlreadyExists, "{op}: {p} already exists", False),
    errno.ENOSPC: (ResourceExhausted, "{op}: no space left for {p}", True),
    errno.EDQUOT: (ResourceExhausted, "{op}: no space left for {p}", True),
    errno.ENOTTY: (InvalidArgument, "{op}: {p} is not on the same btrfs filesystem", True),
    errno.EXDEV: (InvalidArgument, "{op}: {p} is not on the same btrfs filesystem", True),
    errno.EINVAL: (InvalidArgument, "{op}: invalid target {p} (not a btrfs subvolume?)", False),
    errno.ENOTDIR: (InvalidArgument, "{op}: {p} is not a directory", False),
}


def translate(exc: OSError, op: str, path: PathLike) -> SpaceError:
    p = os.fspath(path)
    code = exc.errno
    known = _ERRNO_ERRORS.get(code) if code is not None else None
    if known is None:
        return RuntimeFailure(f"{op} {p}: {exc.strerror or exc}", path=p, errno=code)
    kind, message, with_errno = known
    details: dict[str, object] = {"path": p, "errno": code} if with_errno else {"path": p}
    return kind(message.format(op=op, p=p), **details)


@contextlib.contextmanager
def open_dir(path: PathLike, op: str) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise translate(exc, op, path) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def split_name(path: PathLike, max_len: int) -> tuple[Path, bytes]:
    p = Path(os.path.abspath(path))
    name = os.fsencode(p.name)
    if not name or name in (b".", b"..") or len(name) >= max_len:
        raise InvalidArgument(f"invalid subvolume name: {p.name!r}", path=str(p))
    return p.parent, name


def vol_args(fd: int, name: bytes) -> bytearray:
    buf = bytearray(VOL_ARGS_SIZE)
    struct.pack_into("=q", buf, 0, fd)
    buf[8 : 8 + len(name)] = name
    return buf


def vol_args_v2(fd: int, flags: int, name: bytes) -> bytearray:
    buf = bytearray(VOL_ARGS_V2_SIZE)
    VOL_ARGS_V2_HEAD.pack_into(buf, 0, fd, 0, flags)
    off = VOL_ARGS_V2_HEAD.size
    buf[off : off + len(name)] = name
    return buf


def run_progs(
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
        raise translate_progs(stderr, op, path) from exc


def translate_progs(stderr: str, op: str, path: PathLike) -> SpaceError:
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
