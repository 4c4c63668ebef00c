"""The daemon's side of the private channel: one fair writer, and one `Call` object per open stream.

Invariants:
- Frames are written whole and one at a time: every write goes through `ChannelWriter.send`, which holds a
  FIFO (ticket) lock, so a thread streaming output can never starve another call's reply — a waiting writer
  is served after at most the frames queued before it, each at most MAX_PAYLOAD (process output: 64 KiB).
- A call sends exactly one terminal frame (RESULT or ERROR) and nothing after it; frames sent after the
  terminal one (a late output chunk, a handler finishing after an abort) are dropped, not written.
- The reader never blocks on a call for long: the inbound body queue of a call is bounded in bytes, the
  reader waits at most BODY_PUT_WAIT for room, and then the body is marked overflowed and dropped (the
  call fails instead of the whole channel stalling behind a consumer that stopped reading).
- Once the channel is broken (the host went away), every send raises ChannelClosed so handler loops stop.
- Flow control (protocol 2, after the host's HELLO negotiated it): a call sends DATA/EOF/EVENT only within
  the credit the host granted for its stream, waiting (outside every lock) for WINDOW frames otherwise; so
  a host that reads slowly slows the process or file read behind the call, never the other calls. The
  daemon returns credit for request bodies as the handler consumes them. With a version-1 host there is no
  credit and calls send freely, as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from space.protocol.errors import ChannelClosed, ProtocolError
from space.protocol.flow import ReceiveWindow, SendCredit, encode_window, frame_cost
from space.protocol.frames import HEADER_SIZE, Channel, Frame, FrameType, encode_data, encode_eof, encode_json

BODY_BUDGET = 16 << 20  # bytes of request body a call may have queued before the reader waits
BODY_PUT_WAIT = 10.0  # seconds the reader waits for a slow body consumer before giving up on that call
CREDIT_POLL = 1.0  # seconds between checks of a broken channel while waiting for credit

ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EISDIR: "is_a_directory",
    errno.ENOTDIR: "not_a_directory",
    errno.ENOTEMPTY: "not_empty",
    errno.EEXIST: "already_exists",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.ESRCH: "no_such_process",
    errno.EINVAL: "invalid_argument",
    errno.ENAMETOOLONG: "invalid_argument",
    errno.ELOOP: "invalid_argument",
    errno.EXDEV: "invalid_argument",
}


class GuestError(Exception):
    """A failure with a stable code from methods.GUEST_ERROR_CODES, sent to the host as an ERROR frame."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


class Cancelled(Exception):
    """The host cancelled the call (or the call already ended) while a handler was waiting on it."""


def error_payload(exc: BaseException) -> dict[str, Any]:
    """Map any handler exception to an ERROR payload; only GuestError and OSError get specific codes."""
    if isinstance(exc, GuestError):
        return {**exc.extra, "code": exc.code, "message": exc.message}
    if isinstance(exc, Cancelled):
        return {"code": "cancelled", "message": "call cancelled"}
    if isinstance(exc, ProtocolError):
        return {"code": exc.code, "message": exc.message}
    if isinstance(exc, OSError):
        code = ERRNO_CODES.get(exc.errno or 0, "internal")
        parts = [exc.strerror or str(exc)]
        if exc.filename is not None:
            parts.append(repr(exc.filename))
        return {"code": code, "message": ": ".join(parts), "errno": exc.errno}
    return {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}


class FairLock:
    """A FIFO lock: waiters are served in arrival order (threading.Lock lets a hot thread barge)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *_exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class ChannelWriter:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = FairLock()
        self.broken = False

    def send(self, frame: bytes) -> None:
        with self._lock:
            if self.broken:
                raise ChannelClosed("the channel to the host is closed")
            view = memoryview(frame)
            try:
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError as exc:
                self.broken = True
                raise ChannelClosed(f"writing to the host failed: {exc}") from exc


class Inbound:
    """Frames (DATA/EOF) the host sent on a call's stream after its CALL, bounded in bytes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frames: deque[Frame] = deque()
        self._bytes = 0
        self._closed = False
        self._refused = False
        self.overflowed = False

    def put(self, frame: Frame) -> None:
        with self._cond:
            if self._closed or self._refused or self.overflowed:
                return
            size = len(frame.payload)
            if self._bytes and self._bytes + size > BODY_BUDGET:
                ok = self._cond.wait_for(
                    lambda: self._closed or self._bytes + size <= BODY_BUDGET, timeout=BODY_PUT_WAIT
                )
                if not ok:
                    self.overflowed = True
                    self._frames.clear()
                    self._bytes = 0
                    self._cond.notify_all()
                    return
                if self._closed:
                    return
            self._frames.append(frame)
            self._bytes += size
            self._cond.notify_all()

    @property
    def empty(self) -> bool:
        with self._cond:
            return not self._frames

    def refuse(self) -> None:
        """This call takes no body: drop whatever the host sends instead of queueing it."""
        with self._cond:
            self._refused = True
            self._frames.clear()
            self._bytes = 0
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._frames.clear()
            self._bytes = 0
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Frame | None:
        """The next frame; None on timeout. Raises Cancelled once closed, GuestError after an overflow."""
        with self._cond:
            self._cond.wait_for(lambda: self._frames or self._closed or self.overflowed, timeout=timeout)
            if self._closed:
                raise Cancelled
            if self.overflowed:
                raise GuestError("invalid_argument", "request body overflowed: the consumer fell behind")
            if not self._frames:
                return None
            frame = self._frames.popleft()
            self._bytes -= len(frame.payload)
            self._cond.notify_all()
            return frame


