"""Fuzzing the private channel's wire format (space.protocol): the frame decoder, control payloads, the
WINDOW increment and version negotiation. Properties: the decoder never raises (it yields Frames or
ProtocolError values), however the input is garbled or split; encoded frames decode to themselves in any
chunking; every payload accessor raises only MalformedPayload / VersionMismatch."""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import given
from hypothesis import strategies as st

from space.protocol.errors import MalformedPayload, ProtocolError, VersionMismatch
from space.protocol.flow import announced_window, window_increment
from space.protocol.frames import MAX_STREAM_ID, Frame, FrameDecoder, FrameType, encode
from space.protocol.version import negotiate
from tests.support.fuzzing import JSON, executed, fuzz_settings

FRAMES = st.lists(
    st.tuples(st.sampled_from(list(FrameType)), st.integers(0, MAX_STREAM_ID), st.binary(max_size=300)),
    max_size=6,
)


def _decode(chunks: list[bytes], max_payload: int = 1 << 20) -> list[Frame | ProtocolError]:
    decoder = FrameDecoder(max_payload=max_payload)
    items: list[Frame | ProtocolError] = []
    for chunk in chunks:
        items.extend(decoder.feed(chunk))
    end = decoder.finish()
    return items + ([end] if end is not None else [])


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@fuzz_settings(50)
@given(st.lists(st.binary(max_size=200), max_size=8), st.integers(1, 400))
def test_decoder_never_raises_on_garbage(chunks: list[bytes], max_payload: int) -> None:
    executed("protocol.decoder.garbage")
    for item in _decode(chunks, max_payload):
        assert isinstance(item, Frame | ProtocolError)


@fuzz_settings(30)
@given(FRAMES, st.lists(st.integers(0, 10_000), max_size=10))
def test_encoded_frames_round_trip_in_any_chunking(
    frames: list[tuple[FrameType, int, bytes]], cuts: list[int]
) -> None:
    executed("protocol.decoder.round_trip")
    wire = b"".join(encode(kind, stream, payload) for kind, stream, payload in frames)
    assert _decode(_split(wire, cuts)) == [Frame(kind, stream, payload) for kind, stream, payload in frames]


@fuzz_settings(30)
@given(FRAMES, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_garbled_frames_yield_frames_or_protocol_errors(
    frames: list[tuple[FrameType, int, bytes]], garbles: list[tuple[int, int]]
) -> None:
    executed("protocol.decoder.garbled")
    wire = bytearray(b"".join(encode(kind, stream, payload) for kind, stream, payload in frames) or b"\0")
    for pos, value in garbles:
        wire[pos % len(wire)] = value
    for item in _decode([bytes(wire)]):
        assert isinstance(item, Frame | ProtocolError)


@fuzz_settings(50)
@given(st.sampled_from(list(FrameType)), st.binary(max_size=64) | JSON.map(lambda v: repr(v).encode()))
def test_payload_accessors_raise_only_malformed_payload(kind: FrameType, payload: bytes) -> None:
    executed("protocol.payloads")
    frame = Frame(kind, 1, payload)
    for accessor in (frame.json, frame.channel_data, lambda: window_increment(frame)):
        with contextlib.suppress(MalformedPayload):
            accessor()


@fuzz_settings(30)
@given(st.dictionaries(st.sampled_from(["protocol", "min_protocol", "window", "x"]), JSON, max_size=4))
def test_hello_negotiation_raises_only_version_mismatch(hello: dict[str, object]) -> None:
    executed("protocol.hello")
    with contextlib.suppress(VersionMismatch):
        negotiate(hello)
    assert isinstance(announced_window(hello), int)
