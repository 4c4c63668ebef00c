"""A small, strict reader of `btrfs send` streams (format v1, btrfs-progs `send.h`), run before and while
a stream is applied by `btrfs receive` in the root helper.

Layout: "btrfs-stream\\0", le32 version, then commands: le32 payload length, le16 command, le32 crc32c (over
the command header with the crc field zeroed, plus the payload; seed 0, no final inversion), then the
payload as TLV attributes (le16 type, le16 length, value).

What it guarantees about a stream it lets through (everything else is refused with a typed error naming
what was wrong, before the offending command reaches `btrfs receive`):
- version 1 only (what `btrfs send` without `--proto` writes), every command at most 64 KiB, known
  command and attribute numbers, each attribute at most once per command, no byte left over in a command;
- the first command creates exactly the subvolume the caller expects: SUBVOL (a full stream) only where a
  full stream is expected, otherwise SNAPSHOT (a delta) whose parent is one of the expected UUIDs; its name
  is a plain name equal to the expected one; its CRC is checked. No later command creates a subvolume;
- every path attribute is relative, without empty, "." or ".." components, without NUL; a hard link's
  target likewise; no path runs through a symlink this stream created (kernel-made streams never do);
- clones read only from the stream's own subvolume or the expected parent: a clone source is looked up by
  `btrfs receive` outside its chroot, so any other UUID or path would read another subvolume's data;
- the stream ends with END and nothing follows it (a second concatenated stream could make a second
  subvolume from any UUID on the filesystem).
The CRCs of the commands after the first are checked by `btrfs receive` itself before it applies each one
(pure-Python CRC32C runs at a few MB/s, too slow for gigabyte checkpoints). Symlinks that the *parent*
already holds are out of this reader's sight: `btrfs receive --chroot` into an empty staging directory is
what contains them (see space.node.volumes.btrfs_receive.receive).

The reader, the header and what a caller expects are here; the checks of every later command, and the
stream that forwards only checked commands, are in space.node.volumes.sendstream_check.

No I/O beyond reading the given binary stream; no privileges needed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Literal

from space.core.errors import ArtifactCorrupt, InvalidArgument, NotFound

MAGIC = b"btrfs-stream\0"
SUPPORTED_VERSIONS = frozenset({1})
STREAM_HEADER = struct.Struct("<13sI")
COMMAND_HEADER = struct.Struct("<IHI")
TLV_HEADER = struct.Struct("<HH")
MAX_COMMAND_BYTES = 64 * 1024  # v1: "no command is larger than 64KiB" (header included)
MAX_PATH_BYTES = 4095  # PATH_MAX - 1
MAX_NAME_BYTES = 255

# Commands (send.h, v1).
C_SUBVOL, C_SNAPSHOT, C_MKFILE, C_MKDIR, C_MKNOD, C_MKFIFO, C_MKSOCK, C_SYMLINK = range(1, 9)
C_RENAME, C_LINK, C_UNLINK, C_RMDIR, C_SET_XATTR, C_REMOVE_XATTR, C_WRITE, C_CLONE = range(9, 17)
C_TRUNCATE, C_CHMOD, C_CHOWN, C_UTIMES, C_END, C_UPDATE_EXTENT = range(17, 23)
C_MAX_V1 = C_UPDATE_EXTENT
# Attributes (send.h, v1).
A_UUID, A_CTRANSID, A_INO, A_SIZE, A_MODE = 1, 2, 3, 4, 5
A_PATH, A_PATH_TO, A_PATH_LINK, A_FILE_OFFSET, A_DATA = 15, 16, 17, 18, 19
A_CLONE_UUID, A_CLONE_CTRANSID, A_CLONE_PATH, A_CLONE_OFFSET, A_CLONE_LEN = 20, 21, 22, 23, 24
A_MAX_V1 = A_CLONE_LEN

# The only commands that may name the subvolume's root directory (the empty path): its attributes.
ROOT_COMMANDS = frozenset({C_SET_XATTR, C_REMOVE_XATTR, C_CHMOD, C_CHOWN, C_UTIMES})
COMMAND_NAMES = {
    C_SUBVOL: "SUBVOL", C_SNAPSHOT: "SNAPSHOT", C_MKFILE: "MKFILE", C_MKDIR: "MKDIR", C_MKNOD: "MKNOD",
    C_MKFIFO: "MKFIFO", C_MKSOCK: "MKSOCK", C_SYMLINK: "SYMLINK", C_RENAME: "RENAME", C_LINK: "LINK",
    C_UNLINK: "UNLINK", C_RMDIR: "RMDIR", C_SET_XATTR: "SET_XATTR", C_REMOVE_XATTR: "REMOVE_XATTR",
    C_WRITE: "WRITE", C_CLONE: "CLONE", C_TRUNCATE: "TRUNCATE", C_CHMOD: "CHMOD", C_CHOWN: "CHOWN",
    C_UTIMES: "UTIMES", C_END: "END", C_UPDATE_EXTENT: "UPDATE_EXTENT",
}  # fmt: skip


# --- crc32c as btrfs computes it: Castagnoli polynomial (reflected 0x82F63B78), seed 0, no final xor -----
def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """btrfs' crc32c(seed, data): the raw register update, no pre- or post-inversion."""
    table = _CRC_TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def command_crc(header_and_payload: bytes | bytearray) -> int:
    """The crc a command carries: over its header with the crc field zeroed, and its payload."""
    buf = bytearray(header_and_payload)
    buf[6:10] = b"\0\0\0\0"
    return crc32c(buf)


