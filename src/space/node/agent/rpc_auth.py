"""Authentication and authorization of the node RPC: the node token on every request, a sandbox
capability on every sandbox-scoped route.

Invariants:
- Every request (HTTP and WebSocket, known route or not) carries `Authorization: Bearer <node token>`,
  compared in constant time, before any route runs; anything else is a typed 401. The node token is this
  node's own RPC token (space.node.agent.identity; ADR 0021), never the cluster's bootstrap token.
- Every route scoped to a sandbox (its path names `{sandbox_id}`; for POST /sandboxes/restore the body's
  `sandbox_id`) also needs exactly one `X-Space-Capability` for that very sandbox, unexpired, made with the
  node token (space.core.capability); anything else is a typed 403 before the route runs. Only the routes in
  `_NODE_LEVEL_ROUTES` go without one, and a route that is neither is refused (fail closed).
- Every router of the node RPC is made by `resource_router`, so no route exists without the capability
  dependency.
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi import APIRouter, Depends, Request, WebSocket
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from space.core import errors
from space.core.capability import CAPABILITY_HEADER
from space.core.capability import verify as verify_capability
from space.core.ids import parse_sandbox_id
from space.node.agent.rpc_models import API_PREFIX
from space.rest import errors as rest_errors

log = logging.getLogger("space.node.rpc")


class BearerAuth:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would buffer streamed bodies)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("the node token must not be empty")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                supplied = value
        if hmac.compare_digest(supplied, self._expected):
            await self.app(scope, receive, send)
            return
        response = rest_errors.error_response(errors.Unauthenticated("a valid node token is required"))
        if scope["type"] == "http":
            await response(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await WebSocket(scope, receive, send).send_denial_response(response)
        else:
            await WebSocket(scope, receive, send).close(code=4401, reason="unauthenticated")


#: Routes that act on the node as a whole (the token suffices); every other route is scoped to a sandbox.
_NODE_LEVEL_ROUTES = frozenset({
    ("GET", f"{API_PREFIX}/info"), ("GET", f"{API_PREFIX}/sandboxes"),
    # user templates (space.node.agent.routes.templates, ADR 0054)
    ("GET", f"{API_PREFIX}/templates"), ("POST", f"{API_PREFIX}/templates/{{name}}/build"),
    ("DELETE", f"{API_PREFIX}/templates/{{name}}"),
})  # fmt: skip
#: Routes scoped to the sandbox their JSON body names (no `{sandbox_id}` in the path).
_BODY_SCOPED_ROUTES = frozenset({("POST", f"{API_PREFIX}/sandboxes/restore")})


def capability_scope(method: str, route_path: str) -> str:
    """How a route is authorized beyond the token: "node", "path" ({sandbox_id}) or "body" (the body's
    sandbox_id); anything else is a route nobody classified, which the dependency refuses."""
    if (method, route_path) in _NODE_LEVEL_ROUTES:
        return "node"
    if "{sandbox_id}" in route_path:
        return "path"
    if (method, route_path) in _BODY_SCOPED_ROUTES:
        return "body"
    return "unclassified"


async def require_capability(connection: HTTPConnection) -> None:
    """Router-level dependency: a sandbox-scoped call carries a capability for that sandbox (see the
    module docstring). The key is the node token the app was made with (app.state.rpc_token)."""
    route = connection.scope.get("route")
    route_path = str(getattr(route, "path", ""))
    method = connection.scope.get("method", "GET") if connection.scope["type"] == "http" else "GET"
    scope = capability_scope(method, route_path)
    if scope == "node":
        return
    if scope == "path":
        sandbox_id = connection.path_params.get("sandbox_id")
    elif scope == "body" and isinstance(connection, Request):
        try:
            body = await connection.json()
        except ValueError as exc:
            raise errors.InvalidArgument("the body is not JSON") from exc
        sandbox_id = body.get("sandbox_id") if isinstance(body, dict) else None
    else:
        log.error("route %s %s is not classified for capabilities: refused", method, route_path)
        raise errors.PermissionDenied("this route is not open to sandbox-scoped calls")
    if not isinstance(sandbox_id, str):
        raise errors.PermissionDenied("this call names no sandbox")
    parse_sandbox_id(sandbox_id)  # a malformed id names no sandbox: 400, as the routes would answer
    supplied = connection.headers.getlist(CAPABILITY_HEADER)
    if len(supplied) > 1:
        raise errors.PermissionDenied(f"more than one {CAPABILITY_HEADER}")
    verify_capability(
        connection.app.state.rpc_token, supplied[0] if supplied else None, sandbox_id=sandbox_id,
        now=time.time(),
    )  # fmt: skip


def resource_router() -> APIRouter:
    """A router of node RPC routes: under API_PREFIX, each route behind `require_capability`."""
    return APIRouter(prefix=API_PREFIX, dependencies=[Depends(require_capability)])
