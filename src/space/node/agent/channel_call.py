"""One call on the private channel: its stream of answers, its body upload, its flow control.

A Call is opened by space.node.agent.channel.GuestChannel, which owns the stream id and routes the guest's
frames for that stream here; the consumer reads `events()`, `send`s body data and waits for `result()`.

Invariants:
- Memory is bounded per call. With protocol 2 its queue holds at most the window the agent granted
  (space.protocol.flow; credit returns only as the consumer takes frames, so a slow client stalls the guest,
  not the agent). With a version-1 guest a call whose queue exceeds LEGACY_CALL_BUDGET fails with
  ResourceExhausted (and is cancelled on the guest).
- A frame beyond the call's window, or a frame type a call never receives, is a GuestViolation (the channel
  closes); a malformed answer becomes a typed ChannelError on this call only.
- A body upload waits for the guest's credit at most CREDIT_STALL_TIMEOUT, then fails with Timeout; once
  the call has ended it stops quietly.
- A consumer that leaves `events()` early abandons the call: what is queued is dropped, nothing more is
  queued, and the guest is told (CANCEL).
- Guest error codes are translated into space.core errors here, at the boundary (`guest_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from space.core import errors, tracing
from space.node.agent.channel_guard import GuestViolation
from space.protocol import (
    Channel,
    Frame,
    FrameType,
    ProtocolError,
    encode,
    encode_eof,
    iter_data_frames,
    trace_ids,
)
from space.protocol.flow import FLOW_CONTROLLED, ReceiveWindow, SendCredit, encode_window, frame_cost
from space.protocol.frames import HEADER_SIZE

#: Version-1 guests have no flow control: bytes a call may have queued before it fails.
LEGACY_CALL_BUDGET = 4 << 20
#: How long a body upload waits for the guest to return credit before it fails.
CREDIT_STALL_TIMEOUT = 120.0

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
# Codes with which the guest says our frames were broken: a channel fault, not the guest's own failure.
_CHANNEL_CODES = frozenset(
    {
        "corrupt_frame",
        "truncated_frame",
        "frame_too_large",
        "unknown_frame_type",
        "malformed_payload",
        "version_mismatch",
        "protocol_error",
    }
)


def guest_error(body: dict[str, Any]) -> errors.SpaceError:
    """The space.core error of an ERROR frame's body (GuestError for a code the agent does not know)."""
    code = str(body.get("code", "internal"))
    message = str(body.get("message", "guest error"))
    if code == "not_supported":  # e.g. a filesystem without user attributes: the request's problem (400)
        return errors.InvalidArgument(message, guest_code=code, reason="not_supported")
    if code == "not_a_terminal":  # resizing a process started without a PTY: 409 naming the "state"
        return errors.InvalidState(message, state="no_terminal", guest_code=code)
    cls = _GUEST_CODE_TO_ERROR.get(code)
    if cls is not None:
        return cls(message, guest_code=code)
    if code in _CHANNEL_CODES:
        return errors.ChannelError(message, guest_code=code)
    return errors.GuestError(message, guest_code=code)


