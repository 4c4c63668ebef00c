"""The HTTP layer under Space and AsyncSpace: auth, retries, idempotency keys, error mapping.

Invariants:
- GETs are retried with exponential back-off (with jitter) on transport errors and 503.
- Every other method carries an `Idempotency-Key` (the caller's, or one generated per logical call and
  reused by its retries), and is retried on transport errors only when its body can be sent again (bytes or
  JSON, never a one-shot stream).
- A 429 with `Retry-After` (a rate or stream limit, refused before anything happened) is retried for any
  method whose body can be sent again, after the time the server named (at most 30 s a wait).
- A streamed upload body is passed to httpx as an iterator and sent chunk by chunk, never joined.
- Nothing above this module sees an httpx exception: status >= 400 becomes a typed SpaceError, a transport
  failure a TransportError (also while iterating a streamed answer).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from space.core.errors import SpaceError
from space.sdk.errors import TransportError, error_from_response
from space.sdk.models import stream_error

__version__ = "0.1.0"

RETRY_STATUSES = frozenset({503})
Params = Mapping[str, str | int | float | bool | None]
SyncContent = bytes | Iterator[bytes] | None
AsyncContent = bytes | AsyncIterator[bytes] | None


class _Base:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        *,
        timeout: float,
        connect_timeout: float,
        max_retries: int,
        retry_backoff: float,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_retries = max(0, max_retries)
        self.retry_backoff = max(0.0, retry_backoff)
        self.connect_timeout = connect_timeout
        self.default_timeout = self.timeout(timeout)
        self.headers: dict[str, str] = {"User-Agent": f"space-sdk-python/{__version__}"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.headers.update(headers or {})

    def timeout(self, read: float | None) -> httpx.Timeout:
        """A timeout whose read/write part is `read` seconds (None: wait as long as the server works)."""
        return httpx.Timeout(read, connect=self.connect_timeout, pool=self.connect_timeout)

    @staticmethod
    def request_headers(method: str, idempotency_key: str | None) -> dict[str, str]:
        if method in {"GET", "HEAD"}:
            return {}
        return {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        if response is not None:
            raw = response.headers.get("retry-after")
            if raw is not None:
                try:
                    return min(30.0, max(0.0, float(raw)))
                except ValueError:
                    pass
        base = min(8.0, self.retry_backoff * (2.0**attempt))
        return base * (0.5 + random.random() / 2)

    def retry_transport(self, method: str, replayable: bool, attempt: int) -> bool:
        return attempt < self.max_retries and (method == "GET" or replayable)

    def retry_status(
        self, method: str, status: int, attempt: int, response: httpx.Response, replayable: bool
    ) -> bool:
        if attempt >= self.max_retries:
            return False
        if status == 429 and "retry-after" in response.headers:
            # Refused by a limit before the request did anything: any method may be sent again, if its
            # body can be (mutations carry an Idempotency-Key anyway). A 429 without Retry-After (a
            # quota, a full disk) does not pass by waiting.
            return replayable
        return method == "GET" and status in RETRY_STATUSES

    def transport_error(self, exc: httpx.HTTPError, method: str, path: str) -> TransportError:
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        reason = str(exc) or type(exc).__name__
        return TransportError(
            f"{method} {self.url}{path} {what}: {reason}", url=self.url, exception=type(exc).__name__
        )


def _decode_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise SpaceError(f"malformed line in a streamed answer: {line[:200]!r}") from exc
    if not isinstance(event, dict):
        raise SpaceError(f"malformed line in a streamed answer: {line[:200]!r}")
    error = stream_error(event)
    if error is not None:
        raise error
    return event


class SyncHTTP(_Base):
    def __init__(self, url: str, api_key: str | None, *, transport: httpx.BaseTransport | None, **kw: Any):
        super().__init__(url, api_key, **kw)
        self.client = httpx.Client(
            base_url=self.url, headers=self.headers, timeout=self.default_timeout, transport=transport
        )

    def close(self) -> None:
        self.client.close()

    def send(
        self,
        method: str,
        path: str,
        *,
        params: Params | None = None,
        json_body: Any = None,
        content: SyncContent = None,
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        timeout: httpx.Timeout | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send with retries; returns a response with status < 400 (streamed if `stream`: caller closes)."""
        hdrs = {**self.request_headers(method, idempotency_key), **(headers or {})}
        replayable = content is None or isinstance(content, bytes)
        query = {k: _param(v) for k, v in (params or {}).items() if v is not None}
        attempt = 0
        while True:
            request = self.client.build_request(
                method,
                path,
                params=query,
                json=json_body,
                content=content,
                headers=hdrs,
                timeout=timeout or self.default_timeout,
            )
            try:
                response = self.client.send(request, stream=stream)
            except httpx.TransportError as exc:
                if self.retry_transport(method, replayable, attempt):
                    time.sleep(self.delay(attempt))
                    attempt += 1
                    continue
                raise self.transport_error(exc, method, path) from exc
            if response.status_code < 400:
                return response
            try:
                body = response.read()
            except httpx.TransportError as exc:
                raise self.transport_error(exc, method, path) from exc
            finally:
                response.close()
            if self.retry_status(method, response.status_code, attempt, response, replayable):
                time.sleep(self.delay(attempt, response))
                attempt += 1
                continue
            raise error_from_response(response.status_code, body, response.headers)

    def json(self, method: str, path: str, **kw: Any) -> Any:
        response = self.send(method, path, **kw)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as exc:
            raise SpaceError(f"{method} {path}: the answer is not JSON") from exc

    @contextmanager
    def stream(self, method: str, path: str, **kw: Any) -> Iterator[httpx.Response]:
        response = self.send(method, path, stream=True, **kw)
        try:
            yield response
        finally:
            response.close()

    def iter_bytes(self, response: httpx.Response, chunk_size: int | None = None) -> Iterator[bytes]:
        try:
            yield from response.iter_bytes(chunk_size)
        except httpx.TransportError as exc:
            raise self.transport_error(exc, response.request.method, response.request.url.path) from exc

    def iter_ndjson(self, response: httpx.Response) -> Iterator[dict[str, Any]]:
        try:
            for line in response.iter_lines():
                event = _decode_line(line)
                if event is not None:
                    yield event
        except httpx.TransportError as exc:
            raise self.transport_error(exc, response.request.method, response.request.url.path) from exc