# --- what a stream is and what a caller expects -----------------------------------------------------------
def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class StreamHeader:
    version: int
    kind: Literal["full", "delta"]
    name: str  # the subvolume the stream creates (a plain name)
    uuid: str  # the sender's UUID of it (the receiver records it as the received UUID)
    ctransid: int
    parent_uuid: str | None  # a delta: the UUID or received UUID its parent has on the receiver
    parent_ctransid: int | None


@dataclass(frozen=True)
class Expected:
    """What a caller is prepared to receive: the subvolume's name and, for a delta, its possible parents.

    A parent's ctransid is not compared: the kernel writes the *sender's local* ctransid of the parent,
    which differs on every node that received the same base (btrfs-progs does not compare it either).
    """

    name: str
    kind: Literal["full", "delta"]
    parent_uuids: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def full(cls, name: str) -> Expected:
        return cls(name=name, kind="full")

    @classmethod
    def delta(cls, name: str, parent_uuids: set[str] | frozenset[str]) -> Expected:
        if not parent_uuids:
            raise InvalidArgument("a delta needs at least one acceptable parent UUID")
        return cls(name=name, kind="delta", parent_uuids=frozenset(u.lower() for u in parent_uuids))


@dataclass(frozen=True)
class Command:
    cmd: int
    attrs: dict[int, bytes]
    raw: bytes  # the whole command as read (header + payload), forwarded unchanged

    @property
    def name(self) -> str:
        return COMMAND_NAMES.get(self.cmd, str(self.cmd))


def corrupt(message: str, **details: object) -> ArtifactCorrupt:
    return ArtifactCorrupt(f"send stream refused: {message}", **details)


# --- reading ------------------------------------------------------------------------------------------------
def _read_exact(source: BinaryIO, size: int) -> bytes:
    chunks: list[bytes] = []
    missing = size
    while missing:
        chunk = source.read(missing)
        if not chunk:
            break
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def read_stream_start(source: BinaryIO) -> int:
    """The stream header: magic and a supported version (returned)."""
    head = _read_exact(source, STREAM_HEADER.size)
    if len(head) < STREAM_HEADER.size or not head.startswith(MAGIC):
        raise corrupt("not a btrfs send stream (bad magic)")
    version = int(STREAM_HEADER.unpack(head)[1])
    if version not in SUPPORTED_VERSIONS:
        raise corrupt(f"unsupported send stream version {version}", version=version)
    return version


