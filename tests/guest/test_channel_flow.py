"""The agent's side of the private channel against a scripted (and often hostile) guest.

The guest here is a plain socket speaking raw frames, so each test can do what a compromised `spaced` could:
ignore credit, send frames nobody asked for, garbage, floods of errors, never read. The real daemon's side
of flow control is in test_guest_flow.py; real sandboxes in tests/guest/test_hostile_guest.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from space.core import errors
from space.node.agent import channel as channel_module
from space.node.agent import channel_call, channel_guard
from space.node.agent.channel import GuestChannel
from space.node.agent.channel_guard import TokenBucket
from space.node.agent.guest import GuestSession
from space.protocol import Channel, Frame, FrameDecoder, FrameType, encode, encode_data, encode_json
from space.protocol.flow import FRAME_OVERHEAD, INITIAL_WINDOW, encode_window, window_increment

MiB = 1 << 20


class ScriptedGuest:
    """The guest end of a socketpair: reads the agent's frames, writes whatever the test says."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._decoder = FrameDecoder()
        self._pending: list[Frame] = []

    async def frame(self, timeout: float = 5.0) -> Frame:
        while not self._pending:
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            assert data, "the agent closed the channel"
            for item in self._decoder.feed(data):
                assert isinstance(item, Frame), item
                self._pending.append(item)
        return self._pending.pop(0)

    async def frame_of(self, kind: FrameType, timeout: float = 5.0) -> Frame:
        while True:
            found = await self.frame(timeout)
            if found.type == kind:
                return found

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


@asynccontextmanager
async def connected(
    *, version: int = 2, window: int = INITIAL_WINDOW
) -> AsyncIterator[tuple[GuestChannel, ScriptedGuest]]:
    agent_sock, guest_sock = socket.socketpair()
    agent_reader, agent_writer = await asyncio.open_connection(sock=agent_sock)
    guest_reader, guest_writer = await asyncio.open_connection(sock=guest_sock)
    guest = ScriptedGuest(guest_reader, guest_writer)
    await guest.send(
        encode_json(
            FrameType.HELLO, 0, {"protocol": version, "min_protocol": 1, "window": window, "ready": True}
        )
    )
    channel = GuestChannel(agent_reader, agent_writer, name="sb-scripted")
    lost: list[str] = []
    channel.on_lost = lost.append
    await channel.handshake(timeout=5)
    hello = await guest.frame_of(FrameType.HELLO)
    assert hello.json()["window"] == channel.receive_window
    channel.lost_reasons = lost  # type: ignore[attr-defined]
    try:
        yield channel, guest
    finally:
        await channel.close()
        guest_writer.close()


def test_version_2_turns_flow_control_on_and_version_1_leaves_it_off() -> None:
    async def scenario() -> None:
        async with connected(version=2, window=300_000) as (channel, _guest):
            assert channel.protocol_version == 2 and channel.flow_control
            assert channel.send_window == 300_000
        async with connected(version=1) as (channel, _guest):
            assert channel.protocol_version == 1 and not channel.flow_control

    asyncio.run(scenario())


def test_a_slow_consumer_gets_credit_back_only_as_it_reads() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            call = await channel.open("files.read", {"path": "/x"})
            await guest.frame_of(FrameType.CALL)
            chunk = b"z" * (256 * 1024 - FRAME_OVERHEAD - 1)  # costs exactly 256 KiB of credit
            for _ in range(4):  # the whole window
                await guest.send(encode_data(call.stream, Channel.BODY, chunk))
            await asyncio.sleep(0.2)
            assert call._queued_cost == INITIAL_WINDOW  # held, and nothing returned yet
            events = call.events()
            await events.__anext__()
            await events.__anext__()  # half the window consumed: credit goes back
            window = await guest.frame_of(FrameType.WINDOW)
            assert window.stream == call.stream and window_increment(window) == INITIAL_WINDOW // 2
            await guest.send(encode_json(FrameType.RESULT, call.stream, {"size": 4}))
            remaining = [item async for item in events]
            assert len(remaining) == 2
            assert await call.result() == {"size": 4}
            assert channel.open_calls == 0

    asyncio.run(scenario())


def test_a_guest_that_ignores_its_credit_is_cut_off_and_the_agent_holds_one_window() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            call = await channel.open("files.read", {"path": "/x"})
            await guest.frame_of(FrameType.CALL)
            tracemalloc.start()
            try:
                chunk = b"y" * (64 * 1024)
                with pytest.raises((ConnectionError, OSError)):
                    for _ in range(4096):  # 256 MiB if the agent kept reading
                        await guest.send(encode_data(call.stream, Channel.BODY, chunk))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            await asyncio.wait_for(channel.wait_closed(), 5)
            assert peak < 8 * MiB, f"the agent held {peak / MiB:.1f} MiB for one stream"
            assert channel.failure is not None and "flow-control window" in channel.failure
            assert channel.lost_reasons and "flow-control window" in channel.lost_reasons[0]  # type: ignore[attr-defined]
            with pytest.raises(errors.ChannelError):
                await call.result()

    asyncio.run(scenario())


