"""The data plane's streams between HTTP and a sandbox's daemon: process output and file events as NDJSON,
file contents as raw bytes, request bodies into a call.

Invariants:
- Bodies are streamed both ways: uploads go from `request.stream()` to the daemon frame by frame (the
  channel's write buffer bounds what is held), downloads are read from the daemon in `read_window_bytes`
  pieces, so no file is ever held whole in this process.
- Streams that end early (client gone, error) cancel their daemon call (`finish_call`, shielded), so no call
  is left open in the channel.
- A stream's first item is awaited before the headers go out, so an error at once is a normal HTTP error
  with its status; an error after the headers went out is the stream's last NDJSON line,
  `{"type": "error", "error": {...}}` (a bytes stream is cut off instead, which the client detects).
- Every item streamed records the sandbox's activity.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from fastapi import Response
from fastapi.responses import StreamingResponse

from space.core import errors
from space.node.agent.channel_call import Call
from space.node.agent.guest import GuestSession
from space.node.agent.service_core import ServiceCore
from space.protocol import Channel, FrameType
from space.protocol import methods as m
from space.rest import errors as rest_errors

NDJSON = "application/x-ndjson"


def _ndjson_line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, separators=(",", ":")).encode() + b"\n"


async def finish_call(call: Call, grace_s: float) -> None:
    """Make sure an abandoned call ends in the daemon and leaves the channel's table.

    Shielded: it runs while the surrounding request is being cancelled (client disconnect), and a cancel
    frame that never goes out would leave the daemon streaming into a call nobody reads."""
    with anyio.CancelScope(shield=True):
        if not call.done:
            await call.cancel()
        with contextlib.suppress(errors.SpaceError, TimeoutError):
            await asyncio.wait_for(call.result(), grace_s)


async def relay(svc: ServiceCore, sandbox_id: str, call: Call) -> AsyncGenerator[dict[str, Any], None]:
    """A process call (start or attach) as exec-stream events; cancels the call if abandoned."""
    try:
        async for item in call.events():
            svc.touch(sandbox_id)
            if item.kind == FrameType.DATA and item.channel in (Channel.STDOUT, Channel.STDERR):
                kind = "stderr" if item.channel == Channel.STDERR else "stdout"
                yield {"type": kind, "data_b64": base64.b64encode(item.data).decode()}
            elif item.kind == FrameType.EVENT:
                yield dict(item.event)
        result = await call.result()
        svc.touch(sandbox_id)
        if "exit_code" in result or "signal" in result or "timed_out" in result:
            yield {
                "type": "exit",
                "exit_code": result.get("exit_code"),
                "signal": result.get("signal"),
                "timed_out": bool(result.get("timed_out", False)),
                "process_id": result.get("process_id"),
                "offset": result.get("offset"),
            }
        else:  # attach with follow=false: what was buffered has been sent
            yield {"type": "end", "offset": result.get("offset"), "running": result.get("running")}
    finally:
        await finish_call(call, svc.settings.cancel_grace_s)


async def watch(svc: ServiceCore, sandbox_id: str, call: Call) -> AsyncGenerator[dict[str, Any], None]:
    """A files.watch call's events; cancels the call if abandoned."""
    try:
        async for item in call.events():
            if item.kind == FrameType.EVENT:
                svc.touch(sandbox_id)
                yield dict(item.event)
        await call.result()
    finally:
        await finish_call(call, svc.settings.cancel_grace_s)


async def read_file(
    svc: ServiceCore, sandbox_id: str, session: GuestSession, *, path: str, offset: int, length: int | None
) -> AsyncGenerator[bytes, None]:
    """`length` bytes of the file from `offset` (None: to its end), asked for one window at a time."""
    window = svc.settings.read_window_bytes
    position, remaining = offset, length
    while remaining is None or remaining > 0:
        want = window if remaining is None else min(window, remaining)
        call = await session.channel.open(m.FILES_READ, {"path": path, "offset": position, "length": want})
        got = 0
        try:
            async for item in call.events():
                if item.kind == FrameType.DATA and item.data:
                    got += len(item.data)
                    svc.touch(sandbox_id)
                    yield item.data
            await call.result()
        finally:
            await finish_call(call, svc.settings.cancel_grace_s)
        position += got
        if remaining is not None:
            remaining -= got
        if got < want:
            return


async def write_body(
    svc: ServiceCore, call: Call, body: AsyncIterator[bytes], sandbox_id: str
) -> dict[str, Any]:
    """Stream a request body into a call (files.write, process.input) and return its result."""
    try:
        try:
            async for chunk in body:
                if call.done:
                    break  # the daemon already refused (disk full, process gone): stop sending
                if chunk:
                    await call.send(chunk)
                    svc.touch(sandbox_id)
            if not call.done:
                await call.send_eof()
        except errors.ChannelError:
            if not call.done:
                raise
        return await call.result()
    finally:
        # Client disconnect or any failure before EOF: cancel, so files.write discards its temp file.
        await finish_call(call, svc.settings.cancel_grace_s)


async def ndjson_response(events: AsyncGenerator[dict[str, Any], None]) -> Response:
    """An NDJSON response whose first item is awaited before the headers go out, so an error that happens
    at once (unknown process, stopped sandbox) is a normal HTTP error with its status."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return Response(b"", media_type=NDJSON)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _ndjson_line(first)
            async for item in events:
                yield _ndjson_line(item)
        except errors.SpaceError as exc:
            yield _ndjson_line({"type": "error", **rest_errors.body_of(exc)})
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()

    return StreamingResponse(body(), media_type=NDJSON, headers={"Cache-Control": "no-store"})


async def bytes_response(chunks: AsyncGenerator[bytes, None]) -> Response:
    """Raw bytes streamed; the first chunk is awaited first so e.g. a missing file is a 404, not an empty
    200. An error later aborts the connection (the chunked body never ends), which the client detects."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        return Response(b"", media_type="application/octet-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    return StreamingResponse(body(), media_type="application/octet-stream")
