"""One span per request of an HTTP surface (the control plane's API, the node agent's RPC): ADR 0072.

A pure ASGI middleware (no BaseHTTPMiddleware: ADR 0044). The span continues the caller's trace when the
request carries a valid W3C `traceparent` (space.core.tracing.context_of; a malformed or huge one starts a
new trace, it is never an error), is named after the matched route's template (never the raw path, which
may carry file names), carries the sandbox id of the route's path and the answer's status, and lasts until
the answer's body is sent (a streamed exec is one span from request to exit code).

Invariants:
- With `roots` off (the node agent), only a request that carries a trace makes a span: the control plane's
  background polls (no trace) leave no trace behind.
- Requests under one of `skip` (health, metrics, node heartbeats, the traces routes themselves) make no
  span: reading traces never adds to them, and heartbeats never push operations out of the ring.
- Nothing of the request but its method, route template, sandbox id and status reaches the span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.core import tracing


class TraceRequests:
    def __init__(
        self,
        app: ASGIApp,
        *,
        layer: str,
        roots: bool = True,
        skip: Sequence[str] = (),
        skip_suffix: str = "/traces",
    ) -> None:
        self.app = app
        self.layer = tracing.Layer(layer)
        self.roots = roots
        self.skip = tuple(skip)
        self.skip_suffix = skip_suffix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] not in ("http", "websocket")
            or not tracing.enabled()
            or path.startswith(self.skip)
            or path.endswith(self.skip_suffix)
        ):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "WS")
        status: list[int] = []

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        attached = tracing.attached(_traceparent(scope))
        with attached, self.layer.span(f"{method} request", root=self.roots) as span:
            try:
                await self.app(scope, receive, traced_send)
            finally:
                if span is not None:
                    _describe(span, scope, method, status)


def _describe(span: Any, scope: Scope, method: str, status: list[int]) -> None:
    """Name the span after the route the router matched (known only now) and tag it."""
    route = _route_template(scope)
    span.update_name(f"{method} {route}")
    params = scope.get("path_params") or {}
    sandbox_id = params.get("sandbox_id")
    tracing.set_attributes(span, route=route, status=status[0] if status else 0, sandbox_id=sandbox_id)


def _route_template(scope: Scope) -> str:
    """The matched route's template with the prefix its router was included under (`/v1`): FastAPI's
    scope names the router's own path only. The prefix is the request's leading segments, which are the
    include prefixes' fixed words; a template with a `:path` convertor is answered without it."""
    template = getattr(scope.get("route"), "path", None)
    if not isinstance(template, str):
        return "unmatched"
    if ":path}" in template:
        return template
    path_segments = str(scope.get("path", "")).split("/")
    extra = len(path_segments) - len(template.split("/"))
    return "/" + "/".join(path_segments[1 : 1 + extra]) + template if extra > 0 else template


def _traceparent(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            # Cut before decoding: an oversized value is refused by context_of anyway.
            return bytes(value[: tracing.MAX_TRACEPARENT + 1]).decode("latin-1")
    return None