class AsyncHTTP(_Base):
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
        hdrs = {**self.request_headers(method, idempotency_key), **(headers or {})}
        replayable = content is None or isinstance(content, bytes)
        query = {k: _param(v) for k, v in (params or {}).items() if v is not None}
        attempt = 0
        while True:
            request = self.client.build_request(
                method,
                path,
                params=query,
                json=json_body,
                content=content,
                headers=hdrs,
                timeout=timeout or self.default_timeout,
            )
            try:
                response = await self.client.send(request, stream=stream)
            except httpx.TransportError as exc:
                if self.retry_transport(method, replayable, attempt):
                    await asyncio.sleep(self.delay(attempt))
                    attempt += 1
                    continue
                raise self.transport_error(exc, method, path) from exc
            if response.status_code < 400:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError as exc:
                raise self.transport_error(exc, method, path) from exc
            finally:
                await response.aclose()
            if self.retry_status(method, response.status_code, attempt, response, replayable):
                await asyncio.sleep(self.delay(attempt, response))
                attempt += 1
                continue
            raise error_from_response(response.status_code, body, response.headers)

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        response = await self.send(method, path, **kw)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as exc:
            raise SpaceError(f"{method} {path}: the answer is not JSON") from exc

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
            raise self.transport_error(exc, response.request.method, response.request.url.path) from exc

    async def iter_ndjson(self, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in response.aiter_lines():
                event = _decode_line(line)
                if event is not None:
                    yield event
        except httpx.TransportError as exc:
            raise self.transport_error(exc, response.request.method, response.request.url.path) from exc


def _param(value: str | int | float | bool) -> str | int | float:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value
