"""Applying one OCI/Docker image layer (an uncompressed tar stream) to a root directory, as root, without
ever leaving that directory and without ever following a symlink the image put there.

Every operation starts from a descriptor of the root and walks one path component at a time with
O_NOFOLLOW|O_DIRECTORY (the confinement `openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)` would give, written
with what Python exposes), so an entry below a symlink the image planted (`a -> /etc`, then `a/passwd`) is
refused instead of written through it.

Invariants:
- A member name is relative, normalised and bounded (no `..`, no absolute path, no NUL, each component at
  most 255 bytes, the whole at most `Budget.max_path`); anything else is refused (InvalidArgument).
- An existing path is never opened for writing: a new file, link or directory replaces what was there (a
  hard link the image made earlier cannot carry a later write elsewhere).
- Hard links name a regular file already unpacked inside the image; symlinks are stored as given and never
  followed while unpacking; device nodes and FIFOs are skipped (gVisor gives a sandbox its own /dev) and
  counted; numeric owners and mode bits (setuid included) are kept; extended attributes are dropped.
- Whiteouts: `.wh.<name>` removes `<name>` from the layers below; `.wh..wh..opq` empties its directory of
  everything this layer did not write itself. A whiteout of `.`, `..` or an empty name is refused.
- Budgets (entries, bytes, path length) are charged from each header before its data is read (TooLarge).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from space.core import errors

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_COMPONENT = 255
MAX_LINK_TARGET = 4096
MAX_DEPTH = 128  # path components: removals recurse once per level
MAX_META = 1 << 20  # bytes of one pax / GNU long-name record
_META_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
               tarfile.GNUTYPE_LONGLINK)  # fmt: skip
_COPY_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Budget:
    """What one image may unpack, across all its layers."""

    max_bytes: int = 16 << 30
    max_entries: int = 1_000_000
    max_path: int = 4096
    bytes: int = 0
    entries: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def charge(self, info: tarfile.TarInfo) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise errors.TooLarge(
                f"the image has more than {self.max_entries} entries", limit=self.max_entries
            )
        if info.isreg():
            self.bytes += info.size
            if self.bytes > self.max_bytes:
                raise errors.TooLarge(
                    f"the image unpacks to more than {self.max_bytes} bytes", limit=self.max_bytes
                )

    def skip(self, kind: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1


class BoundedTarInfo(tarfile.TarInfo):
    """A header whose extension records (pax, GNU long names) are read into memory only when small: a
    forged 2 GiB pax header is refused before tarfile reads it."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES and self.size > MAX_META:
            raise tarfile.HeaderError(f"a {self.size}-byte extended header (at most {MAX_META})")
        return super()._proc_member(tarfile_)  # type: ignore[misc,no-any-return]


