"""The per-command checks of a `btrfs send` stream after its first command, and the stream that hands on
only commands that passed them (the format and the first command: space.node.volumes.sendstream).

Invariants (see space.node.volumes.sendstream for the whole list of guarantees):
- Every path attribute is relative, without empty, "." or ".." components, without NUL, and does not run
  through a symlink this stream made (tracked through renames, links and unlinks).
- Clones read only from the stream's own subvolume or the expected parent.
- Path attributes travel only on the commands whose paths were examined; END ends the stream and nothing
  follows it; no later command creates a subvolume.
- CheckedStream yields bytes only in batches of whole, checked commands: a consumer that forwards what it
  gets never forwards a refused command.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from space.node.volumes.sendstream import (
    A_CLONE_CTRANSID,
    A_CLONE_LEN,
    A_CLONE_OFFSET,
    A_CLONE_PATH,
    A_CLONE_UUID,
    A_PATH,
    A_PATH_LINK,
    A_PATH_TO,
    C_CLONE,
    C_END,
    C_LINK,
    C_RENAME,
    C_RMDIR,
    C_SNAPSHOT,
    C_SUBVOL,
    C_SYMLINK,
    C_UNLINK,
    MAGIC,
    MAX_PATH_BYTES,
    ROOT_COMMANDS,
    STREAM_HEADER,
    Command,
    Expected,
    StreamHeader,
    attr,
    check_expected,
    corrupt,
    format_uuid,
    header_of,
    read_command,
    read_stream_start,
)


def _relative_path(raw: bytes, what: str, index: int, *, allow_root: bool) -> tuple[bytes, ...]:
    """The components of a path inside the subvolume; refuses anything that could leave it."""
    if not raw:
        if allow_root:
            return ()
        raise corrupt(f"{what} of command {index} is empty", command_index=index)
    if len(raw) > MAX_PATH_BYTES or b"\0" in raw:
        raise corrupt(f"{what} of command {index} is too long or holds NUL", command_index=index)
    if raw.startswith(b"/"):
        raise corrupt(f"{what} {raw[:80]!r} of command {index} is absolute", command_index=index)
    parts = tuple(raw.split(b"/"))
    for part in parts:
        if part in (b"", b".", b".."):
            raise corrupt(
                f"{what} {raw[:80]!r} of command {index} has a {part.decode() or 'empty'!r} component",
                command_index=index,
            )
    return parts


class _Symlinks:
    """Paths this stream made symlinks; a later path through one of them would be followed by receive.

    `under` counts the tracked symlinks below each directory prefix, so the frequent renames and unlinks
    of a stream (every new inode arrives under an orphan name, then is renamed) cost O(depth) unless they
    really move a directory holding tracked symlinks."""

    def __init__(self) -> None:
        self.paths: set[tuple[bytes, ...]] = set()
        self.under: dict[tuple[bytes, ...], int] = {}

    def check(self, parts: tuple[bytes, ...], what: str, index: int) -> None:
        if not self.paths:
            return
        for end in range(1, len(parts)):
            if parts[:end] in self.paths:
                shown = b"/".join(parts)[:80]
                raise corrupt(f"{what} {shown!r} of command {index} runs through a symlink it made")

    def add(self, parts: tuple[bytes, ...]) -> None:
        if parts in self.paths:
            return
        self.paths.add(parts)
        for end in range(1, len(parts)):
            self.under[parts[:end]] = self.under.get(parts[:end], 0) + 1

    def _discard(self, parts: tuple[bytes, ...]) -> None:
        self.paths.discard(parts)
        for end in range(1, len(parts)):
            left = self.under[parts[:end]] - 1
            if left:
                self.under[parts[:end]] = left
            else:
                del self.under[parts[:end]]

    def _taken(self, parts: tuple[bytes, ...]) -> list[tuple[bytes, ...]]:
        """Tracked symlinks at or below `parts`, removed from tracking."""
        found = [parts] if parts in self.paths else []
        if self.under.get(parts):
            n = len(parts)
            found += [p for p in self.paths if len(p) > n and p[:n] == parts]
        for p in found:
            self._discard(p)
        return found

    def rename(self, src: tuple[bytes, ...], dst: tuple[bytes, ...]) -> None:
        moved = self._taken(src)
        self._taken(dst)  # whatever `dst` was is replaced
        for p in moved:
            self.add(dst + p[len(src) :])

    def remove(self, parts: tuple[bytes, ...]) -> None:
        self._taken(parts)


#: The attributes naming a clone's source; only CLONE may carry them (the first command, a SNAPSHOT, names
#: its parent with them and is checked by `StreamChecker.first`).
CLONE_ATTRS = (A_CLONE_UUID, A_CLONE_CTRANSID, A_CLONE_OFFSET, A_CLONE_LEN)


def _check_foreign_path_attrs(command: Command, index: int) -> None:
    """Path and clone attributes travel only on the commands whose values the checker examined: one it did
    not look at is refused, not forwarded (a clone source on a MKFILE would otherwise pass unchecked)."""
    cmd = command.cmd
    for kind in (A_PATH_TO, A_CLONE_PATH):
        if kind in command.attrs and cmd not in (C_RENAME, C_CLONE):
            raise corrupt(f"{command.name} (command {index}) carries path attribute {kind}")
    if A_PATH_LINK in command.attrs and cmd not in (C_SYMLINK, C_LINK):
        raise corrupt(f"{command.name} (command {index}) carries a link target")
    for kind in CLONE_ATTRS:
        if kind in command.attrs and cmd != C_CLONE:
            raise corrupt(f"{command.name} (command {index}) carries clone attribute {kind}")


class StreamChecker:
    """Checks a stream command by command against what the caller expects (see the module invariants)."""

    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self.header: StreamHeader | None = None
        self.commands = 0
        self.ended = False
        self._symlinks = _Symlinks()
        self._clone_sources: frozenset[str] = frozenset()

    def first(self, command: Command, version: int) -> StreamHeader:
        header = header_of(command, version)
        check_expected(header, self.expected)
        self.header = header
        self._clone_sources = frozenset({header.uuid, *self.expected.parent_uuids})
        self.commands = 1
        return header

    def next(self, command: Command) -> None:
        index = self.commands
        self.commands += 1
        if self._is_end(command, index):
            return
        cmd = command.cmd
        path = self._path(command, A_PATH, index, allow_root=cmd in ROOT_COMMANDS)
        if cmd == C_SYMLINK:
            content = attr(command, A_PATH_LINK, None, index)
            if len(content) > MAX_PATH_BYTES or b"\0" in content or not content:
                raise corrupt(f"symlink target of command {index} is empty, too long or holds NUL")
            self._symlinks.add(path)
        elif cmd == C_LINK:
            target = self._path(command, A_PATH_LINK, index, allow_root=False)
            if target in self._symlinks.paths:
                self._symlinks.add(path)
        elif cmd == C_RENAME:
            destination = self._path(command, A_PATH_TO, index, allow_root=False)
            self._symlinks.rename(path, destination)
        elif cmd in (C_UNLINK, C_RMDIR):
            self._symlinks.remove(path)
        elif cmd == C_CLONE:
            self._check_clone(command, index)
        _check_foreign_path_attrs(command, index)

    def _is_end(self, command: Command, index: int) -> bool:
        """Whether `command` is the stream's END; refuses one out of place (before the subvolume, after END,
        a second subvolume)."""
        if self.header is None:
            raise corrupt("commands before the subvolume")
        if self.ended:
            raise corrupt(f"command {index} ({command.name}) follows END", command_index=index)
        if command.cmd in (C_SUBVOL, C_SNAPSHOT):
            raise corrupt(f"command {index} starts a second subvolume", command_index=index)
        if command.cmd != C_END:
            return False
        if command.attrs:
            raise corrupt("END carries attributes")
        self.ended = True
        return True

    def _check_clone(self, command: Command, index: int) -> None:
        source = format_uuid(attr(command, A_CLONE_UUID, 16, index))
        if source not in self._clone_sources:
            raise corrupt(
                f"CLONE (command {index}) reads from subvolume {source}, neither this stream's nor "
                "its parent", command_index=index,
            )  # fmt: skip
        self._path(command, A_CLONE_PATH, index, allow_root=False)

    def _path(self, command: Command, kind: int, index: int, *, allow_root: bool) -> tuple[bytes, ...]:
        what = {A_PATH: "path", A_PATH_TO: "rename target", A_PATH_LINK: "link target"}.get(kind, "path")
        if kind == A_CLONE_PATH:
            what = "clone source path"
        parts = _relative_path(attr(command, kind, None, index), what, index, allow_root=allow_root)
        self._symlinks.check(parts, what, index)
        return parts

    def finish(self) -> StreamHeader:
        if self.header is None:
            raise corrupt("the stream has no command")
        if not self.ended:
            raise corrupt("the stream ends without END (truncated)")
        return self.header


class CheckedStream:
    """A stream read once, checked command by command while it is handed on.

    The header and first command are read and checked when it is made (before anything is applied);
    `chunks()` then yields the stream's bytes in batches of whole commands, each batch only after every
    command in it passed the checks, so a consumer that forwards what it gets never forwards a refused
    command. The iterator's last step checks the end (END, then nothing).
    """

    def __init__(self, source: BinaryIO, expected: Expected) -> None:
        self._source = source
        self.version = read_stream_start(source)
        self.checker = StreamChecker(expected)
        first = read_command(source, index=0)
        if first is None:
            raise corrupt("the stream has no command")
        self.header = self.checker.first(first, self.version)
        self._first = first

    def chunks(self, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        batch = bytearray(STREAM_HEADER.pack(MAGIC, self.version))
        batch += self._first.raw
        while (command := read_command(self._source, index=self.checker.commands)) is not None:
            self.checker.next(command)
            batch += command.raw
            if len(batch) >= chunk_bytes:
                yield bytes(batch)
                batch.clear()
        self.checker.finish()
        yield bytes(batch)


def check_stream(source: BinaryIO, expected: Expected) -> StreamHeader:
    """Read and check a whole stream without applying it."""
    checked = CheckedStream(source, expected)
    for _chunk in checked.chunks():
        pass
    return checked.header
