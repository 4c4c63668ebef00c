"""A sandbox's files: read, write (streamed from files and iterators), list, stat, rename, watch.

Invariants:
- Uploads from a file object or an iterator are streamed chunk by chunk (never joined in memory, so never
  retried); in-memory data is sent as bytes (so a failed send may be retried).
- Downloads via read_stream and events via watch are yielded as they arrive. Only `read` returns a whole
  file in memory.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import IO, Any, cast

from space.core.errors import NotFound
from space.sdk._async.http import AsyncSandboxRef
from space.sdk._backend import AsyncBackend, AsyncChunks

__all__ = ["CHUNK", "AsyncFiles", "AsyncUploadable", "async_upload_body"]

CHUNK = 256 * 1024
AsyncUploadable = bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | AsyncChunks


def async_upload_body(data: AsyncUploadable, chunk_size: int = CHUNK) -> bytes | AsyncIterator[bytes]:
    """bytes for in-memory data (replayable); a lazy chunk iterator for file objects and iterators."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(cast("IO[bytes] | IO[str]", data), chunk_size)
    return _iter_chunks(data)


async def _read_chunks(handle: IO[bytes] | IO[str], chunk_size: int) -> AsyncIterator[bytes]:
    while True:
        chunk = await AsyncBackend.read(handle, chunk_size)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


async def _iter_chunks(chunks: AsyncChunks) -> AsyncIterator[bytes]:
    async for chunk in AsyncBackend.iterate(chunks):
        if chunk:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandboxRef) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/files"

    async def write(
        self, path: str, data: AsyncUploadable, *, mode: int | None = None, chunk_size: int = CHUNK
    ) -> int:
        """Write a file from bytes/str, a binary file object or an iterator of bytes (streamed); returns
        the size written."""
        answer = await self._http.json(
            "PUT",
            self._base,
            params={"path": path, "mode": mode},
            content=async_upload_body(data, chunk_size),
            headers={"Content-Type": "application/octet-stream"},
            timeout=self._http.timeout(None),
        )
        return int(answer.get("size", 0)) if isinstance(answer, dict) else 0

    async def read(self, path: str) -> bytes:
        response = await self._http.send(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        )
        return response.content

    async def read_stream(self, path: str, *, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        """The file's bytes as they arrive (never the whole file in memory)."""
        async with self._http.stream(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        ) as response:
            async for chunk in self._http.iter_bytes(response, chunk_size):
                yield chunk

    async def list(self, path: str) -> builtins.list[dict[str, Any]]:
        answer = await self._http.json("GET", f"{self._base}/list", params={"path": path})
        return [dict(entry) for entry in answer.get("entries", [])]

    async def stat(self, path: str) -> dict[str, Any]:
        return dict(await self._http.json("GET", f"{self._base}/stat", params={"path": path}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        await self._http.json("POST", f"{self._base}/mkdir", json_body={"path": path, "parents": parents})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._http.json("DELETE", self._base, params={"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str) -> None:
        await self._http.json("POST", f"{self._base}/rename", json_body={"src": src, "dst": dst})

    async def watch(self, path: str, *, recursive: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Change events as they happen: {"type": "watching", ...} once the watch is set up, then
        {"type": "changes", "changes": [{"path", "kind"}, ...]}. Stop by closing or leaving the loop."""
        async with self._http.stream(
            "GET",
            f"{self._base}/watch",
            params={"path": path, "recursive": recursive},
            timeout=self._http.timeout(None),
        ) as response:
            async for event in self._http.iter_ndjson(response):
                yield event
