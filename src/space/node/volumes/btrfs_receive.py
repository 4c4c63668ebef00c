"""btrfs send and confined receive for the node helper (docs/adr/0023-confined-btrfs-receive.md).

Invariants:
- `btrfs receive` only ever runs with `--chroot` in a fresh, empty, root-only staging directory, fed
  through a pipe with bytes this process read once and checked (sendstream) against what the caller
  expects; the subvolume moves to its destination only after staging was found to hold it and nothing else.
  A stream that fails a check is a typed ArtifactCorrupt (NotFound when a delta names another parent).
- Staging directories are named STAGING_PREFIX + helper pid + random, beside their destination; every
  receive removes its own in every case, and sweeps those a killed helper (another pid) left.
- Nothing here goes through a shell: btrfs-progs runs as argv lists.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import BinaryIO, cast

from space.core.errors import (
    AlreadyExists,
    ArtifactCorrupt,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RuntimeFailure,
    SpaceError,
)
from space.node.volumes import sendstream, sendstream_check
from space.node.volumes.btrfs import (
    delete_subvolume,
    get_readonly,
    is_btrfs,
    is_subvolume,
    nested_subvolumes,
    require_subvolume,
    set_readonly,
    subvolume_identity,
)
from space.node.volumes.btrfs_ioctl import BTRFS, PathLike, run_progs, translate

RECEIVE_READ_BYTES = 1 << 20
STAGING_PREFIX = ".receive-"  # + helper pid + random: one per receive, beside its destination
StreamTarget = PathLike | int | BinaryIO


def send(subvol: PathLike, out: StreamTarget, *, parent: PathLike | None = None) -> None:
    """Write a `btrfs send` stream of read-only `subvol` to `out` (a path, an fd, or a binary file object).

    With `parent` (read-only, e.g. the template), the stream is a delta that `receive` can apply only where a
    subvolume with the parent's UUID or received UUID exists.
    """
    require_subvolume(subvol, "send")
    if not get_readonly(subvol):
        raise InvalidArgument("send needs a read-only subvolume", path=os.fspath(subvol))
    argv = [BTRFS, "send", "-q"]
    if parent is not None:
        require_subvolume(parent, "send parent")
        if not get_readonly(parent):
            raise InvalidArgument("send parent must be read-only", path=os.fspath(parent))
        argv += ["-p", os.fspath(parent)]
    if isinstance(out, (str, os.PathLike)):
        run_progs([*argv, "-f", os.fspath(out), os.fspath(subvol)], "send", subvol)
    else:
        run_progs([*argv, os.fspath(subvol)], "send", subvol, stdout=out)


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
        raise translate(exc, "open send stream", p) from exc
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
            for inner in nested_subvolumes(entry):
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
        checked = sendstream_check.CheckedStream(reader, expected)
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
                raise translate(exc, "receive: move into place", dest) from exc
            set_readonly(dest, True)
        finally:
            _clear_staging(staging)
        return dest
    finally:
        if owned:
            reader.close()


def _receive_into(checked: sendstream_check.CheckedStream, staging: Path) -> None:
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
