"""Host side of the private channel: multiplexed calls to a sandbox's `spaced` over one byte stream.

The guest is not trusted: whatever runs in the sandbox may replace or impersonate `spaced` (a root process
there can write to the daemon's channel descriptors), so everything read from the channel is bounded here.
One call's stream, flow control and error translation live in space.node.agent.channel_call; the budgets
that bound a hostile guest in space.node.agent.channel_guard.

Invariants:
- One reader task owns the stream and routes every frame to the call that owns its stream id; frames for
  streams that are not open (left over from before a reconnect, late after a CANCEL, or forged) are dropped,
  never misdelivered. Stream ids start at a random offset, so a previous agent's streams are not ours.
- Memory is bounded per channel: every call's queue is bounded (channel_call), at most MAX_CONCURRENT_CALLS
  calls are open at once (ResourceExhausted beyond). Writes never queue more than WRITE_HIGH_WATER in the
  transport, and a guest that stops reading fails them with Timeout after WRITE_STALL_TIMEOUT instead of
  piling them up.
- A malformed frame from the guest becomes a typed ChannelError on the call it belongs to (or is counted
  and logged when it belongs to none); it never kills the reader. But a guest that exceeds its credit, or
  spends its budgets of protocol errors and unsolicited bytes (token buckets: a torn frame after an agent
  restart is fine, a flood is not), is hostile: the channel is closed with that reason, `on_lost` fires
  (the sandbox is marked crashed), and the holder stops reading from the sandbox.
- What the guest reports on stream 0 is logged through a per-channel rate limit; suppressed messages are
  counted and the count is logged.
- When the stream ends, every pending call fails with ChannelError; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from space.core import errors, tracing
from space.node.agent import channel_call
from space.node.agent.channel_guard import (
    PROTOCOL_ERROR_BURST,
    PROTOCOL_ERRORS_PER_SECOND,
    STRAY_BYTES_BURST,
    STRAY_BYTES_PER_SECOND,
    GuestViolation,
    RateLimitedLog,
    TokenBucket,
)
from space.protocol import (
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    ProtocolError,
    encode_json,
    hello_payload,
    negotiate,
    trace_ids,
)
from space.protocol.flow import INITIAL_WINDOW, announced_window, frame_cost, window_increment
from space.protocol.version import FLOW_CONTROL_VERSION

log = logging.getLogger(__name__)
LAYER = tracing.Layer("space.node")


READ_SIZE = 1 << 20
#: Credit the agent grants the guest per stream (announced in its HELLO).
RECEIVE_WINDOW = INITIAL_WINDOW
MAX_CONCURRENT_CALLS = 64
WRITE_HIGH_WATER = 1 << 20
WRITE_STALL_TIMEOUT = 30.0
#: A cancelled or abandoned call the guest never ends is forgotten after this long.
ABANDON_GRACE = 10.0


class GuestChannel:
    """A connection to one sandbox's daemon."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, name: str = "") -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._calls: dict[int, channel_call.Call] = {}
        # A restarted agent must not take a previous agent's late frames for its own calls.
        self._stream_ids = itertools.count(secrets.randbelow(1 << 30) + 1)
        self._write_lock = asyncio.Lock()
        self._hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.protocol_errors = 0
        self.stray_bytes = 0
        self.protocol_version = 0
        self.flow_control = False
        self.receive_window = RECEIVE_WINDOW
        self.send_window = INITIAL_WINDOW
        self.max_calls = MAX_CONCURRENT_CALLS
        #: Why the agent gave up on this guest (a protocol violation), if it did.
        self.failure: str | None = None
        self.guest_log = RateLimitedLog(name or "?", logger=log)
        self._error_budget = TokenBucket(PROTOCOL_ERROR_BURST, PROTOCOL_ERRORS_PER_SECOND)
        self._stray_budget = TokenBucket(STRAY_BYTES_BURST, STRAY_BYTES_PER_SECOND)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Called once when the stream ends without the node having closed it (the sandbox died).
        self.on_lost: Callable[[str], None] | None = None
        self._closing = False
        self.peer: dict[str, Any] = {}
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"guest-channel-{name}")

    # -- set-up -----------------------------------------------------------------------------------
    @classmethod
    async def connect_unix(cls, path: str, *, timeout: float = 10.0, name: str = "") -> GuestChannel:
        """Connect to a holder socket and complete the HELLO exchange."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(path, limit=1 << 22), timeout
                )
                break
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                # A holder that is being replaced (restore) may briefly have no listener: retry shortly.
                if asyncio.get_running_loop().time() > deadline:
                    raise errors.Unavailable(f"cannot reach sandbox channel at {path}: {exc}") from exc
                await asyncio.sleep(0.005)
            except (OSError, TimeoutError) as exc:
                raise errors.Unavailable(f"cannot reach sandbox channel at {path}: {exc}") from exc
        channel = cls(reader, writer, name=name)
        with LAYER.span("guest.hello"):  # until spaced answers: a booting guest's time (ADR 0072)
            await channel.handshake(timeout=timeout)
        return channel

    async def handshake(self, *, timeout: float = 10.0) -> dict[str, Any]:
        await self.write_frame(
            encode_json(FrameType.HELLO, 0, hello_payload(role="node", window=self.receive_window))
        )
        try:
            peer = await asyncio.wait_for(asyncio.shield(self._hello), timeout)
        except TimeoutError as exc:
            await self.close()
            raise errors.Timeout(
                f"sandbox {self.name or '?'} did not answer HELLO within {timeout}s"
            ) from exc
        try:
            self.protocol_version = negotiate(peer)
        except ProtocolError as exc:
            await self.close()
            raise errors.ChannelError(exc.message, guest_code=exc.code) from exc
        # The guest computes the same version from our HELLO, which it reads before any of our calls.
        self.flow_control = self.protocol_version >= FLOW_CONTROL_VERSION
        self.send_window = announced_window(peer)
        self.peer = peer
        return peer

    # -- calls ------------------------------------------------------------------------------------
    async def open(self, method: str, params: dict[str, Any] | None = None) -> channel_call.Call:
        if self._closed.done():
            raise errors.ChannelError(f"channel to sandbox {self.name or '?'} is closed")
        if len(self._calls) >= self.max_calls:
            raise errors.ResourceExhausted(
                f"sandbox {self.name or '?'} already has {len(self._calls)} calls open on its channel "
                f"(at most {self.max_calls}); retry when some have finished",
                limit=self.max_calls,
            )
        stream = next(self._stream_ids)
        call = channel_call.Call(self, stream, method)
        self._calls[stream] = call
        request: dict[str, Any] = {"method": method, "params": params or {}}
        if (ids := tracing.current_ids()) is not None:  # only the trace id enters the sandbox (ADR 0072)
            request[trace_ids.TRACE_FIELD] = ids[0]
            call.span = LAYER.start(f"guest.{method}", guest_method=method)
        try:
            call_frame = encode_json(FrameType.CALL, stream, request)
            await self.write_frame(call_frame)
        except BaseException:
            self._calls.pop(stream, None)
            raise
        return call

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = 30.0
    ) -> dict[str, Any]:
        """A call with no body whose events and data are not needed."""
        call = await self.open(method, params)
        call.discard_events()
        try:
            return await asyncio.wait_for(call.result(), timeout)
        except TimeoutError as exc:
            await call.cancel()
            raise errors.Timeout(f"{method} got no answer within {timeout}s") from exc

    async def write_frame(self, data: bytes) -> None:
        """Queue one frame for the guest. Waits (bounded) while the transport holds WRITE_HIGH_WATER."""
        try:
            async with asyncio.timeout(WRITE_STALL_TIMEOUT):
                async with self._write_lock:
                    if self._closed.done():
                        raise errors.ChannelError(f"channel to sandbox {self.name or '?'} is closed")
                    while self._writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                        await self._writer.drain()
                    self._writer.write(data)
                    if self._writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                        await self._writer.drain()
        except TimeoutError as exc:
            raise errors.Timeout(
                f"sandbox {self.name or '?'} has not read from its channel for {WRITE_STALL_TIMEOUT:.0f}s"
            ) from exc
        except (ConnectionError, OSError) as exc:
            raise errors.ChannelError(f"channel to sandbox {self.name or '?'} broke: {exc}") from exc

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget_later(self, call: channel_call.Call) -> None:
        """A call we cancelled leaves the table when the guest ends it, or after ABANDON_GRACE anyway (a
        guest that never answers must not hold a call slot forever)."""

        def forget() -> None:
            if self._calls.get(call.stream) is call:
                del self._calls[call.stream]
                call.fail(errors.ChannelError(f"{call.method} was cancelled and the guest never ended it"))

        asyncio.get_running_loop().call_later(ABANDON_GRACE, forget)

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    # -- reading ----------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        """Read until the stream ends, then fail whatever is still waiting; a violation closes the channel."""
        reason = "the sandbox closed its channel"
        try:
            await self._read_frames()
        except GuestViolation as exc:
            reason = f"the sandbox broke the channel protocol: {exc}"
            self.failure = reason
            log.error("sandbox %s: %s; closing its channel", self.name, reason)
        except (ConnectionError, OSError) as exc:
            reason = f"channel read failed: {exc}"
        except asyncio.CancelledError:
            reason = "channel closed by the node"
            raise
        finally:
            self._fail_all(reason)
            self.guest_log.flush()
            if self.failure is not None:
                # Drop the connection (and whatever is unsent): the holder then stops reading the sandbox.
                self._writer.transport.abort()

    async def _read_frames(self) -> None:
        """Decode and route every frame until the guest closes the stream (a torn last frame included)."""
        decoder = FrameDecoder()
        while True:
            data = await self._reader.read(READ_SIZE)
            if not data:
                tail = decoder.finish()
                if tail is not None:
                    self._on_protocol_error(tail)
                return
            for item in decoder.feed(data):
                if isinstance(item, ProtocolError):
                    self._on_protocol_error(item)
                else:
                    self._dispatch(item)

    def _dispatch(self, frame: Frame) -> None:
        """Route one well-formed frame: stream 0 is the channel's own, every other belongs to a call."""
        if frame.stream == 0:
            self._on_channel_frame(frame)
            return
        call = self._calls.get(frame.stream)
        if call is None:
            self._stray(frame)
            return
        if frame.type == FrameType.WINDOW:
            try:
                call.grant(window_increment(frame))
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            return
        if call.deliver(frame):
            self._calls.pop(frame.stream, None)

    def _on_channel_frame(self, frame: Frame) -> None:
        """Stream 0: the guest's HELLO (once), its reports of broken frames (counted, logged), else stray."""
        if frame.type == FrameType.HELLO and not self._hello.done():
            try:
                peer = frame.json()
            except ProtocolError as exc:
                self._on_protocol_error(exc)
                return
            self._hello.set_result(peer)
        elif frame.type == FrameType.ERROR:
            self._count_error()
            self.guest_log.warning("the daemon reported a channel error: %r", frame.payload[:200])
        else:
            self._stray(frame)

    def _stray(self, frame: Frame) -> None:
        """A frame nobody is waiting for: dropped, and charged to the guest's budget of such bytes."""
        cost = frame_cost(len(frame.payload))
        self.stray_bytes += cost
        if not self._stray_budget.take(cost):
            raise GuestViolation(
                f"{self.stray_bytes} bytes of frames for streams that are not open (last: {frame!r})"
            )

    def _count_error(self) -> None:
        self.protocol_errors += 1
        if not self._error_budget.take():
            raise GuestViolation(f"{self.protocol_errors} malformed or unsolicited frames")

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        call = self._calls.get(exc.stream) if exc.stream else None
        if call is not None:
            call.fail(errors.ChannelError(exc.message, guest_code=exc.code))
            self._calls.pop(exc.stream, None)
        else:
            self.guest_log.warning("malformed frame: %s", exc.message)
        if isinstance(exc, FrameTooLarge):
            # Discarded as it arrives, never buffered; but nobody asked for it (an "endless" frame).
            self.stray_bytes += exc.length
            if not self._stray_budget.take(exc.length):
                raise GuestViolation(f"an oversized frame announcing {exc.length} bytes")
        self._count_error()

    def _fail_all(self, reason: str) -> None:
        if not self._closed.done():
            self._closed.set_result(None)
            if not self._closing and self.on_lost is not None:
                self.on_lost(reason)
        if not self._hello.done():
            self._hello.set_exception(errors.ChannelError(reason))
            self._hello.exception()  # mark retrieved: nobody may be waiting for it
        for call in list(self._calls.values()):
            call.fail(errors.ChannelError(reason))
        self._calls.clear()

    @property
    def closed(self) -> bool:
        return self._closed.done()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    async def close(self) -> None:
        self._closing = True
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        if self._writer.transport.get_write_buffer_size():
            self._writer.transport.abort()  # a guest that stopped reading must not hold up the close
        else:
            self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), 5.0)
        for task in list(self._tasks):
            task.cancel()
