"""File calls: read, write, list, stat, mkdir, remove, rename, chmod (entries: space.guest.fileinfo;
extended attributes: space.guest.xattrs).

Invariants:
- Paths are absolute or relative to the work directory (/work, see settings.py); a NUL byte or an empty
  path is invalid_argument.
- Reads and writes stream: memory per call is one CHUNK_SIZE buffer (plus the bounded request-body queue),
  whatever the file size.
- A non-append write never leaves a half-written file at `path`: the body goes to a temporary file in the
  same directory, which is renamed over the target only after the whole body arrived; on any failure or
  CANCEL the temporary file is removed. Exceptions, where a rename cannot work: appends, devices/FIFOs,
  and a target that is a mount point (EBUSY) are written in place.
- Overwriting keeps the target's mode (and, as root, its owner) unless "mode" is given; writing through a
  symlink writes its target, as a shell redirection would.
- A file or directory that a write or mkdir creates (parents included) belongs to the call's "user", else
  to the template's default user (SPACED_USER), else to root; it is chowned before any byte is written.
- A listing too big for one frame is sent in EVENT {"type": "entries"} batches before the RESULT; it is
  bounded in depth and entries (space.guest.fileinfo) and says whether it was cut ("truncated").
- mkdir says whether it made the directory ("created"); mkdir and rename answer the resulting entry.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Any

from space.guest import fileinfo, xattrs
from space.guest.channel import Call, Cancelled, GuestError
from space.guest.fileinfo import resolve
from space.guest.launch import resolve_user
from space.guest.params import REQUIRED, get_bool, get_int
from space.guest.settings import SETTINGS
from space.protocol import methods as m
from space.protocol.frames import CHUNK_SIZE, MAX_PAYLOAD, Channel

if TYPE_CHECKING:
    from space.guest.daemon import Daemon

DEFAULT_FILE_MODE = 0o644
LIST_BATCH_BYTES = MAX_PAYLOAD // 2  # JSON of one batch of entries stays well under a frame


def _mode(params: dict[str, Any], key: str, default: Any) -> Any:
    mode = get_int(params, key, default)
    if mode is not None and not 0 <= mode <= 0o7777:
        raise GuestError("invalid_argument", f"{key!r} must be a permission mode 0..0o7777")
    return mode


def _owner(params: dict[str, Any]) -> tuple[int, int] | None:
    """(uid, gid) that what this call creates belongs to; None: the daemon's own user (nothing to chown)."""
    named = params.get("user")
    user = resolve_user(SETTINGS.user if named is None else named)
    if user is None or user[0] == os.geteuid():
        return None
    return user[0], user[1]


