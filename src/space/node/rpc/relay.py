"""The gateway's relay over RPC: a public request passed through to the node without holding it in memory.

Invariants:
- The request body is streamed from an async iterable and the response body handed back as an iterator of
  raw chunks; whoever takes the ProxiedResponse closes it (`body()` does at its end, else `aclose()`).
- The node path is built from the sandbox id and fixed or validated segments, each quoted as ONE segment,
  and the request carries a capability for that sandbox only.
- With `raise_errors`, an error answer (small) is read and raised as its typed error, never relayed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from space.node.rpc.transport import (
    STREAM_TIMEOUT,
    Body,
    NodeTransport,
    query_params,
    raise_for_error,
    sandbox_path,
    translated,
)


@dataclass
class ProxiedResponse:
    """An open node response for the gateway to relay: iterate `body()` (which closes it at the end) or
    call `aclose()`; e.g. `StreamingResponse(p.body(), p.status_code, media_type=p.media_type)`."""

    response: httpx.Response

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    @property
    def media_type(self) -> str | None:
        value: str | None = self.response.headers.get("content-type")
        return value

    async def body(self) -> AsyncIterator[bytes]:
        try:
            with translated("relay"):
                async for chunk in self.response.aiter_raw():
                    yield chunk
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        await self.response.aclose()


class RelayCalls(NodeTransport):
    async def proxy_stream(
        self,
        method: str,
        sandbox_id: str,
        *segments: str,
        params: Mapping[str, Any] | None = None,
        content: Body | None = None,
        headers: Mapping[str, str] | None = None,
        raise_errors: bool = True,
    ) -> ProxiedResponse:
        """Send `method /sandboxes/<sandbox_id>/<segments...>` (under /node/v1; each segment quoted as one, so
        pass fixed route words and validated ids only) with `content` streamed from an async iterable (e.g.
        a Starlette `request.stream()`), carrying a capability for `sandbox_id`; return the open response
        for relaying. With `raise_errors`, an error answer is read (it is small) and raised as its typed
        error."""
        path = sandbox_path(sandbox_id, *segments)
        request = self._http.build_request(
            method, path, params=query_params(params), content=content,
            headers=self._headers(headers, sandbox_id), timeout=STREAM_TIMEOUT,
        )  # fmt: skip
        with translated(f"{method} {path}"):
            response = await self._http.send(request, stream=True)
            if raise_errors and response.status_code >= 400:
                try:
                    await raise_for_error(response)
                finally:
                    await response.aclose()
        return ProxiedResponse(response)
