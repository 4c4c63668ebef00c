"""Framing of the private channel between the node and `spaced` (standard library only).

Frame layout, big-endian, a 16-byte header then the payload:

    magic   2 bytes  b"SP"
    type    1 byte   FrameType
    flags   1 byte   reserved, always 0 on write, ignored on read
    stream  4 bytes  call id chosen by the host; 0 is the connection itself
    length  4 bytes  payload length, at most MAX_PAYLOAD
    hcrc    4 bytes  CRC-32 of the 12 header bytes before it

Invariants:
- The decoder never raises on malformed input. It *yields* a ProtocolError value in place of a frame and
  carries on: a bad magic or header checksum makes it scan forward to the next valid header (resync); an
  oversized frame is skipped whole; an unknown type is reported with its stream id. So one garbled write
  can never wedge or kill a reader.
- Payloads are raw bytes (no base64): DATA frames carry one channel byte then file/process bytes; the
  control frames (HELLO, CALL, EVENT, RESULT, ERROR) carry UTF-8 JSON objects; WINDOW (protocol 2) carries a
  4-byte credit increment (see space.protocol.flow).
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Iterator
from typing import Any

from space.protocol.errors import (
    CorruptFrame,
    FrameTooLarge,
    MalformedPayload,
    ProtocolError,
    TruncatedFrame,
    UnknownFrameType,
)

MAGIC = b"SP"
HEADER = struct.Struct(">2sBBII")  # magic, type, flags, stream, length
HEADER_SIZE = HEADER.size + 4  # + crc32
MAX_PAYLOAD = 1 << 20  # 1 MiB: bounds memory per frame on both sides
MAX_STREAM_ID = 0xFFFFFFFF
CHUNK_SIZE = 256 * 1024  # preferred DATA payload for bulk transfers


class FrameType(enum.IntEnum):
    HELLO = 1  # JSON: version negotiation and readiness, stream 0
    CALL = 2  # JSON {"method", "params"}: opens a call on `stream`
    DATA = 3  # channel byte + raw bytes, within a call
    EOF = 4  # channel byte: that channel of the call is finished
    EVENT = 5  # JSON: an intermediate message of a call
    RESULT = 6  # JSON: the call ended successfully
    ERROR = 7  # JSON {"code", "message", ...}: the call ended with an error (stream 0: channel-level)
    CANCEL = 8  # host to guest: stop the call on `stream`
    WINDOW = 9  # protocol >= 2: 4-byte big-endian credit increment for `stream` (space.protocol.flow)


class Channel(enum.IntEnum):
    BODY = 0  # request/response body: a process's stdin, a file's content
    STDOUT = 1
    STDERR = 2


TERMINAL_TYPES = frozenset({FrameType.RESULT, FrameType.ERROR})


class Frame:
    """One decoded frame. A plain slotted class, not a dataclass: importing `dataclasses` costs the
    in-sandbox daemon several milliseconds of boot time."""

    __slots__ = ("payload", "stream", "type")

    def __init__(self, type: FrameType, stream: int, payload: bytes = b"") -> None:
        self.type = type
        self.stream = stream
        self.payload = payload

    def __repr__(self) -> str:
        return f"Frame({self.type.name}, stream={self.stream}, {len(self.payload)} bytes)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return (self.type, self.stream, self.payload) == (other.type, other.stream, other.payload)

    __hash__ = None  # type: ignore[assignment]

    def json(self) -> dict[str, Any]:
        """Decode a control frame's JSON object payload."""
        try:
            value = json.loads(self.payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MalformedPayload(f"{self.type.name} frame payload is not JSON: {exc}", self.stream) from exc
        if not isinstance(value, dict):
            raise MalformedPayload(f"{self.type.name} frame payload is not a JSON object", self.stream)
        return value

    def channel_data(self) -> tuple[Channel, bytes]:
        """Split a DATA frame into its channel and bytes (or an EOF frame into its channel and b"")."""
        if not self.payload:
            raise MalformedPayload(f"{self.type.name} frame has no channel byte", self.stream)
        try:
            channel = Channel(self.payload[0])
        except ValueError as exc:
            raise MalformedPayload(f"unknown channel {self.payload[0]}", self.stream) from exc
        return channel, self.payload[1:]


def encode(frame_type: FrameType, stream: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise FrameTooLarge(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}", stream)
    if not 0 <= stream <= MAX_STREAM_ID:
        raise ProtocolError(f"stream id {stream} out of range", stream)
    head = HEADER.pack(MAGIC, int(frame_type), 0, stream, len(payload))
    return head + struct.pack(">I", zlib.crc32(head)) + payload


def encode_json(frame_type: FrameType, stream: int, obj: dict[str, Any]) -> bytes:
    return encode(frame_type, stream, json.dumps(obj, separators=(",", ":")).encode())


def encode_data(stream: int, channel: Channel, data: bytes) -> bytes:
    return encode(FrameType.DATA, stream, bytes((channel,)) + data)


def encode_eof(stream: int, channel: Channel) -> bytes:
    return encode(FrameType.EOF, stream, bytes((channel,)))


def iter_data_frames(stream: int, channel: Channel, data: bytes) -> Iterator[bytes]:
    """Split `data` into DATA frames no larger than the protocol allows."""
    step = min(CHUNK_SIZE, MAX_PAYLOAD - 1)
    view = memoryview(data)
    for start in range(0, len(view), step):
        yield encode_data(stream, channel, bytes(view[start : start + step]))


class FrameDecoder:
    """Incremental decoder: feed bytes, iterate frames (or ProtocolError values for bad input)."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max_payload = max_payload
        self._skip = 0  # payload bytes of an oversized frame still to discard

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[Frame | ProtocolError]:
        self._buf += data
        return self._drain()

    def _drain(self) -> Iterator[Frame | ProtocolError]:
        buf = self._buf
        while True:
            if self._skip:
                dropped = min(self._skip, len(buf))
                del buf[:dropped]
                self._skip -= dropped
                if self._skip:
                    return
            if len(buf) < HEADER_SIZE:
                if buf and not MAGIC.startswith(bytes(buf[:2])):
                    yield self._resync()
                    continue
                return
            magic, type_byte, _flags, stream, length = HEADER.unpack_from(buf)
            (crc,) = struct.unpack_from(">I", buf, HEADER.size)
            if magic != MAGIC or zlib.crc32(bytes(buf[: HEADER.size])) != crc:
                yield self._resync()
                continue
            if length > self._max_payload:
                del buf[:HEADER_SIZE]
                self._skip = length
                yield FrameTooLarge(
                    f"frame of {length} bytes exceeds the maximum of {self._max_payload}", stream, length
                )
                continue
            if len(buf) < HEADER_SIZE + length:
                return
            payload = bytes(buf[HEADER_SIZE : HEADER_SIZE + length])
            del buf[: HEADER_SIZE + length]
            try:
                frame_type = FrameType(type_byte)
            except ValueError:
                yield UnknownFrameType(f"unknown frame type {type_byte}", stream)
                continue
            yield Frame(frame_type, stream, payload)

    def _resync(self) -> ProtocolError:
        """Drop bytes up to the next position that could start a valid header."""
        buf = self._buf
        start = 1
        while True:
            idx = buf.find(MAGIC[:1], start)
            if idx < 0:
                dropped = len(buf)
                buf.clear()
                break
            candidate = bytes(buf[idx : idx + HEADER_SIZE])
            if len(candidate) < HEADER_SIZE:
                # Could be the beginning of a real header still arriving: keep it.
                if MAGIC.startswith(candidate[:2]):
                    dropped = idx
                    del buf[:idx]
                    break
                start = idx + 1
                continue
            if (
                candidate[:2] == MAGIC
                and zlib.crc32(candidate[: HEADER.size])
                == struct.unpack_from(">I", candidate, HEADER.size)[0]
            ):
                dropped = idx
                del buf[:idx]
                break
            start = idx + 1
        return CorruptFrame(f"garbled input: skipped {dropped} bytes to the next valid frame header", 0)

    def finish(self) -> ProtocolError | None:
        """At end of stream: report a frame that was cut short, if any."""
        if self._buf or self._skip:
            pending = len(self._buf) + self._skip
            self._buf.clear()
            self._skip = 0
            return TruncatedFrame(f"stream ended inside a frame ({pending} bytes pending)", 0)
        return None
