"""Host side of the private channel: multiplexed calls to a sandbox's `spaced` over one byte stream.

The guest is not trusted: whatever runs in the sandbox may replace or impersonate `spaced` (a root process
there can write to the daemon's channel descriptors), so everything read from the channel is bounded here.

Invariants:
- One reader task owns the stream and routes every frame to the call that owns its stream id; frames for
  streams that are not open (left over from before a reconnect, late after a CANCEL, or forged) are dropped,
  never misdelivered. Stream ids start at a random offset, so a previous agent's streams are not ours.
- Memory is bounded per channel. With protocol 2 every call's queue holds at most the window the agent
  granted (space.protocol.flow; credit returns only as the consumer takes frames, so a slow client stalls
  the guest, not the agent). With a version-1 guest a call whose queue exceeds LEGACY_CALL_BUDGET fails
  with ResourceExhausted. At most MAX_CONCURRENT_CALLS calls are open at once (ResourceExhausted beyond).
  Writes never queue more than WRITE_HIGH_WATER in the transport, and a guest that stops reading fails
  them with Timeout after WRITE_STALL_TIMEOUT instead of piling them up.
- A malformed frame from the guest becomes a typed ChannelError on the call it belongs to (or is counted
  and logged when it belongs to none); it never kills the reader. But a guest that exceeds its credit, or
  spends its budgets of protocol errors and unsolicited bytes (token buckets: a torn frame after an agent
  restart is fine, a flood is not), is hostile: the channel is closed with that reason, `on_lost` fires
  (the sandbox is marked crashed), and the holder stops reading from the sandbox.
- What the guest reports on stream 0 is logged through a per-channel rate limit; suppressed messages are
  counted and the count is logged.
- When the stream ends, every pending call fails with ChannelError; nothing waits forever.
- Guest error codes are translated into space.core errors here, at the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from space.core import errors
from space.protocol import (
    Channel,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    ProtocolError,
    encode,
    encode_eof,
    encode_json,
    hello_payload,
    iter_data_frames,
    negotiate,
)
from space.protocol.flow import (
    FLOW_CONTROLLED,
    INITIAL_WINDOW,
    ReceiveWindow,
    SendCredit,
    announced_window,
    encode_window,
    frame_cost,
    window_increment,
)
from space.protocol.frames import HEADER_SIZE
from space.protocol.version import FLOW_CONTROL_VERSION

log = logging.getLogger(__name__)

READ_SIZE = 1 << 20
#: Credit the agent grants the guest per stream (announced in its HELLO).
RECEIVE_WINDOW = INITIAL_WINDOW
MAX_CONCURRENT_CALLS = 64
#: Version-1 guests have no flow control: bytes a call may have queued before it fails.
LEGACY_CALL_BUDGET = 4 << 20
WRITE_HIGH_WATER = 1 << 20
WRITE_STALL_TIMEOUT = 30.0
#: How long a body upload waits for the guest to return credit before it fails.
CREDIT_STALL_TIMEOUT = 120.0
#: A cancelled or abandoned call the guest never ends is forgotten after this long.
ABANDON_GRACE = 10.0
PROTOCOL_ERROR_BURST = 100
PROTOCOL_ERRORS_PER_SECOND = 10.0
STRAY_BYTES_BURST = 32 << 20
STRAY_BYTES_PER_SECOND = 8 << 20
LOG_BURST = 20
LOGS_PER_SECOND = 1.0

_GUEST_CODE_TO_ERROR: dict[str, type[errors.SpaceError]] = {
    "not_found": errors.NotFound,
    "no_such_process": errors.NotFound,
    "already_exists": errors.AlreadyExists,
    "invalid_argument": errors.InvalidArgument,
    "not_a_directory": errors.InvalidArgument,
    "is_a_directory": errors.InvalidArgument,
    "not_empty": errors.Conflict,
    "permission_denied": errors.PermissionDenied,
    "no_space": errors.ResourceExhausted,
    "unknown_method": errors.InvalidArgument,
}


def guest_error(body: dict[str, Any]) -> errors.SpaceError:
    code = str(body.get("code", "internal"))
    message = str(body.get("message", "guest error"))
    cls = _GUEST_CODE_TO_ERROR.get(code)
    if cls is not None:
        return cls(message, guest_code=code)
    if code in {
        "corrupt_frame",
        "truncated_frame",
        "frame_too_large",
        "unknown_frame_type",
        "malformed_payload",
        "version_mismatch",
        "protocol_error",
    }:
        return errors.ChannelError(message, guest_code=code)
    return errors.GuestError(message, guest_code=code)


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `take` says whether `amount` was available."""

    def __init__(self, capacity: float, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = rate
        self._clock = clock
        self._tokens = capacity
        self._stamp = clock()

    def take(self, amount: float = 1.0) -> bool:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= amount:
            self._tokens -= amount
            return True
        return False


class RateLimitedLog:
    """Warnings about one sandbox, at most LOG_BURST at once and LOGS_PER_SECOND after that; the number
    suppressed is counted and logged with the next message that gets through (or on `flush`)."""

    def __init__(self, name: str, burst: float = LOG_BURST, rate: float = LOGS_PER_SECOND) -> None:
        self.name = name
        self._bucket = TokenBucket(burst, rate)
        self.suppressed = 0
        self.suppressed_total = 0
        self.logged = 0

    def warning(self, message: str, *args: object) -> None:
        if not self._bucket.take():
            self.suppressed += 1
            self.suppressed_total += 1
            return
        self.logged += 1
        if self.suppressed:
            log.warning(
                "sandbox %s: " + message + " (%d earlier messages suppressed by the rate limit)",
                self.name,
                *args,
                self.suppressed,
            )
            self.suppressed = 0
        else:
            log.warning("sandbox %s: " + message, self.name, *args)

    def flush(self) -> None:
        if self.suppressed:
            log.warning(
                "sandbox %s: %d channel messages suppressed by the rate limit", self.name, self.suppressed
            )
            self.logged += 1
            self.suppressed = 0


class GuestViolation(Exception):
    """The guest broke the protocol in a way a correct `spaced` never does: the channel is closed."""


@dataclass
class CallEvent:
    """One item of a call's answer: an EVENT, a DATA chunk or an EOF."""

    kind: FrameType
    channel: Channel | None = None
    data: bytes = b""
    event: dict[str, Any] = field(default_factory=dict)


_END = object()


class Call:
    """One open call: iterate its events, send body data, cancel; `result()` waits for its end."""

    def __init__(self, channel: GuestChannel, stream: int, method: str) -> None:
        self._channel = channel
        self.stream = stream
        self.method = method
        self._queue: asyncio.Queue[Frame | object] = asyncio.Queue()
        self._queued_cost = 0
        self._result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._abandoned = False
        self._discarding = False  # nobody reads this call's events: do not queue them
        flow = channel.flow_control
        self._receive = ReceiveWindow(channel.receive_window) if flow else None
        self._credit = SendCredit(channel.send_window) if flow else None
        self._credit_changed = asyncio.Event()

    # -- from the reader -------------------------------------------------------------------------------
    def _deliver(self, frame: Frame) -> bool:
        """Queue one frame of this call; True when the call is over (its terminal frame or a failure)."""
        if frame.type in (FrameType.RESULT, FrameType.ERROR):
            if not self._result.done():
                try:
                    body = frame.json()
                    if frame.type == FrameType.RESULT:
                        self._result.set_result(body)
                    else:
                        self._result.set_exception(guest_error(body))
                except ProtocolError as exc:
                    self._result.set_exception(errors.ChannelError(exc.message, guest_code=exc.code))
            self._end()
            return True
        if frame.type not in FLOW_CONTROLLED:
            raise GuestViolation(f"{frame.type.name} frame on stream {self.stream} from the guest")
        cost = frame_cost(len(frame.payload))
        if self._receive is not None:
            if not self._receive.receive(cost):
                raise GuestViolation(
                    f"stream {self.stream} ({self.method}) exceeded its flow-control window of "
                    f"{self._receive.window} bytes"
                )
        elif self._queued_cost + cost > LEGACY_CALL_BUDGET:
            self._fail(
                errors.ResourceExhausted(
                    f"{self.method} on sandbox {self._channel.name or '?'}: the reader fell more than "
                    f"{LEGACY_CALL_BUDGET} bytes behind (this sandbox's daemon predates flow control)",
                    limit=LEGACY_CALL_BUDGET,
                )
            )
            self._channel._spawn(self._write_cancel())
            return True
        if self._discarding:
            return False
        self._queued_cost += cost
        self._queue.put_nowait(frame)
        return False

    def _fail(self, exc: errors.SpaceError) -> None:
        if not self._result.done():
            self._result.set_exception(exc)
        self._end()

    def _end(self) -> None:
        # What is still queued stays readable (a RESULT after all the DATA); nothing more is queued.
        self._queue.put_nowait(_END)
        self._credit_changed.set()

    def _grant(self, increment: int) -> None:
        if self._credit is not None:
            self._credit.grant(increment)
            self._credit_changed.set()

    # -- for the consumer --------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._result.done()

    async def events(self) -> AsyncIterator[CallEvent]:
        """Everything the guest sends before the call's end, in order. Leaving early abandons the call."""
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                assert isinstance(item, Frame)
                cost = frame_cost(len(item.payload))
                self._queued_cost -= cost
                await self._consumed(cost)
                try:
                    if item.type == FrameType.EVENT:
                        yield CallEvent(FrameType.EVENT, event=item.json())
                    else:
                        chan, data = item.channel_data()
                        yield CallEvent(item.type, channel=chan, data=data)
                except ProtocolError as exc:
                    raise errors.ChannelError(exc.message, guest_code=exc.code) from exc
        finally:
            if not self.done:
                self._abandon()

    async def _consumed(self, cost: int) -> None:
        """Return credit to the guest as frames leave the queue (flow control)."""
        if self._receive is None:
            return
        increment = self._receive.consume(cost, idle=self._queue.empty())
        if increment and not self.done:
            with contextlib.suppress(errors.ChannelError, errors.Timeout):
                await self._channel._write(encode_window(self.stream, increment))

    def _abandon(self) -> None:
        """The consumer left: drop what is queued, tell the guest, and stop queueing for this call."""
        if self._abandoned:
            return
        self._abandoned = self._discarding = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_cost = 0
        self._channel._spawn(self.cancel())

    async def _wait_for_credit(self, cost: int) -> bool:
        """Wait until the guest's credit covers `cost`; False when the call ended meanwhile."""
        credit = self._credit
        if credit is None:
            return not self.done
        while not credit.can_send(cost):
            if self.done:
                return False
            self._credit_changed.clear()
            try:
                await asyncio.wait_for(self._credit_changed.wait(), CREDIT_STALL_TIMEOUT)
            except TimeoutError as exc:
                raise errors.Timeout(
                    f"sandbox {self._channel.name or '?'} took no {self.method} input for "
                    f"{CREDIT_STALL_TIMEOUT:.0f}s"
                ) from exc
        if self.done:
            return False
        credit.spend(cost)
        return True

    async def send(self, data: bytes, channel: Channel = Channel.BODY) -> None:
        """Send body data within the guest's credit; stops quietly once the call has ended."""
        for frame in iter_data_frames(self.stream, channel, data):
            if not await self._wait_for_credit(frame_cost(len(frame) - HEADER_SIZE)):
                return
            await self._channel._write(frame)

    async def send_eof(self, channel: Channel = Channel.BODY) -> None:
        frame = encode_eof(self.stream, channel)
        if await self._wait_for_credit(frame_cost(len(frame) - HEADER_SIZE)):
            await self._channel._write(frame)

    async def cancel(self) -> None:
        if not self.done:
            self._channel._forget_later(self)
            await self._write_cancel()

    async def _write_cancel(self) -> None:
        with contextlib.suppress(errors.ChannelError, errors.Timeout):
            await self._channel._write(encode(FrameType.CANCEL, self.stream))

    async def result(self) -> dict[str, Any]:
        return await asyncio.shield(self._result)


class GuestChannel:
    """A connection to one sandbox's daemon."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, name: str = "") -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._calls: dict[int, Call] = {}
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
        self.guest_log = RateLimitedLog(name or "?")
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
        await channel.handshake(timeout=timeout)
        return channel

    async def handshake(self, *, timeout: float = 10.0) -> dict[str, Any]:
        await self._write(
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
    async def open(self, method: str, params: dict[str, Any] | None = None) -> Call:
        if self._closed.done():
            raise errors.ChannelError(f"channel to sandbox {self.name or '?'} is closed")
        if len(self._calls) >= self.max_calls:
            raise errors.ResourceExhausted(
                f"sandbox {self.name or '?'} already has {len(self._calls)} calls open on its channel "
                f"(at most {self.max_calls}); retry when some have finished",
                limit=self.max_calls,
            )
        stream = next(self._stream_ids)
        call = Call(self, stream, method)
        self._calls[stream] = call
        try:
            await self._write(encode_json(FrameType.CALL, stream, {"method": method, "params": params or {}}))
        except BaseException:
            self._calls.pop(stream, None)
            raise
        return call

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = 30.0
    ) -> dict[str, Any]:
        """A call with no body whose events and data are not needed."""
        call = await self.open(method, params)
        call._discarding = True  # nothing reads its events: queue none of them
        try:
            return await asyncio.wait_for(call.result(), timeout)
        except TimeoutError as exc:
            await call.cancel()
            raise errors.Timeout(f"{method} got no answer within {timeout}s") from exc

    async def _write(self, data: bytes) -> None:
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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget_later(self, call: Call) -> None:
        """A call we cancelled leaves the table when the guest ends it, or after ABANDON_GRACE anyway (a
        guest that never answers must not hold a call slot forever)."""

        def forget() -> None:
            if self._calls.get(call.stream) is call:
                del self._calls[call.stream]
                call._fail(errors.ChannelError(f"{call.method} was cancelled and the guest never ended it"))

        asyncio.get_running_loop().call_later(ABANDON_GRACE, forget)

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    # -- reading ----------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        decoder = FrameDecoder()
        reason = "the sandbox closed its channel"
        try:
            while True:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    tail = decoder.finish()
                    if tail is not None:
                        self._on_protocol_error(tail)
                    break
                for item in decoder.feed(data):
                    if isinstance(item, ProtocolError):
                        self._on_protocol_error(item)
                    else:
                        self._dispatch(item)
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

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream == 0:
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
            return
        call = self._calls.get(frame.stream)
        if call is None:
            self._stray(frame)
            return
        if frame.type == FrameType.WINDOW:
            try:
                call._grant(window_increment(frame))
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            return
        if call._deliver(frame):
            self._calls.pop(frame.stream, None)

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
            call._fail(errors.ChannelError(exc.message, guest_code=exc.code))
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
            call._fail(errors.ChannelError(reason))
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