def refuse(message: str, name: str, reason: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(message, field="image", entry=name[:256], reason=reason)


def clean_path(name: str, max_path: int) -> tuple[str, ...]:
    """The components of a member name; () for the image root itself. Refuses what could leave the root."""
    if "\x00" in name or len(name.encode("utf-8", "surrogateescape")) > max_path:
        raise refuse(f"entry name {name[:80]!r} is too long or holds NUL", name, "bad_name")
    if name.startswith("/"):
        raise refuse(f"entry {name[:80]!r} is an absolute path", name, "absolute_path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if len(parts) > MAX_DEPTH:
        raise refuse(f"entry {name[:80]!r} is nested deeper than {MAX_DEPTH}", name, "bad_name")
    for part in parts:
        if part == "..":
            raise refuse(f"entry {name[:80]!r} climbs out of the image with '..'", name, "path_traversal")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT:
            raise refuse(f"entry {name[:80]!r} has a component longer than 255 bytes", name, "bad_name")
    return tuple(parts)


@contextlib.contextmanager
def open_dir(root_fd: int, parts: tuple[str, ...], *, create: bool, name: str) -> Iterator[int]:
    """A descriptor of the directory `parts` beneath `root_fd`, walked without following any symlink;
    missing directories are made (0755, root) when `create`, as tar does for an entry without its parents."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o700, dir_fd=fd)
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.fchmod(next_fd, 0o755)  # explicit: the helper's own umask is owner-only
            except OSError as exc:  # ELOOP (a symlink) or ENOTDIR (a file): never walked through
                raise refuse(
                    f"entry {name[:80]!r} goes through {part!r}, which is not a directory",
                    name,
                    "through_symlink",
                ) from exc
            os.close(fd)
            fd = next_fd
        yield fd
    finally:
        os.close(fd)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_at(dir_fd: int, name: str) -> None:
    """Remove `name` (a whole tree if a directory) beneath `dir_fd`, following no symlink."""
    st = lstat_at(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for entry in os.listdir(child):
            remove_at(child, entry)
    finally:
        os.close(child)
    os.rmdir(name, dir_fd=dir_fd)


class LayerWriter:
    """Applies the members of one layer, in order, beneath `root_fd`."""

    def __init__(self, root_fd: int, budget: Budget) -> None:
        self.root_fd = root_fd
        self.budget = budget
        self.written: set[tuple[str, ...]] = set()  # paths this layer wrote (opaque dirs keep them)
        self.ancestors: set[tuple[str, ...]] = set()  # and their parents

    def apply(self, layer: IO[bytes]) -> None:
        try:
            archive = tarfile.open(fileobj=layer, mode="r|", tarinfo=BoundedTarInfo)  # noqa: SIM115 - closed below
        except (tarfile.TarError, RecursionError) as exc:
            raise refuse(f"a layer is not a tar stream: {exc}", "", "bad_layer") from exc
        members: list[tarfile.TarInfo] = vars(archive)["members"]
        with archive:
            while True:
                try:
                    info = archive.next()
                except (tarfile.TarError, RecursionError) as exc:  # RecursionError: a chain of pax headers
                    raise refuse(f"a layer is truncated or corrupt: {exc}", "", "corrupt_layer") from exc
                if info is None:
                    break
                members.clear()  # streaming: keep no per-entry state (1e6 entries stay small)
                self.budget.charge(info)
                self._member(archive, info)

    def _mark(self, parts: tuple[str, ...]) -> None:
        self.written.add(parts)
        for depth in range(len(parts)):
            self.ancestors.add(parts[:depth])

    def _member(self, archive: tarfile.TarFile, info: tarfile.TarInfo) -> None:
        parts = clean_path(info.name, self.budget.max_path)
        if not parts:
            return  # the image root itself: the subvolume's root keeps its own mode
        base = parts[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(parts, info.name)
            return
        if info.ischr() or info.isblk() or info.isfifo():
            self.budget.skip("device" if not info.isfifo() else "fifo")
            return
        if not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
            raise refuse(f"entry {info.name[:80]!r} has an unsupported type", info.name, "bad_type")
        with open_dir(self.root_fd, parts[:-1], create=True, name=info.name) as parent:
            if info.isdir():
                self._directory(parent, base, info)
            elif info.isreg():
                self._file(parent, base, info, archive)
            elif info.issym():
                self._symlink(parent, base, info)
            else:
                self._hardlink(parent, base, info, parts)
        self._mark(parts)

    def _whiteout(self, parts: tuple[str, ...], name: str) -> None:
        base = parts[-1]
        with open_dir(self.root_fd, parts[:-1], create=True, name=name) as parent:
            if base == OPAQUE:
                self._opaque(parent, parts[:-1])
                self._mark(parts[:-1])
                return
            target = base[len(WHITEOUT) :]
            if target in ("", ".", "..") or target.startswith(WHITEOUT):
                raise refuse(f"whiteout {name[:80]!r} names no entry", name, "bad_whiteout")
            remove_at(parent, target)

    def _opaque(self, dir_fd: int, parts: tuple[str, ...]) -> None:
        """Hide what the layers below put in this directory: keep only what this layer wrote."""
        for entry in os.listdir(dir_fd):
            path = (*parts, entry)
            if path in self.written or path in self.ancestors:
                st = lstat_at(dir_fd, entry)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    child = os.open(entry, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        self._opaque(child, path)
                    finally:
                        os.close(child)
                continue
            remove_at(dir_fd, entry)

    @staticmethod
    def _own(fd: int, info: tarfile.TarInfo) -> None:
        os.fchown(fd, info.uid, info.gid)
        os.fchmod(fd, info.mode & 0o7777)  # after chown, which clears setuid/setgid bits

    def _directory(self, parent: int, base: str, info: tarfile.TarInfo) -> None:
        st = lstat_at(parent, base)
        if st is None or not stat.S_ISDIR(st.st_mode):
            remove_at(parent, base)
            os.mkdir(base, 0o700, dir_fd=parent)
        fd = os.open(base, _DIR_FLAGS, dir_fd=parent)
        try:
            self._own(fd, info)
        finally:
            os.close(fd)

    def _file(self, parent: int, base: str, info: tarfile.TarInfo, archive: tarfile.TarFile) -> None:
        remove_at(parent, base)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(base, flags, 0o600, dir_fd=parent)
        try:
            source = archive.extractfile(info)
            assert source is not None  # a regular member always has a reader
            remaining = info.size
            try:
                while remaining > 0:
                    chunk = source.read(min(_COPY_CHUNK, remaining))
                    if not chunk:
                        raise refuse(f"entry {info.name[:80]!r} is truncated", info.name, "truncated")
                    _write_all(fd, chunk)
                    remaining -= len(chunk)
            except tarfile.TarError as exc:
                raise refuse(f"entry {info.name[:80]!r} is truncated: {exc}", info.name, "truncated") from exc
            self._own(fd, info)
            os.utime(fd, (info.mtime, info.mtime))
        finally:
            os.close(fd)

    @staticmethod
    def _symlink(parent: int, base: str, info: tarfile.TarInfo) -> None:
        target = info.linkname
        if not target or "\x00" in target or len(target.encode("utf-8", "surrogateescape")) > MAX_LINK_TARGET:
            raise refuse(f"symlink {info.name[:80]!r} has a bad target", info.name, "bad_link")
        remove_at(parent, base)
        os.symlink(target, base, dir_fd=parent)
        os.chown(base, info.uid, info.gid, dir_fd=parent, follow_symlinks=False)

    def _hardlink(self, parent: int, base: str, info: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        target = clean_path(info.linkname, self.budget.max_path)
        if not target or target == parts:
            raise refuse(f"hard link {info.name[:80]!r} names itself or the root", info.name, "bad_link")
        with open_dir(self.root_fd, target[:-1], create=False, name=info.linkname) as target_dir:
            st = lstat_at(target_dir, target[-1])
            if st is None or not stat.S_ISREG(st.st_mode):
                raise refuse(
                    f"hard link {info.name[:80]!r} names {info.linkname[:80]!r}, not a file of the image",
                    info.name,
                    "bad_link",
                )
            remove_at(parent, base)
            os.link(target[-1], base, src_dir_fd=target_dir, dst_dir_fd=parent, follow_symlinks=False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