def test_unsolicited_frames_are_dropped_then_the_guest_is_cut_off() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            session = GuestSession(channel)
            tracemalloc.start()
            try:
                chunk = b"q" * (256 * 1024)
                with pytest.raises((ConnectionError, OSError)):
                    for n in range(4096):  # 1 GiB of DATA for streams nobody opened
                        await guest.send(encode_data(7 + n % 5, Channel.STDOUT, chunk))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            await asyncio.wait_for(channel.wait_closed(), 5)
            assert peak < 8 * MiB
            assert channel.stray_bytes >= channel_guard.STRAY_BYTES_BURST
            assert channel.failure is not None and "streams that are not open" in channel.failure
            with pytest.raises(errors.ChannelError):
                await session.ping()

    asyncio.run(scenario())


def test_a_torn_frame_or_a_few_late_frames_are_tolerated() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            await guest.send(b"SP\x03garbage" + encode_data(99, Channel.STDOUT, b"late") * 20)
            call = await channel.open("sys.ping")
            await guest.frame_of(FrameType.CALL)
            await guest.send(encode_json(FrameType.RESULT, call.stream, {"time": 1.0}))
            assert await call.result() == {"time": 1.0}
            assert not channel.closed and channel.protocol_errors >= 1

    asyncio.run(scenario())


def test_garbage_floods_exhaust_the_error_budget() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            bad_type = encode(FrameType.HELLO, 0, b"x")[:16]  # a header only, then garbage
            with pytest.raises((ConnectionError, OSError)):
                for _ in range(100_000):
                    await guest.send(b"\x00not a frame\xff" * 10 + bad_type + b"S")
            await asyncio.wait_for(channel.wait_closed(), 5)
            assert channel.failure is not None and "malformed or unsolicited" in channel.failure
            assert channel.protocol_errors > channel_guard.PROTOCOL_ERROR_BURST

    asyncio.run(scenario())


def test_guest_error_reports_are_rate_limited_and_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            channel._error_budget = TokenBucket(10_000, 0)  # this test is about logging, not the cut-off
            for n in range(500):
                await guest.send(
                    encode_json(FrameType.ERROR, 0, {"code": "protocol_error", "message": f"m{n}"})
                )
            call = await channel.open("sys.ping")
            await guest.frame_of(FrameType.CALL)
            await guest.send(encode_json(FrameType.RESULT, call.stream, {}))
            await call.result()
            assert channel.protocol_errors == 500
            log = channel.guest_log
            assert log.logged <= channel_guard.LOG_BURST + 2
            assert log.suppressed_total >= 500 - channel_guard.LOG_BURST - 2
        # closing the channel logs how many were suppressed
        assert any("suppressed by the rate limit" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="space.node.agent.channel"):
        asyncio.run(scenario())
    reported = [r for r in caplog.records if "reported a channel error" in r.getMessage()]
    assert len(reported) <= channel_guard.LOG_BURST + 2


def test_concurrent_calls_are_capped() -> None:
    async def scenario() -> None:
        async with connected() as (channel, _guest):
            channel.max_calls = 8
            calls = [await channel.open("sys.ping") for _ in range(8)]
            with pytest.raises(errors.ResourceExhausted, match="calls open"):
                await channel.open("sys.ping")
            assert len(calls) == channel.open_calls == 8

    asyncio.run(scenario())


