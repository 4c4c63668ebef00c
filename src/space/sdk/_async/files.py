"""A sandbox's files: read, write (streamed from files and iterators), list (by depth), stat, mkdir, rename,
watch, user.* extended attributes.

Invariants:
- Uploads from a file object or an iterator are streamed chunk by chunk (never joined in memory, so never
  retried); in-memory data is sent as bytes (so a failed send may be retried).
- Downloads via read_stream and events via watch are yielded as they arrive. Only `read` returns a whole
  file in memory.
"""

from __future__ import annotations

import base64
import builtins
from collections.abc import AsyncIterator, Iterable
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


class FileListing(builtins.list[dict[str, Any]]):
    """A listing's entries (a list), with `truncated`: whether the entry limit cut it short."""

    def __init__(self, entries: Iterable[dict[str, Any]] = (), *, truncated: bool = False) -> None:
        super().__init__(entries)
        self.truncated = truncated


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandboxRef) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/files"

    async def write(
        self,
        path: str,
        data: AsyncUploadable,
        *,
        mode: int | None = None,
        chunk_size: int = CHUNK,
        user: str | None = None,
    ) -> int:
        """Write a file from bytes/str, a binary file object or an iterator of bytes (streamed); returns
        the size written. A file or directory the write creates belongs to `user` (a name or uid in the
        sandbox), else to the template's default user."""
        answer = await self._http.json(
            "PUT",
            self._base,
            params={"path": path, "mode": mode, "user": user},
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

    async def list(
        self, path: str, *, depth: int = 1, limit: int | None = None, xattrs: bool = False
    ) -> FileListing:
        """Entries below `path` up to `depth` levels (1-16; pre-order, each directory's children by name,
        never through a symlink), at most `limit` (default and most 50 000): `.truncated` says whether the
        limit cut the listing. With `xattrs`, each entry has its user.* attributes (base64 values)."""
        params: dict[str, Any] = {"path": path, "depth": depth, "xattrs": xattrs}
        if limit is not None:
            params["limit"] = limit
        answer = await self._http.json("GET", f"{self._base}/list", params=params)
        entries = [dict(entry) for entry in answer.get("entries", [])]
        return FileListing(entries, truncated=bool(answer.get("truncated", False)))

    async def stat(self, path: str, *, follow: bool = False, xattrs: bool = False) -> dict[str, Any]:
        """The path itself (a symlink is type "symlink" with its `symlink_target`); with `follow`, what a
        symlink leads to (`broken` when it cannot be followed)."""
        params = {"path": path, "follow": follow, "xattrs": xattrs}
        return dict(await self._http.json("GET", f"{self._base}/stat", params=params))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(
        self, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None
    ) -> bool:
        """True when the directory was made, False when it was already there (with `parents`); what it
        makes belongs to `user`, else to the template's default user."""
        body: dict[str, Any] = {"path": path, "parents": parents, "mode": mode}
        if user is not None:
            body["user"] = user
        answer = await self._http.json("POST", f"{self._base}/mkdir", json_body=body)
        return bool(answer.get("created", True)) if isinstance(answer, dict) else True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._http.json("DELETE", self._base, params={"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str, *, parents: bool = False) -> dict[str, Any]:
        """Move `src` to `dst` (with `parents`, making dst's missing directories); the destination's entry."""
        body = {"src": src, "dst": dst, "parents": parents}
        answer = await self._http.json("POST", f"{self._base}/rename", json_body=body)
        return dict(answer.get("entry") or {}) if isinstance(answer, dict) else {}

    async def xattrs(self, path: str) -> dict[str, bytes]:
        """The user.* extended attributes of `path`: name -> value."""
        answer = await self._http.json("GET", f"{self._base}/xattrs", params={"path": path})
        return {name: base64.b64decode(value) for name, value in answer.get("xattrs", {}).items()}

    async def get_xattr(self, path: str, attribute: str) -> bytes:
        """One user.* attribute's value (NotFound when the path has none of that name)."""
        params = {"path": path, "attribute": attribute}
        answer = await self._http.json("GET", f"{self._base}/xattrs/value", params=params)
        return base64.b64decode(answer["value_b64"])

    async def set_xattr(self, path: str, attribute: str, value: bytes | str) -> None:
        """Set a user.* attribute (name at most 255 bytes, value at most 64 KiB)."""
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        body = {"path": path, "attribute": attribute, "value_b64": base64.b64encode(raw).decode()}
        await self._http.json("PUT", f"{self._base}/xattrs", json_body=body)

    async def remove_xattr(self, path: str, attribute: str) -> None:
        params = {"path": path, "attribute": attribute}
        await self._http.json("DELETE", f"{self._base}/xattrs", params=params)

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
