"""The wire format on its own: round trips, and every kind of bad input as a typed error, never a crash."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from space.protocol import (
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    Channel,
    CorruptFrame,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    MalformedPayload,
    ProtocolError,
    TruncatedFrame,
    UnknownFrameType,
    VersionMismatch,
    encode,
    encode_data,
    encode_json,
    iter_data_frames,
    negotiate,
)
from space.protocol.frames import HEADER, HEADER_SIZE, MAGIC


def decode_all(data: bytes, chunk: int | None = None) -> list[Frame | ProtocolError]:
    decoder = FrameDecoder()
    out: list[Frame | ProtocolError] = []
    step = chunk or len(data) or 1
    for start in range(0, len(data), step):
        out.extend(decoder.feed(data[start : start + step]))
    tail = decoder.finish()
    if tail is not None:
        out.append(tail)
    return out


def raw_header(frame_type: int, stream: int, length: int) -> bytes:
    head = HEADER.pack(MAGIC, frame_type, 0, stream, length)
    return head + struct.pack(">I", zlib.crc32(head))


def test_round_trip_of_every_frame_type_byte_by_byte() -> None:
    frames = [encode_json(FrameType.CALL, 7, {"method": "sys.ping", "params": {}})]
    frames.append(encode_data(7, Channel.STDERR, b"\x00\xffbinary"))
    frames.append(encode(FrameType.CANCEL, 7))
    decoded = decode_all(b"".join(frames), chunk=1)
    assert [type(f) for f in decoded] == [Frame, Frame, Frame]
    call, data, cancel = decoded
    assert isinstance(call, Frame) and call.json() == {"method": "sys.ping", "params": {}}
    assert isinstance(data, Frame) and data.channel_data() == (Channel.STDERR, b"\x00\xffbinary")
    assert isinstance(cancel, Frame) and cancel.type == FrameType.CANCEL and cancel.stream == 7


def test_binary_payload_has_no_encoding_overhead() -> None:
    payload = bytes(range(256)) * 100
    assert len(encode_data(1, Channel.BODY, payload)) == HEADER_SIZE + 1 + len(payload)


def test_garbage_before_a_frame_is_reported_and_skipped() -> None:
    good = encode_json(FrameType.CALL, 3, {"method": "x"})
    decoded = decode_all(b"\x01\x02garbage SP but not a header" + good)
    assert isinstance(decoded[0], CorruptFrame)
    assert decoded[-1] == Frame(FrameType.CALL, 3, b'{"method":"x"}')


def test_flipped_header_bit_is_detected_by_the_checksum() -> None:
    frame = bytearray(encode_json(FrameType.CALL, 3, {"method": "x"}))
    frame[9] ^= 0x01  # inside the length field
    decoded = decode_all(bytes(frame) + encode(FrameType.CANCEL, 4))
    assert any(isinstance(item, CorruptFrame) for item in decoded)
    assert decoded[-1] == Frame(FrameType.CANCEL, 4)


def test_oversized_frame_is_skipped_whole_and_the_next_one_decodes() -> None:
    big = MAX_PAYLOAD + 10
    stream = raw_header(FrameType.DATA, 9, big) + b"x" * big + encode(FrameType.CANCEL, 2)
    decoded = decode_all(stream, chunk=65536)
    assert isinstance(decoded[0], FrameTooLarge) and decoded[0].stream == 9
    assert decoded[1:] == [Frame(FrameType.CANCEL, 2)]


def test_encoder_refuses_oversized_payloads() -> None:
    with pytest.raises(FrameTooLarge):
        encode(FrameType.DATA, 1, b"x" * (MAX_PAYLOAD + 1))


def test_unknown_type_is_reported_with_its_stream() -> None:
    decoded = decode_all(raw_header(200, 5, 3) + b"abc" + encode(FrameType.CANCEL, 5))
    assert isinstance(decoded[0], UnknownFrameType) and decoded[0].stream == 5
    assert decoded[1] == Frame(FrameType.CANCEL, 5)


def test_truncated_frame_at_end_of_stream() -> None:
    frame = encode_json(FrameType.RESULT, 1, {"ok": True})
    decoded = decode_all(frame[:-3])
    assert len(decoded) == 1 and isinstance(decoded[0], TruncatedFrame)


def test_payload_that_is_not_a_json_object() -> None:
    with pytest.raises(MalformedPayload):
        Frame(FrameType.CALL, 1, b"[1, 2]").json()
    with pytest.raises(MalformedPayload):
        Frame(FrameType.CALL, 1, b"\xff\xfe").json()
    with pytest.raises(MalformedPayload):
        Frame(FrameType.DATA, 1, b"").channel_data()
    with pytest.raises(MalformedPayload):
        Frame(FrameType.DATA, 1, b"\x09abc").channel_data()


def test_large_data_is_split_into_legal_frames() -> None:
    data = b"z" * (3 * MAX_PAYLOAD + 5)
    frames = list(iter_data_frames(1, Channel.BODY, data))
    decoded = decode_all(b"".join(frames), chunk=1 << 20)
    assert all(isinstance(f, Frame) for f in decoded)
    assert b"".join(f.channel_data()[1] for f in decoded if isinstance(f, Frame)) == data


def test_version_negotiation() -> None:
    assert negotiate({"protocol": 1, "min_protocol": 1}) == 1
    assert negotiate({"protocol": 2, "min_protocol": 1}) == 2  # protocol 2: per-stream flow control
    assert negotiate({"protocol": 5, "min_protocol": 1}) == PROTOCOL_VERSION
    with pytest.raises(VersionMismatch):
        negotiate({"protocol": 9, "min_protocol": 7})
    with pytest.raises(VersionMismatch):
        negotiate({"hello": "there"})


@settings(max_examples=300, deadline=None)
@given(noise=st.binary(max_size=300), cut=st.integers(min_value=1, max_value=64))
def test_any_noise_followed_by_a_valid_frame_never_crashes_and_recovers(noise: bytes, cut: int) -> None:
    good = encode_json(FrameType.CALL, 11, {"method": "sys.ping"})
    decoded = decode_all(noise + good, chunk=cut)
    assert all(isinstance(item, Frame | ProtocolError) for item in decoded)
    # The valid frame after the noise is always found again (noise can swallow it only by posing as a
    # valid header with a checksum, which random bytes essentially never do).
    assert decoded[-1] == Frame(FrameType.CALL, 11, b'{"method":"sys.ping"}')