def test_a_version_1_guest_fails_a_slow_call_instead_of_buffering_it() -> None:
    async def scenario() -> None:
        async with connected(version=1) as (channel, guest):
            call = await channel.open("files.read", {"path": "/x"})
            await guest.frame_of(FrameType.CALL)
            chunk = b"v" * (256 * 1024)
            for _ in range(channel_call.LEGACY_CALL_BUDGET // len(chunk) + 4):
                await guest.send(encode_data(call.stream, Channel.BODY, chunk))
            with pytest.raises(errors.ResourceExhausted, match="fell more than"):
                await asyncio.wait_for(call.result(), 5)
            cancel = await guest.frame_of(FrameType.CANCEL)
            assert cancel.stream == call.stream
            assert call._queued_cost <= channel_call.LEGACY_CALL_BUDGET
            assert not channel.closed

    asyncio.run(scenario())


def test_uploads_wait_for_the_guests_credit() -> None:
    async def scenario() -> None:
        async with connected(window=256 * 1024) as (channel, guest):
            call = await channel.open("files.write", {"path": "/x"})
            await guest.frame_of(FrameType.CALL)
            upload = asyncio.create_task(call.send(b"u" * (2 * MiB)))
            received = 0
            first = await guest.frame_of(FrameType.DATA)
            received += len(first.payload)
            with pytest.raises(TimeoutError):
                await guest.frame_of(FrameType.DATA, timeout=0.3)  # the window is spent
            assert not upload.done()
            while received < 2 * MiB:
                await guest.send(encode_window(call.stream, len(first.payload) + FRAME_OVERHEAD))
                received += len((await guest.frame_of(FrameType.DATA)).payload) - 1
            await asyncio.wait_for(upload, 5)

    asyncio.run(scenario())


def test_a_guest_that_never_reads_fails_writes_without_growing_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channel_module, "WRITE_STALL_TIMEOUT", 1.0)

    async def scenario() -> None:
        async with connected(version=1) as (channel, _guest):  # version 1: no credit to wait for
            call = await channel.open("files.write", {"path": "/x"})
            with pytest.raises(errors.Timeout, match="has not read from its channel"):
                for _ in range(200):
                    await call.send(b"w" * MiB)
            buffered = channel._writer.transport.get_write_buffer_size()
            assert buffered <= channel_module.WRITE_HIGH_WATER + 2 * MiB
            loop_lag = asyncio.get_running_loop().time()
            await asyncio.sleep(0.01)
            assert asyncio.get_running_loop().time() - loop_lag < 0.5  # the event loop is not blocked

    asyncio.run(scenario())


def test_a_collected_exec_keeps_a_bounded_amount_of_output() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            session = GuestSession(channel)
            run = asyncio.create_task(session.exec("yes", max_output=100_000))
            call = await guest.frame_of(FrameType.CALL)
            stream = call.stream
            await guest.send(encode_json(FrameType.EVENT, stream, {"type": "started", "process_id": "p1"}))
            sent = 0
            credit = INITIAL_WINDOW - FRAME_OVERHEAD * 2
            chunk = b"o" * 60_000
            while sent < 20 * MiB:
                cost = len(chunk) + 1 + FRAME_OVERHEAD
                while credit < cost:
                    credit += window_increment(await guest.frame_of(FrameType.WINDOW))
                await guest.send(encode_data(stream, Channel.STDOUT, chunk))
                credit -= cost
                sent += len(chunk)
            await guest.send(encode_data(stream, Channel.STDERR, b"e" * 10))
            await guest.send(encode_json(FrameType.RESULT, stream, {"exit_code": 0, "process_id": "p1"}))
            result = await asyncio.wait_for(run, 10)
            assert len(result.stdout) == 100_000 and result.stdout_truncated
            assert result.stderr == b"e" * 10 and not result.stderr_truncated
            assert result.truncated

    asyncio.run(scenario())


def test_an_endless_oversized_frame_is_discarded_and_cuts_the_guest_off() -> None:
    async def scenario() -> None:
        async with connected() as (channel, guest):
            header = encode(FrameType.DATA, 5, b"")[:8] + (0xFFFFFFF0).to_bytes(4, "big")
            header += zlib.crc32(header).to_bytes(4, "big")
            tracemalloc.start()
            try:
                with pytest.raises((ConnectionError, OSError)):
                    await guest.send(header)
                    for _ in range(4096):
                        await guest.send(b"\0" * (64 * 1024))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            await asyncio.wait_for(channel.wait_closed(), 5)
            assert peak < 8 * MiB
            assert channel.failure is not None and "oversized frame" in channel.failure

    asyncio.run(scenario())


def test_the_two_ledgers_agree_and_an_overdraft_is_caught() -> None:
    import random

    from space.protocol.flow import ReceiveWindow, SendCredit

    rng = random.Random(7)
    window = 256 * 1024
    sender, receiver = SendCredit(window), ReceiveWindow(window)
    in_flight: list[int] = []
    for _ in range(20_000):
        cost = rng.choice([FRAME_OVERHEAD + 1, 4096, 65_536, window + 10_000])  # the last: a big EVENT
        if sender.can_send(cost) and rng.random() < 0.6:
            sender.spend(cost)
            assert receiver.receive(cost), "a sender within its credit was flagged"
            in_flight.append(cost)
        elif in_flight:
            increment = receiver.consume(in_flight.pop(0))
            if increment:
                sender.grant(increment)
    # a sender that ignores its credit is caught on the first frame beyond it
    greedy, strict = SendCredit(window), ReceiveWindow(window)
    for _ in range(window // 4096):
        greedy.spend(4096)
        assert strict.receive(4096)
    assert not strict.receive(4096)
