"""spaced's side of protocol 2's flow control: it sends only within the host's credit, returns credit for
request bodies, and a new host session cancels the calls of the previous one."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import pytest

from space.protocol.flow import FRAME_OVERHEAD, MIN_WINDOW, encode_window, frame_cost, window_increment
from space.protocol.frames import CHUNK_SIZE, Channel, FrameType, encode_data, encode_eof, encode_json
from tests.support.guest_harness import Guest

WINDOW = MIN_WINDOW  # the host's grant per stream in these tests: smaller than one file-read chunk


def hello(guest: Guest, version: int = 2, window: int = WINDOW) -> dict[str, object]:
    guest.write_raw(
        encode_json(FrameType.HELLO, 0, {"protocol": version, "min_protocol": 1, "window": window})
    )
    answer = guest.next_frame(0).json()
    assert answer["negotiated"] == version
    return answer


@pytest.fixture
def guest() -> Iterator[Guest]:
    g = Guest()
    yield g
    g.close()


def drain_data(guest: Guest, stream: int, quiet: float = 0.5) -> int:
    """Credit cost of the DATA frames that arrive until the stream is quiet for `quiet` seconds."""
    spent = 0
    while True:
        try:
            frame = guest.next_frame(stream, timeout=quiet)
        except queue.Empty:
            return spent
        assert frame.type == FrameType.DATA, frame
        spent += frame_cost(len(frame.payload))


def test_the_daemon_announces_its_window_and_speaks_version_2(guest: Guest) -> None:
    assert guest.hello["protocol"] == 2 and guest.hello["window"] >= MIN_WINDOW
    answer = hello(guest)
    assert answer["window"] == guest.hello["window"]


def test_a_download_stops_at_the_window_and_resumes_with_credit(guest: Guest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    big = tmp_path / "big.bin"
    big.write_bytes(b"b" * (4 << 20))
    hello(guest)
    stream = guest.open("files.read", {"path": str(big)})
    spent = drain_data(guest, stream)
    # One chunk larger than the whole window may go while nothing else is outstanding; then it waits.
    assert 0 < spent <= max(WINDOW, frame_cost(CHUNK_SIZE + 1)), spent
    total = spent
    while True:
        guest.write_raw(encode_window(stream, spent))
        try:
            frame = guest.next_frame(stream, timeout=5)
        except queue.Empty:
            raise AssertionError("credit did not restart the download") from None
        if frame.type == FrameType.RESULT:
            assert frame.json()["read"] == 4 << 20
            break
        spent = frame_cost(len(frame.payload))
        total += spent
    assert total >= (4 << 20)


def test_process_output_waits_for_credit_and_the_process_is_held_back(guest: Guest) -> None:
    hello(guest)
    stream = guest.open("process.start", {"cmd": "head -c 20000000 /dev/zero; echo done >&2"})
    assert guest.next_frame(stream).json()["type"] == "started"
    guest.write_raw(encode_window(stream, 4096))  # credit for the "started" event came back
    spent = drain_data(guest, stream, quiet=1.0)
    assert 0 < spent <= 4096 + frame_cost(65536)  # the credit, plus one chunk bigger than the window
    # The daemon's output log is bounded, so the process itself is now blocked: it has not finished.
    listing = guest.call("process.list").result["processes"]
    assert any(p["running"] for p in listing), listing
    guest.cancel(stream)
    end = guest.next_frame(stream, timeout=5)
    assert end.type == FrameType.ERROR and end.json()["code"] == "cancelled"  # detached, process kept
    assert "process_id" in end.json()


def test_a_version_1_host_is_not_flow_controlled(guest: Guest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    big = tmp_path / "big.bin"
    big.write_bytes(b"c" * (2 << 20))
    hello(guest, version=1)
    reply = guest.call("files.read", {"path": str(big)})
    assert reply.ok and reply.data_bytes[Channel.BODY] == 2 << 20


def test_request_bodies_get_credit_back_as_they_are_consumed(guest: Guest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    hello(guest)
    target = tmp_path / "up.bin"
    stream = guest.open("files.write", {"path": str(target)})
    window = int(guest.hello["window"])
    chunk = b"u" * (64 * 1024)
    sent = returned = 0
    deadline = time.monotonic() + 30
    while sent < 8 << 20:
        assert time.monotonic() < deadline
        cost = frame_cost(len(chunk) + 1)
        if sent - returned + cost > window:
            frame = guest.next_frame(stream, timeout=5)  # must be credit: nothing else is due yet
            assert frame.type == FrameType.WINDOW, frame
            returned += window_increment(frame)
            continue
        guest.write_raw(encode_data(stream, Channel.BODY, chunk))
        sent += cost
    guest.write_raw(encode_eof(stream, Channel.BODY))
    while True:
        frame = guest.next_frame(stream, timeout=10)
        if frame.type != FrameType.WINDOW:
            break
    assert frame.type == FrameType.RESULT, frame
    assert target.stat().st_size == 8 << 20
    assert sent - returned <= window + FRAME_OVERHEAD * 2


def test_a_new_host_session_cancels_the_calls_of_the_previous_one(guest: Guest) -> None:
    hello(guest)
    stream = guest.open("process.start", {"cmd": "head -c 5000000 /dev/zero; sleep 30"})
    assert guest.next_frame(stream).json()["type"] == "started"
    drain_data(guest, stream)  # the old host stops reading: the call waits for credit
    hello(guest)  # a restarted agent says hello
    end = guest.next_frame(stream, timeout=5)
    while end.type == FrameType.DATA:
        end = guest.next_frame(stream, timeout=5)
    assert end.type == FrameType.ERROR and end.json()["code"] == "cancelled"
    assert guest.call("sys.ping").ok
