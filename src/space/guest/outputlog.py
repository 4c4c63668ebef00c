"""The bounded, combined output log of one process, read by any number of followers at their own offsets.

Invariants:
- Offsets count every byte the process ever wrote to stdout and stderr, in arrival order, so they stay
  valid after old bytes are dropped: `start` is the first offset still kept, `end` the next to be written.
- Each chunk remembers its channel (STDOUT/STDERR) so a re-attached follower sees the same split.
- Memory is bounded: beyond `capacity` bytes (and `max_chunks` chunks) the oldest chunks are dropped,
  except bytes a *holding* follower has not consumed yet. A follower that must not lose output (a
  foreground call, an attached client) takes a hold; the producer checks `has_room()` before reading more
  from the process, so a slow host slows the process down instead of losing its output or growing memory.
  With no hold, the log just keeps the newest `capacity` bytes.
- Nothing is appended after `close()`; followers drain what is left and then see the end.
"""

from __future__ import annotations

import bisect
import threading

from space.guest.channel import Cancelled

CAPACITY = 8 << 20
MAX_CHUNKS = 1 << 16
CHUNK_LIMIT = 65535  # a chunk plus its channel byte fits a 64 KiB DATA payload


class OutputLog:
    def __init__(self, capacity: int = CAPACITY, max_chunks: int = MAX_CHUNKS) -> None:
        self.cond = threading.Condition()
        self.capacity = capacity
        self.max_chunks = max_chunks
        self.start = 0
        self.end = 0
        self.closed = False
        self._offsets: list[int] = []
        self._channels: list[int] = []
        self._chunks: list[bytearray] = []
        self._head = 0
        self._holds: dict[int, int] = {}
        self._next_hold = 0

    def _held_from(self) -> int:
        return min(self._holds.values()) if self._holds else self.end

    def has_room(self) -> bool:
        with self.cond:
            return self.end - self._held_from() < self.capacity

    def wait_for_room(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.end - self._held_from() < self.capacity, timeout)

    def append(self, channel: int, data: bytes) -> None:
        with self.cond:
            if self.closed or not data:
                return
            tail_index = len(self._chunks) - 1
            if tail_index >= self._head and self._channels[tail_index] == channel:
                tail = self._chunks[tail_index]
                take = min(len(data), CHUNK_LIMIT - len(tail))
                if take > 0:
                    tail += data[:take]
                    data = data[take:]
                    self.end += take
            for pos in range(0, len(data), CHUNK_LIMIT):
                piece = bytearray(data[pos : pos + CHUNK_LIMIT])
                self._offsets.append(self.end)
                self._channels.append(channel)
                self._chunks.append(piece)
                self.end += len(piece)
            self._evict()
            self.cond.notify_all()

    def _evict(self) -> None:
        held_from = self._held_from()
        while self._head < len(self._chunks) - 1:
            over = self.end - self.start > self.capacity or len(self._chunks) - self._head > self.max_chunks
            next_start = self._offsets[self._head + 1]
            if not over or next_start > held_from:
                break
            self._chunks[self._head] = bytearray()
            self._head += 1
            self.start = next_start
        if self._head > 1024 and self._head * 2 > len(self._chunks):
            del self._offsets[: self._head], self._channels[: self._head], self._chunks[: self._head]
            self._head = 0

    @property
    def retained(self) -> int:
        return self.end - self.start

    def discard(self) -> None:
        """Drop every kept byte (offsets stay valid; followers see truncation). Only for closed logs."""
        with self.cond:
            if not self.closed or self._holds:
                return
            self._offsets.clear()
            self._channels.clear()
            self._chunks.clear()
            self._head = 0
            self.start = self.end
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # --- followers -------------------------------------------------------------------------------------

    def add_hold(self, offset: int) -> tuple[int, int, bool]:
        """Start following at `offset`: returns (hold id, first offset available, whether bytes were lost)."""
        with self.cond:
            effective = min(max(offset, self.start), self.end)
            hold = self._next_hold
            self._next_hold += 1
            self._holds[hold] = effective
            return hold, effective, offset < self.start

    def move_hold(self, hold: int, offset: int) -> None:
        with self.cond:
            if hold in self._holds:
                self._holds[hold] = offset
                self._evict()
                self.cond.notify_all()

    def release_hold(self, hold: int) -> None:
        with self.cond:
            self._holds.pop(hold, None)
            self._evict()
            self.cond.notify_all()

    def read(self, offset: int, limit: int = CHUNK_LIMIT) -> tuple[int, int, bytes] | None:
        """Bytes of one channel from `offset` (moved up to `start` if dropped): (offset, channel, data)."""
        with self.cond:
            return self._read(offset, limit)

    def _read(self, offset: int, limit: int) -> tuple[int, int, bytes] | None:
        offset = max(offset, self.start)
        if offset >= self.end:
            return None
        index = bisect.bisect_right(self._offsets, offset, lo=self._head) - 1
        channel = self._channels[index]
        parts: list[bytes] = []
        size = 0
        position = offset
        while index < len(self._chunks) and size < limit and self._channels[index] == channel:
            chunk = self._chunks[index]
            begin = position - self._offsets[index]
            piece = bytes(chunk[begin : begin + limit - size])
            parts.append(piece)
            size += len(piece)
            position += len(piece)
            index += 1
        return offset, channel, b"".join(parts)

    def wait_read(
        self, offset: int, cancelled: threading.Event, limit: int = CHUNK_LIMIT
    ) -> tuple[int, int, bytes] | None:
        """Like read, but waits for bytes; None once closed and drained. Raises Cancelled if cancelled."""
        with self.cond:
            while True:
                if cancelled.is_set():
                    raise Cancelled
                found = self._read(offset, limit)
                if found is not None or self.closed:
                    return found
                # The timeout is a safety net only: appends, close and cancel all notify.
                self.cond.wait(1.0)
