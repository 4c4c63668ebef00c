"""The transport under NodeClient: one authenticated HTTP client of a node agent; how its answers are read.

Invariants:
- Every failure is a space.core error: an error answer is rebuilt with `errors.error_from_dict` (same code,
  message, details; e.g. InvalidState keeps `.state`), a node that cannot be reached is Unavailable, a
  request that runs out of time is Timeout, a stream that breaks off is Unavailable. Nothing else escapes.
- Every node path is built by `sandbox_path` from the sandbox id and fixed or validated segments, each
  quoted as ONE segment: no '/', '?', '%' or dot segment can change which route or sandbox the node sees.
- A call scoped to a sandbox carries a capability for that sandbox (space.core.capability, keyed by this
  client's node token), minted from the `sandbox_id` the caller passes explicitly, never from a path; a
  capability header the caller passes is dropped, never forwarded.
- NDJSON answers are read line by line, never whole; an error line raises the typed error it carries.
- A call made while serving an API request carries that request's id (`X-Request-Id`, a validated token:
  space.core.request_ids), so the node's log lines name it (ADR 0071).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from typing import Any, Self
from urllib.parse import quote

import httpx

from space.core import errors, request_ids
from space.core.capability import CAPABILITY_HEADER, mint
from space.core.ids import parse_sandbox_id
from space.node.rpc.traced import TracedTransport

API_PREFIX = "/node/v1"
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
# Streams (exec, attach, watch, file bodies) may legitimately stay quiet or last for hours.
STREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)

Body = bytes | AsyncIterable[bytes]


def _seg(value: str) -> str:
    """One path segment: ids are validated by the node, but nothing here may add a '/' or a '?'."""
    return quote(value, safe="")


def sandbox_path(sandbox_id: str, *segments: str) -> str:
    """`/sandboxes/<id>/<segment>...`, every piece quoted as one segment (no '/', '?', '%' or dot segment
    can change which route or sandbox the node sees)."""
    pieces = [parse_sandbox_id(sandbox_id), *segments]
    if any(piece in {"", ".", ".."} for piece in pieces):
        raise errors.InvalidArgument("a node path segment may not be empty, '.' or '..'", field="path")
    return "/sandboxes/" + "/".join(_seg(piece) for piece in pieces)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """httpx's timeouts and transport failures as space.core's Timeout and Unavailable."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise errors.Timeout(f"node RPC {what} timed out: {exc}") from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise errors.Unavailable(f"node RPC {what} failed: {exc!r}") from exc


def error_from_response(status: int, body: bytes) -> errors.SpaceError:
    """The typed error of a node's error answer (or a best guess when the body is not ours)."""
    try:
        payload = json.loads(body)
        error = payload["error"]
        if isinstance(error, dict) and "code" in error:
            return errors.error_from_dict(error)
    except (ValueError, KeyError, TypeError):
        pass
    text = body[:300].decode("utf-8", "replace")
    if status in {502, 503, 504}:
        return errors.Unavailable(f"node answered {status}: {text}")
    return errors.Internal(f"node answered {status} without an error body: {text}")


async def raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_from_response(response.status_code, await response.aread())


def query_params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Query values as the server parses them (booleans as true/false, not Python's True/False)."""
    if params is None:
        return None
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v is not None}


def idempotency_header(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key} if key is not None else {}


async def _with_request_id(request: httpx.Request) -> None:
    """Every call made while serving an API request carries its id (ADR 0071): the node logs under it."""
    request.headers.update(request_ids.outgoing_headers())


class NodeTransport:
    """The HTTP client of one node agent's RPC (under API_PREFIX, with the node's bearer token)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._http = httpx.AsyncClient(
            base_url=self.base_url + API_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            # One span per node call, its traceparent on the request (ADR 0072).
            transport=TracedTransport(transport or httpx.AsyncHTTPTransport()),
            event_hooks={"request": [_with_request_id]},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        content: Body | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        sandbox_id: str | None = None,
    ) -> Any:
        with translated(f"{method} {path}"):
            kwargs: dict[str, Any] = {
                "params": query_params(params),
                "headers": self._headers(headers, sandbox_id),
            }
            if json_body is not None:
                kwargs["json"] = json_body
            if content is not None:
                kwargs["content"] = content
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = await self._http.request(method, path, **kwargs)
            await raise_for_error(response)
            if response.status_code == 204 or not response.content:
                return {}
            return response.json()

    async def _lines(
        self,
        method: str,
        path: str,
        *,
        sandbox_id: str,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        with translated(f"{method} {path}"):
            async with self._http.stream(
                method, path, params=query_params(params), json=json_body, timeout=STREAM_TIMEOUT,
                headers=self._headers(None, sandbox_id),
            ) as response:  # fmt: skip
                await raise_for_error(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if item.get("type") == "error" and isinstance(item.get("error"), dict):
                        raise errors.error_from_dict(item["error"])
                    yield item

    def capability(self, sandbox_id: str) -> dict[str, str]:
        """The header that lets one call act on `sandbox_id` (and on no other sandbox) on this node."""
        return {CAPABILITY_HEADER: mint(self._token, sandbox_id, now=time.time())}

    def _headers(self, headers: Mapping[str, str] | None, sandbox_id: str | None) -> dict[str, str]:
        merged = {k: v for k, v in (headers or {}).items() if k.lower() != CAPABILITY_HEADER.lower()}
        if sandbox_id is not None:
            merged.update(self.capability(sandbox_id))
        return merged
