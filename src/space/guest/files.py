"""File calls: read, write, list, stat, mkdir, remove, rename, chmod.

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
- A listing too big for one frame is sent in EVENT {"type": "entries"} batches before the RESULT.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Any

from space.guest.channel import Call, Cancelled, GuestError
from space.guest.params import REQUIRED, get_bool, get_int, get_str
from space.guest.settings import SETTINGS
from space.protocol import methods as m
from space.protocol.frames import CHUNK_SIZE, MAX_PAYLOAD, Channel

if TYPE_CHECKING:
    from space.guest.daemon import Daemon

DEFAULT_FILE_MODE = 0o644
LIST_BATCH_BYTES = MAX_PAYLOAD // 2  # JSON of one batch of entries stays well under a frame


def resolve(params: dict[str, Any], key: str = "path") -> str:
    path: str = get_str(params, key)
    if not path or "\x00" in path:
        raise GuestError("invalid_argument", f"{key!r} must be a non-empty path without NUL bytes")
    return os.path.join(SETTINGS.workdir, path)


def _mode(params: dict[str, Any], key: str, default: Any) -> Any:
    mode = get_int(params, key, default)
    if mode is not None and not 0 <= mode <= 0o7777:
        raise GuestError("invalid_argument", f"{key!r} must be a permission mode 0..0o7777")
    return mode


def stat_entry(path: str, st: os.stat_result) -> dict[str, Any]:
    if stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    target = None
    if kind == "symlink":
        try:
            target = os.readlink(path)
        except OSError:
            target = None
    return {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "uid": st.st_uid,
        "gid": st.st_gid,
        "target": target,
    }


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
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory = os.path.dirname(path) or "/"
    if parents:
        os.makedirs(directory, exist_ok=True)
    try:
        existing: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise GuestError("is_a_directory", f"{path!r} is a directory")
    if append:
        return _write_in_place(call, path, mode, os.O_APPEND)
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # A device or FIFO cannot be replaced by a renamed file; write to it as a redirection would.
        return _write_in_place(call, path, mode, os.O_TRUNC)
    return _write_replacing(call, path, directory, mode, existing)


def _write_replacing(
    call: Call, path: str, directory: str, mode: int | None, existing: os.stat_result | None
) -> dict[str, Any]:
    """The body goes to a temporary file beside `path`, renamed over it only once the body is complete."""
    temp = os.path.join(directory, f".{os.path.basename(path)}.spaced-{os.urandom(6).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
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


def _write_in_place(call: Call, path: str, mode: int | None, how: int) -> dict[str, Any]:
    fd = os.open(
        path,
        os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | how,
        DEFAULT_FILE_MODE if mode is None else mode,
    )
    try:
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
    return stat_entry(path, os.lstat(path))


def files_list(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    entries: list[dict[str, Any]] = []
    with os.scandir(path) as scan:
        for item in scan:
            try:
                entries.append(stat_entry(item.path, item.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # removed while listing
    entries.sort(key=lambda entry: entry["name"])
    batch: list[dict[str, Any]] = []
    batch_bytes = 0
    for entry in entries:
        size = len(entry["path"]) * 2 + len(str(entry.get("target") or "")) + 200
        if batch and batch_bytes + size > LIST_BATCH_BYTES:
            call.event({"type": m.EVENT_ENTRIES, "entries": batch})
            batch, batch_bytes = [], 0
        batch.append(entry)
        batch_bytes += size
    return {"entries": batch}


def files_mkdir(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    parents = get_bool(params, "parents", True)
    mode = _mode(params, "mode", 0o755)
    if parents:
        if os.path.isdir(path):
            return {}
        os.makedirs(path, mode, exist_ok=True)
    else:
        os.mkdir(path, mode)
    os.chmod(path, mode)  # mkdir's mode is filtered by the umask; the caller asked for this one
    return {}


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
    os.rename(resolve(params, "src"), resolve(params, "dst"))
    return {}


def files_chmod(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path = resolve(params)
    os.chmod(path, _mode(params, "mode", REQUIRED))
    return {}
