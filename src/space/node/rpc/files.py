"""The data plane's files over RPC: streamed bodies both ways, listings, metadata, watches.

Invariants:
- File bodies are never buffered whole by a stream call: `write_file` sends from bytes or an async iterable,
  `read_file_stream` yields the raw chunks as they arrive (`read_file` is the collected convenience).
- Paths inside the sandbox travel as query or body values, never as part of the node path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from space.node.agent import rpc_models as rm
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
        self, sandbox_id: str, path: str, data: Body, *, mode: int | None = None, append: bool = False
    ) -> int:
        params: dict[str, Any] = {"path": path, "append": append}
        if mode is not None:
            params["mode"] = mode
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
        answer = await self._request(
            "GET", sandbox_path(sandbox_id, "files", "list"), params={"path": path}, sandbox_id=sandbox_id
        )
        return rm.FileList.model_validate(answer).entries

    async def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        answer: dict[str, Any] = await self._request(
            "GET", sandbox_path(sandbox_id, "files", "stat"), params={"path": path}, sandbox_id=sandbox_id
        )
        return answer

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        body = {"path": path, "parents": parents, "mode": mode}
        path_ = sandbox_path(sandbox_id, "files", "mkdir")
        await self._request("POST", path_, json_body=body, sandbox_id=sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": recursive}
        await self._request("DELETE", sandbox_path(sandbox_id, "files"), params=params, sandbox_id=sandbox_id)

    async def rename(self, sandbox_id: str, src: str, dst: str) -> None:
        body = {"src": src, "dst": dst}
        path = sandbox_path(sandbox_id, "files", "rename")
        await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)

    async def watch(
        self, sandbox_id: str, path: str, *, recursive: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: {"type": "watching"} once the watch is in place, then {"type": "changes"}."""
        params = {"path": path, "recursive": recursive}
        url = sandbox_path(sandbox_id, "files", "watch")
        async for item in self._lines("GET", url, params=params, sandbox_id=sandbox_id):
            yield item
