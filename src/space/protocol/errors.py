"""Typed errors of the guest wire protocol (standard library only).

Every malformed input maps to exactly one ProtocolError subclass; each has a stable `code` that travels in
ERROR frames, so both ends name the same failure the same way.
"""

from __future__ import annotations


class ProtocolError(Exception):
    code = "protocol_error"

    def __init__(self, message: str, stream: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.stream = stream


class CorruptFrame(ProtocolError):
    code = "corrupt_frame"


class TruncatedFrame(ProtocolError):
    code = "truncated_frame"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"

    def __init__(self, message: str, stream: int = 0, length: int = 0) -> None:
        super().__init__(message, stream)
        self.length = length  # the payload length the header announced (the decoder discards it)


class UnknownFrameType(ProtocolError):
    code = "unknown_frame_type"


class MalformedPayload(ProtocolError):
    code = "malformed_payload"


class VersionMismatch(ProtocolError):
    code = "version_mismatch"


class ChannelClosed(ProtocolError):
    code = "channel_closed"
