"""Per-stream credit flow control of the private channel, protocol version 2 (standard library only).

Each side grants its peer, for every call's stream, a receive window: the number of credit bytes of
flow-controlled frames (DATA, EOF and EVENT) the peer may send on that stream before it must wait. The
receiver returns credit with WINDOW frames as its consumer takes frames off its queue, so a reader that
stalls stalls the sender on that stream only, and what one side buffers for a stream is bounded by the
window it granted.

Invariants:
- A frame's cost is its payload length plus FRAME_OVERHEAD, so a flood of tiny frames is bounded in count
  as well as in bytes (the overhead stands for the per-frame bookkeeping a receiver keeps).
- A sender sends a flow-controlled frame only while its credit covers the frame's cost. A frame larger than
  the whole window may be sent once the full window is available, i.e. with nothing else outstanding; so a
  receiver holds at most max(window, one frame) per stream.
- A receiver returns credit once half a window was consumed, and whenever its consumer has taken all that
  arrived; so a sender never waits on credit for frames that were already consumed (no deadlock for a frame
  larger than what is left of the window).
- The initial window is what the receiver announced as "window" in its HELLO (INITIAL_WINDOW when absent),
  clamped to [MIN_WINDOW, MAX_WINDOW]. Both sides clamp the same way, so they agree on it.
- CALL, RESULT, ERROR, CANCEL, HELLO and WINDOW frames are not flow-controlled: a call has exactly one CALL
  and one terminal frame, and WINDOW/CANCEL must get through precisely when data is stuck.
"""

from __future__ import annotations

import struct
from typing import Any

from space.protocol.errors import MalformedPayload
from space.protocol.frames import Frame, FrameType, encode

FLOW_CONTROLLED = frozenset({FrameType.DATA, FrameType.EOF, FrameType.EVENT})
FRAME_OVERHEAD = 128
INITIAL_WINDOW = 1 << 20
MIN_WINDOW = 64 << 10
MAX_WINDOW = 16 << 20
_INCREMENT = struct.Struct(">I")


def frame_cost(payload_length: int) -> int:
    return payload_length + FRAME_OVERHEAD


def announced_window(hello: dict[str, Any]) -> int:
    """The per-stream window a peer granted in its HELLO, clamped to the protocol's bounds."""
    value = hello.get("window", INITIAL_WINDOW)
    if isinstance(value, bool) or not isinstance(value, int):
        return INITIAL_WINDOW
    return max(MIN_WINDOW, min(MAX_WINDOW, value))


def encode_window(stream: int, increment: int) -> bytes:
    return encode(FrameType.WINDOW, stream, _INCREMENT.pack(increment))


def window_increment(frame: Frame) -> int:
    if len(frame.payload) != _INCREMENT.size:
        raise MalformedPayload("WINDOW frame payload must be 4 bytes", frame.stream)
    (increment,) = _INCREMENT.unpack(frame.payload)
    if increment == 0:
        raise MalformedPayload("WINDOW frame with a zero increment", frame.stream)
    return int(increment)


class SendCredit:
    """The sending side's credit on one stream (no locking: the caller serialises)."""

    __slots__ = ("available", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.available = window

    def can_send(self, cost: int) -> bool:
        return self.available >= cost or self.available >= self.window

    def spend(self, cost: int) -> None:
        self.available -= cost

    def grant(self, increment: int) -> None:
        self.available += increment


class ReceiveWindow:
    """The receiving side's ledger on one stream: checks the sender keeps within its credit, and says when
    to return credit (once half a window was consumed, so the sender rarely runs dry)."""

    __slots__ = ("_consumed", "_granted", "_received", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self._granted = window
        self._received = 0
        self._consumed = 0

    def receive(self, cost: int) -> bool:
        """Account one arriving frame; False when it exceeds the credit the sender had."""
        self._received += cost
        return self._received <= self._granted + max(0, cost - self.window)

    def consume(self, cost: int, *, idle: bool = False) -> int:
        """Account one frame the consumer took; the increment to send in a WINDOW frame now, or 0.

        Credit goes back once half a window was consumed, or as soon as the consumer has taken everything
        that arrived (`idle`): a sender waiting for the whole window (to send a frame larger than what is
        left) must get it back even when less than half a window was used."""
        self._consumed += cost
        if self._consumed < self.window // 2 and not idle:
            return 0
        increment, self._consumed = self._consumed, 0
        self._granted += increment
        return increment
