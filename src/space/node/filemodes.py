"""Owner-only file modes for everything a SPACE process writes on the host (ADR 0022).

Invariants:
- Every SPACE process (control plane, node agent, root helper, `space up`) runs with `OWNER_ONLY_UMASK`, so a
  file it creates without an explicit mode is readable by its owner only; children inherit the umask.
- `restrict` and `restrict_tree` only ever take permission bits away (group and other), never follow a
  symlink, and leave sockets, devices and fifos alone: they tighten what older runs left behind.
- `open_private_log` opens an append-only log that is 0600 whether or not it existed before.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import stat

OWNER_ONLY_UMASK = 0o077
GROUP_AND_OTHER = 0o077


def set_owner_only_umask() -> None:
    """Called first thing by every SPACE entry point (see the module invariants)."""
    os.umask(OWNER_ONLY_UMASK)


def restrict(path: str | os.PathLike[str], *, keep: int = 0) -> bool:
    """Remove the group and other bits of a regular file or directory (except those in `keep`), without
    following a symlink. Returns whether `path` was such an entry (False: absent, a link, a socket...)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False  # absent, a symlink (ELOOP), or a socket (ENXIO): nothing to tighten here
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return False
        wanted = stat.S_IMODE(mode) & ~(GROUP_AND_OTHER & ~keep)
        if wanted != stat.S_IMODE(mode):
            os.fchmod(fd, wanted)
        return True
    finally:
        os.close(fd)


def restrict_tree(root: str | os.PathLike[str]) -> None:
    """`restrict` on `root` and everything under it (not descending into symlinked directories)."""
    if not restrict(root):
        return
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                restrict(os.path.join(dirpath, name))


def open_private_log(path: pathlib.Path) -> int:
    """An O_APPEND descriptor on `path`, 0600 even if an older run created it with a wider mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def create_private_file(path: pathlib.Path) -> None:
    """Make sure `path` exists as a 0600 regular file (empty if new), so that whoever fills it later (for
    example SQLite, whose WAL and shared-memory files copy the database's mode) starts from owner-only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~GROUP_AND_OTHER)
    finally:
        os.close(fd)


def replace_private_file(path: pathlib.Path, body: bytes, *, durable: bool = True) -> None:
    """Write `body` as `path`, 0600, atomically (a temporary file renamed over it; a reader sees the old
    file or the new one, never half). `durable`: fsync the data before the rename, for state that must
    survive a machine restart, not only a process restart."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
