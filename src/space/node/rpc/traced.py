"""The node RPC client's transport, traced (ADR 0072): one span per call to a node agent, and the W3C
`traceparent` of that span on the request, so the node's spans join the caller's trace.

Invariants:
- The span is named after the call's method and route shape (`/sandboxes/{id}/exec`: at most three path
  segments, the sandbox id replaced, the second segment kept only when it is a route word), never a file
  path or a query; it carries the sandbox id.
- A caller's own `traceparent` header is replaced, never forwarded as it came.
- The span ends when the answer's headers arrive: a stream's body is timed by the node's own span.
"""

from __future__ import annotations

import re

import httpx

from space.core import errors, tracing
from space.core.ids import parse_sandbox_id

LAYER = tracing.Layer("space.controlplane")
_PREFIX = "/node/v1"
_ROUTE_WORD = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def route_shape(path: str) -> tuple[str, str | None]:
    """(`/sandboxes/{id}/exec`, the sandbox id) of a node path."""
    if path.startswith(_PREFIX):
        path = path[len(_PREFIX) :]
    segments = [s for s in path.split("/") if s][:3]
    sandbox_id = None
    if len(segments) >= 2 and segments[0] == "sandboxes":
        try:
            sandbox_id = parse_sandbox_id(segments[1])
            segments[1] = "{id}"
        except errors.InvalidArgument:  # a fixed route word (`/sandboxes/restore`) stays, nothing else
            if not _ROUTE_WORD.fullmatch(segments[1]):
                segments[1] = "{?}"
    return "/" + "/".join(segments), sandbox_id


class TracedTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if tracing.traceparent() is None:  # off, or outside any trace (background polls): no span
            request.headers.pop(tracing.TRACEPARENT, None)
            return await self.inner.handle_async_request(request)
        shape, sandbox_id = route_shape(request.url.path)
        with LAYER.span(f"node.rpc {request.method} {shape}", sandbox_id=sandbox_id) as span:
            request.headers.pop(tracing.TRACEPARENT, None)
            value = tracing.traceparent()
            if value is not None:
                request.headers[tracing.TRACEPARENT] = value
            response = await self.inner.handle_async_request(request)
            tracing.set_attributes(span, status=response.status_code)
            return response

    async def aclose(self) -> None:
        await self.inner.aclose()
