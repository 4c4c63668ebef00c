"""Keep-alive for envd's server streams: a `keepalive` message when nothing else went out for a while.

Invariants:
- The interval is the client's `Keepalive-Ping-Interval` header (seconds, as E2B's SDK sends it), clamped
  to [MIN_S, MAX_S]; absent or malformed: DEFAULT_S (envd's default).
- A keep-alive goes out only after a full quiet interval: every real item resets the clock.
- The source is read by one task, so a timeout never cancels the source mid-item; when the consumer stops,
  that task is cancelled and the source closed.
- A stream ends as soon as its client disconnects (`watching_disconnect` notes it from the request's
  `receive`), not at its next item: a closed stream of a quiet process frees its node call and its
  caller's stream slot at once, not after the next output or keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TypeVar

from starlette.types import Message, Receive

T = TypeVar("T")

DEFAULT_S = 90.0
MIN_S = 1.0
MAX_S = 600.0
_END = object()
#: Set when the client of the request being served went away (`watching_disconnect`).
_client_gone: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("envd_gone", default=None)


def interval_of(headers: Mapping[str, str]) -> float:
    raw = headers.get("keepalive-ping-interval", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_S
    if math.isnan(value):
        return DEFAULT_S
    return min(max(value, MIN_S), MAX_S)


def watching_disconnect(receive: Receive) -> Receive:
    """`receive` for one request, noting its client's disconnect for the streams it serves."""
    gone = asyncio.Event()
    _client_gone.set(gone)

    async def watched() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
        return message

    return watched


async def with_keepalive(
    source: AsyncIterator[T], interval_s: float, keepalive: Callable[[], T]
) -> AsyncIterator[T]:
    """`source`'s items, and `keepalive()` after every `interval_s` without one; ends (closing `source`)
    as soon as the request's client is gone."""
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=1)
    failure: list[BaseException] = []

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put(item)
        except Exception as exc:  # re-raised in the consumer: the stream's own error
            failure.append(exc)
        finally:
            await queue.put(_END)

    task = asyncio.create_task(pump())
    gone = _client_gone.get()
    gone_wait = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            waiting = {getter} if gone_wait is None else {getter, gone_wait}
            done, _pending = await asyncio.wait(waiting, timeout=interval_s, return_when=FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if gone_wait is not None and gone_wait in done:
                    return  # nobody reads any more: free what the stream holds now, not at its next item
                yield keepalive()
                continue
            item = getter.result()
            if item is _END:
                break
            yield item  # type: ignore[misc]
        if failure:
            raise failure[0]
    finally:
        if gone_wait is not None:
            gone_wait.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
