"""OutputLog: offsets survive eviction, channels survive coalescing, holds stop eviction."""

from __future__ import annotations

import threading

import pytest

from space.guest.channel import Cancelled
from space.guest.outputlog import CHUNK_LIMIT, OutputLog


def drain(log: OutputLog, offset: int) -> list[tuple[int, int, bytes]]:
    found = []
    while (item := log.read(offset)) is not None:
        found.append(item)
        offset = item[0] + len(item[2])
    return found


def test_chunks_coalesce_per_channel_and_keep_offsets() -> None:
    log = OutputLog(capacity=1 << 20)
    log.append(1, b"ab")
    log.append(1, b"cd")
    log.append(2, b"EF")
    log.append(1, b"g")
    assert drain(log, 0) == [(0, 1, b"abcd"), (4, 2, b"EF"), (6, 1, b"g")]
    assert drain(log, 3) == [(3, 1, b"d"), (4, 2, b"EF"), (6, 1, b"g")]
    assert log.read(7) is None and log.end == 7


def test_oldest_chunks_dropped_beyond_capacity() -> None:
    log = OutputLog(capacity=3 * CHUNK_LIMIT)
    for index in range(10):
        log.append(1 + index % 2, bytes([index]) * CHUNK_LIMIT)
    assert log.end == 10 * CHUNK_LIMIT
    assert log.start >= 7 * CHUNK_LIMIT - CHUNK_LIMIT and log.retained <= 3 * CHUNK_LIMIT + CHUNK_LIMIT
    hold, first, truncated = log.add_hold(0)
    assert truncated and first == log.start
    log.release_hold(hold)


def test_hold_prevents_eviction_and_reports_room() -> None:
    log = OutputLog(capacity=2 * CHUNK_LIMIT)
    hold, first, truncated = log.add_hold(0)
    assert (first, truncated) == (0, False)
    for _ in range(4):
        log.append(1, b"x" * CHUNK_LIMIT)
    assert log.start == 0 and not log.has_room()
    log.move_hold(hold, 3 * CHUNK_LIMIT)
    assert log.start > 0 and log.has_room()
    log.release_hold(hold)


def test_wait_read_ends_on_close_and_cancel() -> None:
    log = OutputLog()
    cancelled = threading.Event()
    threading.Timer(0.05, lambda: (log.append(1, b"late"), log.close())).start()
    assert log.wait_read(0, cancelled) == (0, 1, b"late")
    assert log.wait_read(4, cancelled) is None
    other = OutputLog()
    threading.Timer(0.05, lambda: (cancelled.set(), other.wake())).start()
    with pytest.raises(Cancelled):
        other.wait_read(0, cancelled)


def test_discard_keeps_offsets() -> None:
    log = OutputLog()
    log.append(1, b"12345")
    log.close()
    log.discard()
    assert log.retained == 0 and log.start == log.end == 5
    assert log.add_hold(0)[1:] == (5, True)