def read_command(source: BinaryIO, *, index: int) -> Command | None:
    """The next command, its attributes parsed strictly; None at a clean end of input."""
    head = _read_exact(source, COMMAND_HEADER.size)
    if not head:
        return None
    if len(head) < COMMAND_HEADER.size:
        raise corrupt(f"truncated in the header of command {index}", command_index=index)
    length, cmd, _crc = COMMAND_HEADER.unpack(head)
    if COMMAND_HEADER.size + length > MAX_COMMAND_BYTES:
        raise corrupt(f"command {index} is {length} bytes long (at most 64 KiB)", command_index=index)
    if not 1 <= cmd <= C_MAX_V1:
        raise corrupt(f"command {index} has unknown type {cmd}", command_index=index)
    payload = _read_exact(source, length)
    if len(payload) != length:
        raise corrupt(f"truncated in command {index} ({COMMAND_NAMES[cmd]})", command_index=index)
    attrs: dict[int, bytes] = {}
    pos = 0
    while pos < length:
        if length - pos < TLV_HEADER.size:
            raise corrupt(f"command {index} ends inside an attribute header", command_index=index)
        kind, size = TLV_HEADER.unpack_from(payload, pos)
        pos += TLV_HEADER.size
        if not 1 <= kind <= A_MAX_V1:
            raise corrupt(f"command {index} has unknown attribute {kind}", command_index=index)
        if kind in attrs:
            # btrfs-progs keeps the *last* copy: a checker reading the first would be fooled.
            raise corrupt(f"command {index} repeats attribute {kind}", command_index=index)
        if length - pos < size:
            raise corrupt(f"attribute {kind} of command {index} overruns it", command_index=index)
        attrs[kind] = payload[pos : pos + size]
        pos += size
    return Command(cmd=cmd, attrs=attrs, raw=head + payload)


def attr(command: Command, kind: int, size: int | None, index: int) -> bytes:
    value = command.attrs.get(kind)
    if value is None:
        raise corrupt(f"{command.name} (command {index}) lacks attribute {kind}", command_index=index)
    if size is not None and len(value) != size:
        raise corrupt(f"attribute {kind} of {command.name} is {len(value)} bytes, not {size}")
    return value


def _plain_name(raw: bytes, what: str) -> str:
    if not raw or b"/" in raw or b"\0" in raw or raw in (b".", b"..") or len(raw) > MAX_NAME_BYTES:
        raise corrupt(f"{what} {raw[:64]!r} is not a plain name")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise corrupt(f"{what} {raw[:64]!r} is not UTF-8") from exc


def header_of(first: Command, version: int) -> StreamHeader:
    if first.cmd not in (C_SUBVOL, C_SNAPSHOT):
        raise corrupt(f"the first command is {first.name}, not SUBVOL or SNAPSHOT", command=first.name)
    crc = COMMAND_HEADER.unpack_from(first.raw)[2]
    if command_crc(first.raw) != crc:
        raise corrupt("the first command's crc32c does not match its content")
    name = _plain_name(attr(first, A_PATH, None, 0), "the subvolume name")
    uuid = attr(first, A_UUID, 16, 0)
    if uuid == bytes(16):
        raise corrupt("the subvolume has an empty UUID")
    (ctransid,) = struct.unpack("<Q", attr(first, A_CTRANSID, 8, 0))
    delta = first.cmd == C_SNAPSHOT
    parent_uuid: str | None = None
    parent_ctransid: int | None = None
    if delta:
        parent_uuid = format_uuid(attr(first, A_CLONE_UUID, 16, 0))
        (parent_ctransid,) = struct.unpack("<Q", attr(first, A_CLONE_CTRANSID, 8, 0))
    return StreamHeader(
        version=version,
        kind="delta" if delta else "full",
        name=name,
        uuid=format_uuid(uuid),
        ctransid=int(ctransid),
        parent_uuid=parent_uuid,
        parent_ctransid=None if parent_ctransid is None else int(parent_ctransid),
    )


def read_header(source: BinaryIO) -> StreamHeader:
    """Parse the stream header and its first command (reads at most 64 KiB from `source`)."""
    version = read_stream_start(source)
    first = read_command(source, index=0)
    if first is None:
        raise corrupt("the stream has no command")
    return header_of(first, version)


def check_expected(header: StreamHeader, expected: Expected) -> None:
    """The first command creates what the caller expects: kind, name, parent."""
    if header.kind != expected.kind:
        raise corrupt(f"a {header.kind} stream where a {expected.kind} one is expected", kind=header.kind)
    if header.name != expected.name:
        raise corrupt(f"the stream creates {header.name!r}, not {expected.name!r}", name=header.name)
    if header.uuid in expected.parent_uuids:
        raise corrupt("the stream's subvolume claims its own parent's UUID", uuid=header.uuid)
    if expected.kind == "delta" and header.parent_uuid not in expected.parent_uuids:
        # Typed NotFound: a genuine delta made against another base is a "wrong node" case, not corruption.
        raise NotFound(
            f"the delta {header.name!r} was made against parent {header.parent_uuid}, which is not the "
            f"expected parent ({', '.join(sorted(expected.parent_uuids))})",
            field="parent", parent_uuid=header.parent_uuid,
        )  # fmt: skip