class Call:
    """One open stream: the handler's way to answer, and the host's body/CANCEL frames for it."""

    def __init__(
        self,
        stream: int,
        method: str,
        writer: ChannelWriter,
        on_done: Callable[[Call], None],
        *,
        send_window: int | None = None,
        receive_window: int | None = None,
    ) -> None:
        self.stream = stream
        self.method = method
        #: The node traces this call (its CALL carried a valid trace id): the RESULT carries our time.
        self.traced = False
        self.inbound = Inbound()
        self.cancelled = threading.Event()
        self._writer = writer
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = False
        self._wakers: list[Callable[[], None]] = []
        # None: a version-1 host, no flow control in either direction.
        self._credit = SendCredit(send_window) if send_window is not None else None
        self._credit_cond = threading.Condition(threading.Lock())
        self._receive = ReceiveWindow(receive_window) if receive_window is not None else None

    @property
    def finished(self) -> bool:
        return self._finished

    def grant(self, increment: int) -> None:
        """The host returned credit for this stream (a WINDOW frame)."""
        if self._credit is None:
            return
        with self._credit_cond:
            self._credit.grant(increment)
            self._credit_cond.notify_all()

    def _wait_for_credit(self, cost: int) -> None:
        credit = self._credit
        if credit is None:
            return
        with self._credit_cond:
            while not credit.can_send(cost):
                if self._finished or self.cancelled.is_set():
                    raise Cancelled
                if self._writer.broken:
                    raise ChannelClosed("the channel to the host is closed")
                self._credit_cond.wait(CREDIT_POLL)
            credit.spend(cost)

    def _send_flow(self, frame: bytes) -> bool:
        """A flow-controlled frame: wait for the host's credit (outside the call's lock), then send."""
        self._wait_for_credit(frame_cost(len(frame) - HEADER_SIZE))
        return self._send(frame)

    def _send(self, frame: bytes, terminal: bool = False) -> bool:
        with self._lock:
            if self._finished:
                return False
            if terminal:
                self._finished = True
            try:
                self._writer.send(frame)
            finally:
                if terminal:
                    self.inbound.close()
                    self._on_done(self)
        return True

    def event(self, payload: dict[str, Any]) -> None:
        if not self._send_flow(encode_json(FrameType.EVENT, self.stream, payload)):
            raise Cancelled

    def data(self, channel: Channel, chunk: bytes) -> None:
        if not self._send_flow(encode_data(self.stream, channel, chunk)):
            raise Cancelled

    def eof(self, channel: Channel) -> None:
        if not self._send_flow(encode_eof(self.stream, channel)):
            raise Cancelled

    def result(self, payload: dict[str, Any]) -> None:
        self._send(encode_json(FrameType.RESULT, self.stream, payload), terminal=True)

    def error(self, payload: dict[str, Any]) -> None:
        self._send(encode_json(FrameType.ERROR, self.stream, payload), terminal=True)

    def abort(self, payload: dict[str, Any]) -> None:
        """End the call from outside its handler (a protocol error on its stream): ERROR now, then cancel."""
        try:
            self.error(payload)
        finally:
            self.cancel()

    def cancel(self) -> None:
        self.cancelled.set()
        self.inbound.close()
        with self._credit_cond:
            self._credit_cond.notify_all()
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Run `wake` on cancel, so a handler blocked on some other condition notices it promptly."""
        with self._lock:
            self._wakers.append(wake)
        if self.cancelled.is_set():
            wake()

    def remove_waker(self, wake: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._wakers.remove(wake)

    def body(self) -> Iterator[bytes]:
        """The request body: BODY DATA payloads until EOF BODY. Raises Cancelled on CANCEL."""
        while True:
            frame = self.inbound.get()
            if frame is None:
                continue
            self._consumed(frame)
            channel, chunk = frame.channel_data()
            if channel != Channel.BODY:
                raise GuestError("invalid_argument", f"unexpected {channel.name} frame in a request body")
            if frame.type == FrameType.EOF:
                return
            if chunk:
                yield chunk

    def _consumed(self, frame: Frame) -> None:
        """Return credit to the host for body frames the handler took (protocol 2)."""
        if self._receive is None:
            return
        increment = self._receive.consume(frame_cost(len(frame.payload)), idle=self.inbound.empty)
        if increment and not self._finished:
            with contextlib.suppress(ChannelClosed):
                self._writer.send(encode_window(self.stream, increment))


def encode_error(stream: int, payload: dict[str, Any]) -> bytes:
    return encode_json(FrameType.ERROR, stream, payload)
