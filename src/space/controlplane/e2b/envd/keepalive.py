"""Keep-alive for envd's server streams: a `keepalive` message when nothing else went out for a while.

Invariants:
- The interval is the client's `Keepalive-Ping-Interval` header (seconds, as E2B's SDK sends it), clamped
  to [MIN_S, MAX_S]; absent or malformed: DEFAULT_S (envd's default).
- A keep-alive goes out only after a full quiet interval: every real item resets the clock.
- The source is read by one task, so a timeout never cancels the source mid-item; when the consumer stops
  (client gone), that task is cancelled and the source closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

DEFAULT_S = 90.0
MIN_S = 1.0
MAX_S = 600.0
_END = object()


def interval_of(headers: Mapping[str, str]) -> float:
    raw = headers.get("keepalive-ping-interval", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_S
    if math.isnan(value):
        return DEFAULT_S
    return min(max(value, MIN_S), MAX_S)


async def with_keepalive(
    source: AsyncIterator[T], interval_s: float, keepalive: Callable[[], T]
) -> AsyncIterator[T]:
    """`source`'s items, and `keepalive()` after every `interval_s` without one."""
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
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval_s)
            except TimeoutError:
                yield keepalive()
                continue
            if item is _END:
                break
            yield item  # type: ignore[misc]
        if failure:
            raise failure[0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
