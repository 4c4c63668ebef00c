"""Host side of the private channel: multiplexed calls to a sandbox's `spaced` over one byte stream.

Invariants:
- One reader task owns the stream and routes every frame to the call that owns its stream id; frames for
  unknown streams (left over from before a reconnect) are dropped, never misdelivered.
- A malformed frame from the guest becomes a typed ChannelError on the call it belongs to (or is counted
  and logged when it belongs to none); it never kills the reader.
- When the stream ends, every pending call fails with ChannelError; nothing waits forever.
- Guest error codes are translated into space.core errors here, at the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from space.core import errors
from space.protocol import (
    Channel,
    Frame,
    FrameDecoder,
    FrameType,
    ProtocolError,
    encode,
    encode_eof,
    encode_json,
    hello_payload,
    iter_data_frames,
    negotiate,
)

log = logging.getLogger(__name__)

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
        self._queue: asyncio.Queue[Frame | errors.SpaceError | object] = asyncio.Queue()
        self._result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def _deliver(self, item: Frame | errors.SpaceError) -> None:
        if isinstance(item, errors.SpaceError):
            if not self._result.done():
                self._result.set_exception(item)
            self._queue.put_nowait(_END)
            return
        if item.type == FrameType.RESULT:
            if not self._result.done():
                try:
                    self._result.set_result(item.json())
                except ProtocolError as exc:
                    self._result.set_exception(errors.ChannelError(exc.message, guest_code=exc.code))
            self._queue.put_nowait(_END)
        elif item.type == FrameType.ERROR:
            if not self._result.done():
                try:
                    self._result.set_exception(guest_error(item.json()))
                except ProtocolError as exc:
                    self._result.set_exception(errors.ChannelError(exc.message, guest_code=exc.code))
            self._queue.put_nowait(_END)
        else:
            self._queue.put_nowait(item)

    @property
    def done(self) -> bool:
        return self._result.done()

    async def events(self) -> AsyncIterator[CallEvent]:
        """Everything the guest sends before the call's end, in order."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            assert isinstance(item, Frame)
            if item.type == FrameType.EVENT:
                yield CallEvent(FrameType.EVENT, event=item.json())
            elif item.type in (FrameType.DATA, FrameType.EOF):
                try:
                    chan, data = item.channel_data()
                except ProtocolError as exc:
                    raise errors.ChannelError(exc.message, guest_code=exc.code) from exc
                yield CallEvent(item.type, channel=chan, data=data)

    async def send(self, data: bytes, channel: Channel = Channel.BODY) -> None:
        await self._channel._write_many(iter_data_frames(self.stream, channel, data))

    async def send_eof(self, channel: Channel = Channel.BODY) -> None:
        await self._channel._write(encode_eof(self.stream, channel))

    async def cancel(self) -> None:
        if not self.done:
            with contextlib.suppress(errors.ChannelError):
                await self._channel._write(encode(FrameType.CANCEL, self.stream))

    async def result(self) -> dict[str, Any]:
        try:
            return await asyncio.shield(self._result)
        finally:
            if self._result.done():
                self._channel._forget(self.stream)


class GuestChannel:
    """A connection to one sandbox's daemon."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, name: str = "") -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._calls: dict[int, Call] = {}
        self._stream_ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.protocol_errors = 0
        self.protocol_version = 0
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
        await self._write(encode_json(FrameType.HELLO, 0, hello_payload(role="node")))
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
        self.peer = peer
        return peer

    # -- calls ------------------------------------------------------------------------------------
    async def open(self, method: str, params: dict[str, Any] | None = None) -> Call:
        if self._closed.done():
            raise errors.ChannelError(f"channel to sandbox {self.name or '?'} is closed")
        stream = next(self._stream_ids)
        call = Call(self, stream, method)
        self._calls[stream] = call
        await self._write(encode_json(FrameType.CALL, stream, {"method": method, "params": params or {}}))
        return call

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = 30.0
    ) -> dict[str, Any]:
        """A call with no body whose events and data are not needed."""
        call = await self.open(method, params)
        try:
            return await asyncio.wait_for(call.result(), timeout)
        except TimeoutError as exc:
            await call.cancel()
            raise errors.Timeout(f"{method} got no answer within {timeout}s") from exc

    async def _write(self, data: bytes) -> None:
        await self._write_many((data,))

    async def _write_many(self, chunks: Iterable[bytes]) -> None:
        async with self._write_lock:
            if self._closed.done():
                raise errors.ChannelError(f"channel to sandbox {self.name or '?'} is closed")
            try:
                for chunk in chunks:
                    self._writer.write(chunk)
                    if self._writer.transport.get_write_buffer_size() > (1 << 20):
                        await self._writer.drain()
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise errors.ChannelError(f"channel to sandbox {self.name or '?'} broke: {exc}") from exc

    def _forget(self, stream: int) -> None:
        self._calls.pop(stream, None)

    # -- reading ----------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        decoder = FrameDecoder()
        reason = "the sandbox closed its channel"
        try:
            while True:
                data = await self._reader.read(1 << 20)
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
        except (ConnectionError, OSError) as exc:
            reason = f"channel read failed: {exc}"
        except asyncio.CancelledError:
            reason = "channel closed by the node"
            raise
        finally:
            self._fail_all(reason)

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream == 0:
            if frame.type == FrameType.HELLO:
                try:
                    peer = frame.json()
                except ProtocolError as exc:
                    self._on_protocol_error(exc)
                    return
                if not self._hello.done():
                    self._hello.set_result(peer)
            elif frame.type == FrameType.ERROR:
                self.protocol_errors += 1
                log.warning("sandbox %s reported a channel error: %r", self.name, frame.payload[:200])
            return
        call = self._calls.get(frame.stream)
        if call is not None:
            call._deliver(frame)

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        self.protocol_errors += 1
        call = self._calls.get(exc.stream) if exc.stream else None
        if call is not None:
            call._deliver(errors.ChannelError(exc.message, guest_code=exc.code))
        else:
            log.warning("malformed frame from sandbox %s: %s", self.name, exc.message)

    def _fail_all(self, reason: str) -> None:
        if not self._closed.done():
            self._closed.set_result(None)
            if not self._closing and self.on_lost is not None:
                self.on_lost(reason)
        if not self._hello.done():
            self._hello.set_exception(errors.ChannelError(reason))
            self._hello.exception()  # mark retrieved: nobody may be waiting for it
        for call in list(self._calls.values()):
            call._deliver(errors.ChannelError(reason))
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
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