class CallHost(Protocol):
    """What a Call needs from the channel it runs on (space.node.agent.channel.GuestChannel)."""

    name: str
    flow_control: bool
    receive_window: int
    send_window: int

    async def write_frame(self, data: bytes) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    def forget_later(self, call: Call) -> None: ...


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

    def __init__(self, channel: CallHost, stream: int, method: str) -> None:
        self._channel = channel
        self.stream = stream
        self.method = method
        self._queue: asyncio.Queue[Frame | object] = asyncio.Queue()
        self._queued_cost = 0
        self._result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._abandoned = False
        self._discarding = False  # nobody reads this call's events: do not queue them
        #: The call's span while it runs (set by the channel when the call is opened within a trace).
        self.span: Any = None
        flow = channel.flow_control
        self._receive = ReceiveWindow(channel.receive_window) if flow else None
        self._credit = SendCredit(channel.send_window) if flow else None
        self._credit_changed = asyncio.Event()

    # -- from the channel's reader ----------------------------------------------------------------------
    def deliver(self, frame: Frame) -> bool:
        """Queue one frame of this call; True when the call is over (its terminal frame or a failure)."""
        if frame.type in (FrameType.RESULT, FrameType.ERROR):
            self._settle(frame)
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
            self._fail_behind()
            return True
        if self._discarding:
            return False
        self._queued_cost += cost
        self._queue.put_nowait(frame)
        return False

    def _settle(self, frame: Frame) -> None:
        """The call's terminal frame (RESULT or ERROR) decides its result, unless it already failed."""
        if not self._result.done():
            try:
                body = frame.json()
                if frame.type == FrameType.RESULT:
                    self._traced_end(body.pop(trace_ids.TIMING_FIELD, None), error=False)
                    self._result.set_result(body)
                else:
                    self._result.set_exception(guest_error(body))
            except ProtocolError as exc:
                self._result.set_exception(errors.ChannelError(exc.message, guest_code=exc.code))
        self._traced_end(None, error=True)
        self._end()

    def _traced_end(self, spaced_ns: object, *, error: bool) -> None:
        """End this call's span (ADR 0072), with spaced's own time as a span under it when it sent one."""
        span, self.span = self.span, None
        if span is None:
            return
        ctx = span.get_span_context()
        if trace_ids.valid_timing(spaced_ns):
            assert isinstance(spaced_ns, int)
            end = time.time_ns()
            ids = (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
            record = tracing.child_record(ids, f"spaced.{self.method}", "space.guest", end - spaced_ns, end)
            tracing.RING.add(record)
        tracing.finish(span, error=error)

    def _fail_behind(self) -> None:
        """A version-1 guest outran this call's reader by LEGACY_CALL_BUDGET: fail it and cancel it."""
        self.fail(
            errors.ResourceExhausted(
                f"{self.method} on sandbox {self._channel.name or '?'}: the reader fell more than "
                f"{LEGACY_CALL_BUDGET} bytes behind (this sandbox's daemon predates flow control)",
                limit=LEGACY_CALL_BUDGET,
            )
        )
        self._channel.spawn(self._write_cancel())

    def fail(self, exc: errors.SpaceError) -> None:
        if not self._result.done():
            self._result.set_exception(exc)
        self._traced_end(None, error=True)
        self._end()

    def _end(self) -> None:
        # What is still queued stays readable (a RESULT after all the DATA); nothing more is queued.
        self._queue.put_nowait(_END)
        self._credit_changed.set()

    def grant(self, increment: int) -> None:
        """The guest returned `increment` bytes of credit for our uploads (a WINDOW frame)."""
        if self._credit is not None:
            self._credit.grant(increment)
            self._credit_changed.set()

    def discard_events(self) -> None:
        """Nothing will read this call's events (only its result): queue none of them."""
        self._discarding = True

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
                yield _event_of(item)
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
                await self._channel.write_frame(encode_window(self.stream, increment))

    def _abandon(self) -> None:
        """The consumer left: drop what is queued, tell the guest, and stop queueing for this call."""
        if self._abandoned:
            return
        self._abandoned = self._discarding = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_cost = 0
        self._channel.spawn(self.cancel())

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
            await self._channel.write_frame(frame)

    async def send_eof(self, channel: Channel = Channel.BODY) -> None:
        frame = encode_eof(self.stream, channel)
        if await self._wait_for_credit(frame_cost(len(frame) - HEADER_SIZE)):
            await self._channel.write_frame(frame)

    async def cancel(self) -> None:
        if not self.done:
            self._channel.forget_later(self)
            await self._write_cancel()

    async def _write_cancel(self) -> None:
        with contextlib.suppress(errors.ChannelError, errors.Timeout):
            await self._channel.write_frame(encode(FrameType.CANCEL, self.stream))

    async def result(self) -> dict[str, Any]:
        return await asyncio.shield(self._result)


def _event_of(frame: Frame) -> CallEvent:
    """The CallEvent of a queued EVENT, DATA or EOF frame; a malformed one is a ChannelError."""
    try:
        if frame.type == FrameType.EVENT:
            return CallEvent(FrameType.EVENT, event=frame.json())
        chan, data = frame.channel_data()
        return CallEvent(frame.type, channel=chan, data=data)
    except ProtocolError as exc:
        raise errors.ChannelError(exc.message, guest_code=exc.code) from exc
