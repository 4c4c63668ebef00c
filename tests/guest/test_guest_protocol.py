"""spaced's channel: handshake, version negotiation, sys.* calls, and survival of garbage input."""

from __future__ import annotations

import importlib
import os
import struct
import time
import zlib

from space.guest.daemon import HANDLERS
from space.protocol import methods as m
from space.protocol.frames import (
    HEADER,
    MAGIC,
    MAX_PAYLOAD,
    Channel,
    FrameType,
    encode,
    encode_data,
    encode_json,
)
from space.protocol.version import PROTOCOL_VERSION
from tests.support.guest_harness import Guest


def raw_header(frame_type: int, stream: int, length: int) -> bytes:
    head = HEADER.pack(MAGIC, frame_type, 0, stream, length)
    return head + struct.pack(">I", zlib.crc32(head))


def call_frame(stream: int, method: str, params: dict[str, object] | None = None) -> bytes:
    return encode_json(FrameType.CALL, stream, {"method": method, "params": params or {}})


def stream0_errors(guest: Guest, count: int = 1, timeout: float = 5) -> list[dict[str, object]]:
    found = []
    for _ in range(count):
        frame = guest.next_frame(0, timeout=timeout)
        assert frame.type == FrameType.ERROR, frame
        found.append(frame.json())
    return found


def assert_alive(guest: Guest) -> None:
    assert guest.call("sys.ping", timeout=5).ok


def test_hello_on_start(guest: Guest) -> None:
    hello = guest.hello
    assert hello["ready"] is True
    assert hello["protocol"] >= hello["min_protocol"] >= 1
    assert hello["pid"] == guest.pid
    assert len(hello["boot_id"]) >= 16


