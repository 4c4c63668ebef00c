"""Build, decode and re-encode `btrfs send` streams for tests: synthetic ones from scratch, and real ones
(made by `btrfs send`) with commands patched, inserted or dropped and the CRCs recomputed, so a test can
hand `btrfs receive` exactly the hostile stream it means to."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from space.node.volumes import sendstream as ss

Attr = tuple[int, bytes]


@dataclass
class Cmd:
    cmd: int
    attrs: list[Attr] = field(default_factory=list)

    def get(self, kind: int) -> bytes | None:
        return next((value for k, value in self.attrs if k == kind), None)

    def set(self, kind: int, value: bytes) -> None:
        self.attrs = [(k, value if k == kind else v) for k, v in self.attrs]


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def encode_command(cmd: int, attrs: list[Attr], *, crc: int | None = None) -> bytes:
    payload = b"".join(struct.pack("<HH", kind, len(value)) + value for kind, value in attrs)
    raw = struct.pack("<IHI", len(payload), cmd, 0) + payload
    value = ss.command_crc(raw) if crc is None else crc
    return raw[:6] + struct.pack("<I", value) + raw[10:]


def encode(commands: list[Cmd], *, version: int = 1) -> bytes:
    return ss.MAGIC + struct.pack("<I", version) + b"".join(encode_command(c.cmd, c.attrs) for c in commands)


def decode(data: bytes) -> list[Cmd]:
    """The commands of a well-formed stream, attributes in their order (the inverse of `encode`)."""
    assert data.startswith(ss.MAGIC)
    pos = ss.STREAM_HEADER.size
    out: list[Cmd] = []
    while pos < len(data):
        length, cmd, _crc = struct.unpack_from("<IHI", data, pos)
        payload = data[pos + 10 : pos + 10 + length]
        pos += 10 + length
        attrs: list[Attr] = []
        at = 0
        while at < len(payload):
            kind, size = struct.unpack_from("<HH", payload, at)
            attrs.append((kind, payload[at + 4 : at + 4 + size]))
            at += 4 + size
        out.append(Cmd(cmd, attrs))
    return out


def subvol(name: bytes, uuid: bytes = bytes(range(1, 17)), ctransid: int = 9) -> Cmd:
    return Cmd(ss.C_SUBVOL, [(ss.A_PATH, name), (ss.A_UUID, uuid), (ss.A_CTRANSID, u64(ctransid))])


def snapshot(name: bytes, parent: bytes, uuid: bytes = bytes(range(1, 17))) -> Cmd:
    return Cmd(
        ss.C_SNAPSHOT,
        [(ss.A_PATH, name), (ss.A_UUID, uuid), (ss.A_CTRANSID, u64(9)),
         (ss.A_CLONE_UUID, parent), (ss.A_CLONE_CTRANSID, u64(5))],
    )  # fmt: skip


def mkfile(path: bytes, ino: int = 257) -> Cmd:
    return Cmd(ss.C_MKFILE, [(ss.A_PATH, path), (ss.A_INO, u64(ino))])


def mkdir(path: bytes, ino: int = 258) -> Cmd:
    return Cmd(ss.C_MKDIR, [(ss.A_PATH, path), (ss.A_INO, u64(ino))])


def symlink(path: bytes, target: bytes, ino: int = 259) -> Cmd:
    return Cmd(ss.C_SYMLINK, [(ss.A_PATH, path), (ss.A_INO, u64(ino)), (ss.A_PATH_LINK, target)])


def rename(src: bytes, dst: bytes) -> Cmd:
    return Cmd(ss.C_RENAME, [(ss.A_PATH, src), (ss.A_PATH_TO, dst)])


def link(path: bytes, existing: bytes) -> Cmd:
    return Cmd(ss.C_LINK, [(ss.A_PATH, path), (ss.A_PATH_LINK, existing)])


def unlink(path: bytes) -> Cmd:
    return Cmd(ss.C_UNLINK, [(ss.A_PATH, path)])


def write(path: bytes, data: bytes, offset: int = 0) -> Cmd:
    return Cmd(ss.C_WRITE, [(ss.A_PATH, path), (ss.A_FILE_OFFSET, u64(offset)), (ss.A_DATA, data)])


def clone(path: bytes, source_uuid: bytes, source_path: bytes) -> Cmd:
    return Cmd(
        ss.C_CLONE,
        [(ss.A_PATH, path), (ss.A_FILE_OFFSET, u64(0)), (ss.A_CLONE_LEN, u64(4096)),
         (ss.A_CLONE_UUID, source_uuid), (ss.A_CLONE_CTRANSID, u64(5)), (ss.A_CLONE_PATH, source_path),
         (ss.A_CLONE_OFFSET, u64(0))],
    )  # fmt: skip


def chmod(path: bytes, mode: int = 0o644) -> Cmd:
    return Cmd(ss.C_CHMOD, [(ss.A_PATH, path), (ss.A_MODE, u64(mode))])


def end() -> Cmd:
    return Cmd(ss.C_END, [])