def _make_dirs(path: str, mode: int, owner: tuple[int, int] | None) -> None:
    """`mkdir -p` whose new directories (only those) belong to `owner`."""
    missing: list[str] = []
    current = path
    while current not in ("", "/") and not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    os.makedirs(path, mode, exist_ok=True)
    if owner is not None:
        for directory in missing:
            with contextlib.suppress(OSError):
                os.lchown(directory, *owner)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def files_read(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    offset = get_int(params, "offset", 0)
    length = get_int(params, "length", None)
    if offset < 0 or (length is not None and length < 0):
        raise GuestError("invalid_argument", "'offset' and 'length' must be >= 0")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise GuestError("is_a_directory", f"{path!r} is a directory")
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        remaining = length
        sent = 0
        while remaining is None or remaining > 0:
            if call.cancelled.is_set():
                raise Cancelled
            chunk = os.read(fd, CHUNK_SIZE if remaining is None else min(CHUNK_SIZE, remaining))
            if not chunk:
                break
            call.data(Channel.BODY, chunk)
            sent += len(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    finally:
        os.close(fd)
    return {"size": st.st_size, "read": sent}


def files_write(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    mode = _mode(params, "mode", None)
    append = get_bool(params, "append", False)
    parents = get_bool(params, "parents", True)
    owner = _owner(params)
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory = os.path.dirname(path) or "/"
    if parents:
        _make_dirs(directory, 0o777, owner)
    try:
        existing: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise GuestError("is_a_directory", f"{path!r} is a directory")
    new_owner = owner if existing is None else None
    if append:
        return _write_in_place(call, path, mode, os.O_APPEND, new_owner)
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # A device or FIFO cannot be replaced by a renamed file; write to it as a redirection would.
        return _write_in_place(call, path, mode, os.O_TRUNC, None)
    return _write_replacing(call, path, directory, mode, existing, owner=new_owner)


def _write_replacing(
    call: Call,
    path: str,
    directory: str,
    mode: int | None,
    existing: os.stat_result | None,
    *,
    owner: tuple[int, int] | None,
) -> dict[str, Any]:
    """The body goes to a temporary file beside `path`, renamed over it only once the body is complete."""
    temp = os.path.join(directory, f".{os.path.basename(path)}.spaced-{os.urandom(6).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        for chunk in call.body():
            _write_all(fd, chunk)
        if mode is None:
            mode = stat.S_IMODE(existing.st_mode) if existing is not None else DEFAULT_FILE_MODE
        os.fchmod(fd, mode)
        if existing is not None and os.geteuid() == 0:
            with contextlib.suppress(OSError):
                os.fchown(fd, existing.st_uid, existing.st_gid)
        size = os.fstat(fd).st_size
        os.close(fd)
        fd = -1
        _move_into_place(temp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return {"size": size}


def _move_into_place(temp: str, path: str) -> None:
    try:
        os.replace(temp, path)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        # The target is a mount point (a bind-mounted file such as /etc/resolv.conf): it cannot
        # be replaced, only rewritten in place — not atomic, but the only way to change it.
        _copy_over(temp, path)
        os.unlink(temp)


def _copy_over(source: str, target: str) -> None:
    with open(source, "rb") as src, open(target, "r+b") as dst:
        dst.truncate(0)
        while chunk := src.read(CHUNK_SIZE):
            dst.write(chunk)


def _write_in_place(
    call: Call, path: str, mode: int | None, how: int, owner: tuple[int, int] | None
) -> dict[str, Any]:
    """`owner`: given only when the file did not exist, so only a file this call creates is chowned."""
    fd = os.open(
        path,
        os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | how,
        DEFAULT_FILE_MODE if mode is None else mode,
    )
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        if mode is not None:
            os.fchmod(fd, mode)
        written = 0
        for chunk in call.body():
            _write_all(fd, chunk)
            written += len(chunk)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return {"size": st.st_size if stat.S_ISREG(st.st_mode) else written}


def files_stat(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    described = fileinfo.describe(path, fileinfo.Names(), follow=get_bool(params, "follow", False))
    if get_bool(params, "xattrs", False):
        described["xattrs"] = xattrs.attributes_or_empty(path)
    return described


def files_list(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    depth = get_int(params, "depth", 1)
    limit = get_int(params, "limit", fileinfo.DEFAULT_LIST_ENTRIES)
    if not 1 <= depth <= fileinfo.MAX_DEPTH:
        raise GuestError("invalid_argument", f"'depth' must be 1..{fileinfo.MAX_DEPTH}")
    if not 1 <= limit <= fileinfo.MAX_LIST_ENTRIES:
        raise GuestError("invalid_argument", f"'limit' must be 1..{fileinfo.MAX_LIST_ENTRIES}")

    def with_xattrs(item: dict[str, Any]) -> None:
        item["xattrs"] = xattrs.attributes_or_empty(os.fsdecode(_raw_path(item)))

    def emit(batch: list[dict[str, Any]]) -> None:
        if call.cancelled.is_set():
            raise Cancelled
        call.event({"type": m.EVENT_ENTRIES, "entries": batch})

    decorate = with_xattrs if get_bool(params, "xattrs", False) else None
    last, truncated = fileinfo.list_in_batches(
        path, depth, limit, emit, batch_bytes=LIST_BATCH_BYTES, decorate=decorate
    )
    return {"entries": last, "truncated": truncated}


def _raw_path(item: dict[str, Any]) -> bytes:
    raw = item.get("path_b64")
    return base64.b64decode(raw) if raw else os.fsencode(item["path"])


def files_mkdir(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    """Answers {"created": false} for a directory that was already there (with parents; without, that is
    already_exists), and the directory's entry either way; an existing non-directory is already_exists."""
    path = resolve(params)
    parents = get_bool(params, "parents", True)
    mode = _mode(params, "mode", 0o755)
    owner = _owner(params)
    created = True
    if parents:
        if os.path.isdir(path):
            created = False
        else:
            _make_dirs(path, mode, owner)  # an existing non-directory: already_exists
    else:
        os.mkdir(path, mode)
        if owner is not None:
            os.lchown(path, *owner)
    if created:
        os.chmod(path, mode)  # mkdir's mode is filtered by the umask; the caller asked for this one
    return {"created": created, "entry": fileinfo.describe(path, fileinfo.Names())}


def files_remove(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    recursive = get_bool(params, "recursive", False)
    if os.path.realpath(path) == "/":
        raise GuestError("permission_denied", "refusing to remove the root directory")
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        if recursive:
            import shutil

            shutil.rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)
    return {}


def files_rename(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    """Answers the destination's entry; with "parents", the destination's missing parents are made."""
    destination = resolve(params, "dst")
    if get_bool(params, "parents", False):
        os.makedirs(os.path.dirname(destination) or "/", exist_ok=True)
    os.rename(resolve(params, "src"), destination)
    return {"entry": fileinfo.describe(destination, fileinfo.Names())}


def files_chmod(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    os.chmod(path, _mode(params, "mode", REQUIRED))
    return {}
