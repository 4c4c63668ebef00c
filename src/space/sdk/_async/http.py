"""The HTTP layer of a client: one httpx client, requests sent with the retries of RequestPolicy.

Invariants (the decisions themselves are space.sdk._policy's):
- `send` returns only answers with status < 400; any other answer is read, closed and raised as a typed
  SpaceError (after the retries the policy allows).
- A streamed upload body is passed to httpx as an iterator and sent chunk by chunk, never joined; such a
  body is never sent twice.
- A streamed answer is closed when its `stream` block ends, however it ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import httpx

from space.sdk._backend import AsyncBackend
from space.sdk._policy import Params, RequestPolicy, decode_line, json_answer, query
from space.sdk.errors import error_from_response

AsyncContent = bytes | AsyncIterator[bytes] | None


class AsyncHTTP(RequestPolicy):
    def __init__(
        self, url: str, api_key: str | None, *, transport: httpx.AsyncBaseTransport | None, **kw: Any
    ):
        super().__init__(url, api_key, **kw)
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=self.default_timeout, transport=transport
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def send(
        self,
        method: str,
        path: str,
        *,
        params: Params | None = None,
        json_body: Any = None,
        content: AsyncContent = None,
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        timeout: httpx.Timeout | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send with retries; returns a response with status < 400 (streamed if `stream`: caller closes)."""
        hdrs = {**self.request_headers(method, idempotency_key), **(headers or {})}
        sent_params = query(params)
        replayable = content is None or isinstance(content, bytes)
        attempt = 0
        while True:
            request = self.client.build_request(
                method,
                path,
                params=sent_params,
                json=json_body,
                content=content,
                headers=hdrs,
                timeout=timeout or self.default_timeout,
            )
            try:
                response = await self.client.send(request, stream=stream)
            except httpx.TransportError as exc:
                if not self.retry_transport(method, replayable, attempt):
                    raise self.transport_error(exc, method, path) from exc
                await AsyncBackend.sleep(self.delay(attempt))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            body = await self._read_refusal(response, method, path)
            if not self.retry_status(method, response.status_code, attempt, response, replayable):
                raise error_from_response(response.status_code, body, response.headers)
            await AsyncBackend.sleep(self.delay(attempt, response))
            attempt += 1

    async def _read_refusal(self, response: httpx.Response, method: str, path: str) -> bytes:
        try:
            return await response.aread()
        except httpx.TransportError as exc:
            raise self.transport_error(exc, method, path) from exc
        finally:
            await response.aclose()

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        response = await self.send(method, path, **kw)
        return json_answer(response, method, path)

    @asynccontextmanager
    async def stream(self, method: str, path: str, **kw: Any) -> AsyncIterator[httpx.Response]:
        response = await self.send(method, path, stream=True, **kw)
        try:
            yield response
        finally:
            await response.aclose()

    async def iter_bytes(
        self, response: httpx.Response, chunk_size: int | None = None
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_bytes(chunk_size):
                yield chunk
        except httpx.TransportError as exc:
            raise self.streaming_failure(exc, response) from exc

    async def iter_ndjson(self, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in response.aiter_lines():
                event = decode_line(line)
                if event is not None:
                    yield event
        except httpx.TransportError as exc:
            raise self.streaming_failure(exc, response) from exc


class AsyncSandboxRef(Protocol):
    """What a sandbox's parts (files, processes, snapshots) need from it: the HTTP layer and its path."""

    _http: AsyncHTTP

    @property
    def path(self) -> str: ...
