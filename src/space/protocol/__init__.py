"""The private channel's wire format: framed, versioned, multiplexed (standard library only)."""

from space.protocol.errors import (
    ChannelClosed,
    CorruptFrame,
    FrameTooLarge,
    MalformedPayload,
    ProtocolError,
    TruncatedFrame,
    UnknownFrameType,
    VersionMismatch,
)
from space.protocol.frames import (
    CHUNK_SIZE,
    MAX_PAYLOAD,
    Channel,
    Frame,
    FrameDecoder,
    FrameType,
    encode,
    encode_data,
    encode_eof,
    encode_json,
    iter_data_frames,
)
from space.protocol.version import PROTOCOL_VERSION, hello_payload, negotiate

__all__ = [
    "CHUNK_SIZE",
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "Channel",
    "ChannelClosed",
    "CorruptFrame",
    "Frame",
    "FrameDecoder",
    "FrameTooLarge",
    "FrameType",
    "MalformedPayload",
    "ProtocolError",
    "TruncatedFrame",
    "UnknownFrameType",
    "VersionMismatch",
    "encode",
    "encode_data",
    "encode_eof",
    "encode_json",
    "hello_payload",
    "iter_data_frames",
    "negotiate",
]
