"""The data plane's files over RPC: streamed bodies both ways, listings, metadata, watches, user.* xattrs.

Invariants:
- File bodies are never buffered whole by a stream call: `write_file` sends from bytes or an async iterable,
  `read_file_stream` yields the raw chunks as they arrive (`read_file` is the collected convenience).
- Paths inside the sandbox travel as query or body values, never as part of the node path.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

from space.node.agent import file_models as fm
from space.node.rpc.transport import (
    STREAM_TIMEOUT,
    Body,
    NodeTransport,
    raise_for_error,
    sandbox_path,
    translated,
)


class FileCalls(NodeTransport):
    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: Body,
        *,
        mode: int | None = None,
        append: bool = False,
        user: str | None = None,
    ) -> int:
        """`user`: who a file or directory the write creates belongs to (default: the template's user)."""
        params: dict[str, Any] = {"path": path, "append": append}
        if mode is not None:
            params["mode"] = mode
        if user is not None:
            params["user"] = user
        answer = await self._request(
            "PUT", sandbox_path(sandbox_id, "files"), params=params, content=data,
            headers={"Content-Type": "application/octet-stream"}, timeout=STREAM_TIMEOUT,
            sandbox_id=sandbox_id,
        )  # fmt: skip
        return int(answer["size"])

    async def read_file_stream(
        self, sandbox_id: str, path: str, *, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes]:
        params: dict[str, Any] = {"path": path, "offset": offset}
        if length is not None:
            params["length"] = length
        url = sandbox_path(sandbox_id, "files")
        headers = self._headers(None, sandbox_id)
        with translated(f"GET {url}"):
            async with self._http.stream(
                "GET", url, params=params, timeout=STREAM_TIMEOUT, headers=headers
            ) as response:
                await raise_for_error(response)
                async for chunk in response.aiter_raw():
                    yield chunk

    async def read_file(
        self, sandbox_id: str, path: str, *, offset: int = 0, length: int | None = None
    ) -> bytes:
        buf = bytearray()
        async for chunk in self.read_file_stream(sandbox_id, path, offset=offset, length=length):
            buf.extend(chunk)
        return bytes(buf)

    async def list_files(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        return (await self.list_dir(sandbox_id, path)).entries

    async def list_dir(
        self, sandbox_id: str, path: str, *, depth: int = 1, limit: int | None = None, xattrs: bool = False
    ) -> fm.FileListing:
        """Entries below `path` up to `depth` levels (pre-order, by name); `truncated` when `limit` cut it."""
        params: dict[str, Any] = {"path": path, "depth": depth, "xattrs": xattrs}
        if limit is not None:
            params["limit"] = limit
        answer = await self._request(
            "GET", sandbox_path(sandbox_id, "files", "list"), params=params, sandbox_id=sandbox_id
        )
        return fm.FileListing.model_validate(answer)

    async def stat(
        self, sandbox_id: str, path: str, *, follow: bool = False, xattrs: bool = False
    ) -> dict[str, Any]:
        params = {"path": path, "follow": follow, "xattrs": xattrs}
        answer: dict[str, Any] = await self._request(
            "GET", sandbox_path(sandbox_id, "files", "stat"), params=params, sandbox_id=sandbox_id
        )
        return answer

    async def mkdir(
        self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None
    ) -> fm.MkdirAnswer:
        """`created` is False when the directory was already there (only with `parents`); the directories it
        makes belong to `user` (default: the template's user)."""
        body: dict[str, Any] = {"path": path, "parents": parents, "mode": mode}
        if user is not None:
            body["user"] = user
        path_ = sandbox_path(sandbox_id, "files", "mkdir")
        answer = await self._request("POST", path_, json_body=body, sandbox_id=sandbox_id)
        return fm.MkdirAnswer.model_validate(answer)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": recursive}
        await self._request("DELETE", sandbox_path(sandbox_id, "files"), params=params, sandbox_id=sandbox_id)

    async def rename(self, sandbox_id: str, src: str, dst: str, *, parents: bool = False) -> dict[str, Any]:
        """The destination's entry; with `parents`, its missing parent directories are made."""
        body = {"src": src, "dst": dst, "parents": parents}
        path = sandbox_path(sandbox_id, "files", "rename")
        answer = await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)
        return fm.EntryAnswer.model_validate(answer).entry or {}

    async def xattrs(self, sandbox_id: str, path: str) -> dict[str, bytes]:
        """The user.* extended attributes of `path`: name -> value."""
        url = sandbox_path(sandbox_id, "files", "xattrs")
        answer = await self._request("GET", url, params={"path": path}, sandbox_id=sandbox_id)
        listed = fm.XattrList.model_validate(answer).xattrs
        return {name: base64.b64decode(value) for name, value in listed.items()}

    async def get_xattr(self, sandbox_id: str, path: str, name: str) -> bytes:
        url = sandbox_path(sandbox_id, "files", "xattrs", "value")
        answer = await self._request(
            "GET", url, params={"path": path, "attribute": name}, sandbox_id=sandbox_id
        )
        return base64.b64decode(fm.XattrValue.model_validate(answer).value_b64)

    async def set_xattr(self, sandbox_id: str, path: str, name: str, value: bytes) -> None:
        body = {"path": path, "attribute": name, "value_b64": base64.b64encode(value).decode()}
        url = sandbox_path(sandbox_id, "files", "xattrs")
        await self._request("PUT", url, json_body=body, sandbox_id=sandbox_id)

    async def remove_xattr(self, sandbox_id: str, path: str, name: str) -> None:
        url = sandbox_path(sandbox_id, "files", "xattrs")
        await self._request("DELETE", url, params={"path": path, "attribute": name}, sandbox_id=sandbox_id)

    async def watch(
        self, sandbox_id: str, path: str, *, recursive: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: {"type": "watching"} once the watch is in place, then {"type": "changes"}."""
        params = {"path": path, "recursive": recursive}
        url = sandbox_path(sandbox_id, "files", "watch")
        async for item in self._lines("GET", url, params=params, sandbox_id=sandbox_id):
            yield item
