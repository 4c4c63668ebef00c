"""The few primitives where the async SDK and the sync SDK truly differ, written by hand for both.

The async SDK (space.sdk._async) is the source; scripts/gen_sync_sdk.py turns it into the sync SDK
(space.sdk._sync) by deleting `async`/`await` and renaming `Async*` names to their sync twins, so
`await AsyncBackend.sleep(s)` becomes `SyncBackend.sleep(s)`. Everything that is not a mechanical rename
lives here, in matching pairs with the same method names and arguments.

Invariants:
- AsyncBackend never blocks the event loop: a file object's read runs in a worker thread.
- A callback handed to the async SDK may be a plain function or a coroutine function; the sync SDK calls
  it and ignores what it returns.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import IO, Any

__all__ = ["AsyncBackend", "AsyncChunks", "AsyncOnData", "SyncBackend", "SyncChunks", "SyncOnData"]

SyncChunks = Iterable[bytes]
AsyncChunks = Iterable[bytes] | AsyncIterable[bytes]
SyncOnData = Callable[[bytes], object]
AsyncOnData = Callable[[bytes], object] | Callable[[bytes], Awaitable[object]]


class AsyncBackend:
    @staticmethod
    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

    @staticmethod
    async def read(handle: IO[bytes] | IO[str], size: int) -> bytes | str:
        """One read of a (blocking) file object, off the event loop."""
        return await asyncio.to_thread(handle.read, size)

    @staticmethod
    async def call(callback: Callable[..., object], *args: Any) -> None:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result

    @staticmethod
    async def iterate(chunks: AsyncChunks) -> AsyncIterator[bytes]:
        """The items of a plain or an async iterable."""
        if isinstance(chunks, AsyncIterable):
            async for chunk in chunks:
                yield chunk
        else:
            for chunk in chunks:
                yield chunk


class SyncBackend:
    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    @staticmethod
    def read(handle: IO[bytes] | IO[str], size: int) -> bytes | str:
        return handle.read(size)

    @staticmethod
    def call(callback: Callable[..., object], *args: Any) -> None:
        callback(*args)

    @staticmethod
    def iterate(chunks: SyncChunks) -> Iterator[bytes]:
        return iter(chunks)