def open_fds(pid: int) -> dict[int, str]:
    """The process's descriptors; one it closes between the listing and the readlink is skipped (the guest
    opens short-lived files of its own, e.g. while it seeds its randomness at start)."""
    fds: dict[int, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    return fds


def test_stdio_is_not_the_channel(guest: Guest) -> None:
    fds = open_fds(guest.pid)
    assert fds[0] == fds[1] == fds[2] == "/dev/null"
    channel_fds = [fd for fd, target in fds.items() if target.startswith("pipe:")]
    assert len(channel_fds) >= 2 and min(channel_fds) >= 100


def test_host_hello_is_answered(guest: Guest) -> None:
    guest.write_raw(encode_json(FrameType.HELLO, 0, {"protocol": 1, "min_protocol": 1}))
    frame = guest.next_frame(0)
    assert frame.type == FrameType.HELLO
    assert frame.json()["negotiated"] == 1
    assert frame.json()["boot_id"] == guest.hello["boot_id"]


def test_version_mismatch_keeps_running(guest: Guest) -> None:
    guest.write_raw(encode_json(FrameType.HELLO, 0, {"protocol": 99, "min_protocol": 50}))
    assert stream0_errors(guest)[0]["code"] == "version_mismatch"
    guest.write_raw(encode_json(FrameType.HELLO, 0, {"nonsense": True}))
    assert stream0_errors(guest)[0]["code"] == "version_mismatch"
    guest.write_raw(encode(FrameType.HELLO, 0, b"not json"))
    assert stream0_errors(guest)[0]["code"] == "malformed_payload"
    assert_alive(guest)


def test_sys_ping_and_info(guest: Guest) -> None:
    before = time.time()
    assert guest.call("sys.ping").result["time"] >= before - 1
    info = guest.call("sys.info").result
    assert info["pid"] == guest.pid and info["boot_id"] == guest.hello["boot_id"]
    assert info["protocol"] == PROTOCOL_VERSION and info["uptime"] > 0
    assert abs(info["last_activity"] - time.time()) < 5
    assert 0 <= info["idle_seconds"] < 5
    assert info["running_processes"] == 0


def test_sys_sync(guest: Guest) -> None:
    assert guest.call("sys.sync").result == {}


def test_sys_reseed_regenerates_boot_id() -> None:
    g = Guest()
    try:
        old = g.hello["boot_id"]
        assert g.call("sys.reseed", {"entropy": os.urandom(32).hex()}).result == {}
        assert g.call("sys.info").result["boot_id"] != old
        assert g.call("sys.reseed", {"entropy": "zz"}).error["code"] == "invalid_argument"
    finally:
        g.close()


def test_unknown_method(guest: Guest) -> None:
    assert guest.call("no.such").error["code"] == "unknown_method"
    assert_alive(guest)


def test_every_protocol_method_has_a_handler_and_nothing_else_does() -> None:
    # The handler table keys on the protocol's names; a method added on one side only fails here.
    assert set(HANDLERS) == m.METHODS
    assert m.BODY_METHODS <= m.METHODS
    for module_name, function_name in HANDLERS.values():
        assert callable(getattr(importlib.import_module(module_name), function_name))


def test_params_must_be_an_object(guest: Guest) -> None:
    guest.write_raw(encode_json(FrameType.CALL, 900, {"method": "sys.ping", "params": [1]}))
    assert guest.collect(900).error["code"] == "invalid_argument"
    assert guest.call("files.stat", {"path": 5}).error["code"] == "invalid_argument"


def test_call_payload_not_json(guest: Guest) -> None:
    guest.write_raw(encode(FrameType.CALL, 901, b"\xff{not json"))
    assert guest.collect(901).error["code"] == "malformed_payload"
    guest.write_raw(encode(FrameType.CALL, 902, b"[1, 2]"))
    assert guest.collect(902).error["code"] == "malformed_payload"
    guest.write_raw(encode(FrameType.CALL, 903, b'{"params": {}}'))
    assert guest.collect(903).error["code"] == "malformed_payload"
    assert_alive(guest)


def test_random_bytes(guest: Guest) -> None:
    garbage = bytes(b for b in os.urandom(8192) if b != MAGIC[0])  # no chance of a valid header
    guest.write_raw(garbage)
    assert stream0_errors(guest)[0]["code"] == "corrupt_frame"
    assert_alive(guest)


def test_truncated_header_then_valid_call(guest: Guest) -> None:
    ping = call_frame(910, "sys.ping")
    guest.write_raw(ping[:10] + call_frame(911, "sys.ping"))
    assert stream0_errors(guest)[0]["code"] == "corrupt_frame"
    assert guest.collect(911).ok


def test_truncated_payload_swallows_next_frame_then_recovers(guest: Guest) -> None:
    follower = call_frame(913, "sys.ping")
    guest.write_raw(raw_header(FrameType.CALL, 912, 5 + len(follower)) + b'{"met' + follower)
    assert guest.collect(912).error["code"] == "malformed_payload"
    assert_alive(guest)


def test_oversized_frame_is_skipped(guest: Guest) -> None:
    guest.write_raw(raw_header(FrameType.DATA, 920, MAX_PAYLOAD + 1) + bytes(MAX_PAYLOAD + 1))
    reply = guest.collect(920)
    assert reply.error["code"] == "frame_too_large"
    assert_alive(guest)


def test_unknown_frame_type(guest: Guest) -> None:
    guest.write_raw(raw_header(42, 930, 3) + b"abc")
    assert guest.collect(930).error["code"] == "unknown_frame_type"
    assert_alive(guest)


def test_data_for_unknown_stream(guest: Guest) -> None:
    guest.write_raw(encode_data(940, Channel.BODY, b"stray"))
    error = stream0_errors(guest)[0]
    assert error["code"] == "protocol_error" and error["stream"] == 940
    assert_alive(guest)


def test_host_only_misuse(guest: Guest) -> None:
    guest.write_raw(call_frame(0, "sys.ping"))
    assert stream0_errors(guest)[0]["code"] == "protocol_error"
    guest.write_raw(encode_json(FrameType.RESULT, 950, {}))
    assert stream0_errors(guest)[0]["code"] == "protocol_error"
    guest.write_raw(encode(FrameType.CANCEL, 951))  # a late CANCEL for nothing is ignored
    assert_alive(guest)


def test_second_call_on_an_open_stream(guest: Guest) -> None:
    stream = guest.open("process.start", {"argv": ["sleep", "5"]})
    assert guest.next_frame(stream).json()["type"] == "started"
    guest.write_raw(call_frame(stream, "sys.ping"))
    error = stream0_errors(guest)[0]
    assert error["code"] == "protocol_error" and error["stream"] == stream
    guest.cancel(stream)
    reply = guest.collect(stream)
    assert reply.error["code"] == "cancelled"
    guest.call("process.signal", {"process_id": reply.error["process_id"], "signal": "KILL"})


def test_truncated_frame_at_end_of_stream() -> None:
    g = Guest()
    g.write_raw(call_frame(960, "sys.ping")[:20])
    g.close()
    assert g.proc.returncode == 0
    assert g.next_frame(0, timeout=5).json()["code"] == "truncated_frame"


def test_boot_is_fast() -> None:
    started = time.monotonic()
    g = Guest()
    elapsed = time.monotonic() - started
    g.close()
    assert elapsed < 1.0, f"HELLO took {elapsed:.3f}s"
