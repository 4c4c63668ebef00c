"""The control plane's MCP endpoint: `/mcp`, streamable HTTP (stateless, JSON answers), serving the tools
of space.mcp.tools to agents that hold a SPACE API key. docs/adr/0049-mcp-server.md.

Invariants:
- A request is authenticated from its headers (`Authorization: Bearer <key>`, `X-Space-Project` for an
  org key) before MCP reads a byte of it: no key, an unknown or revoked key is a 401 with the API's
  error body, like /v1. Its body is bounded like any JSON route's (the limits middleware, and the MCP
  SDK's own bound set to the same size); its rate per key is /v1's, in the same bucket (the limits
  middleware counts /mcp as a public path: 429 with Retry-After), so a key has one rate across both.
- The tools act through an SDK client whose transport is this same API app, in process, carrying the
  caller's own Authorization and X-Space-Project headers: every tool call is a /v1 request of the
  caller's key, with its role, its project, its rate and stream limits. Nothing here reads the store or
  calls a node for a tool; there is no privileged shortcut.
- Stateless: each POST is one JSON-RPC exchange; no MCP session outlives its request, so any replica
  answers any request and nothing accumulates per client.
- The MCP SDK is imported, and its session manager built and run, on the first authenticated /mcp request
  (importing it costs ~0.8 s, which no control plane start pays), in one task of its own that enters and
  leaves the manager's run() (anyio requires the same task for both); the app's lifespan stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from space.controlplane.api.deps import Services, authenticate
from space.controlplane.api.limits import MCP_PATH
from space.core import errors
from space.rest import errors as rest_errors

if TYPE_CHECKING:
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

__all__ = ["MCP_PATH", "McpEndpoint"]


class McpEndpoint:
    """The ASGI endpoint at MCP_PATH; `running()` belongs in the app's lifespan (it runs the MCP SDK's
    session manager, which answers 500 without it)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.app: ASGIApp | None = None
        self._manager: StreamableHTTPSessionManager | None = None
        self._manager_task: asyncio.Task[None] | None = None
        self._manager_ready = asyncio.Event()
        self._stop = asyncio.Event()

    def _build_manager(self) -> StreamableHTTPSessionManager:
        from mcp.server.transport_security import TransportSecuritySettings

        from space.mcp.in_process import caller_clients
        from space.mcp.tools import build_server

        server = build_server(caller_clients(self._app))
        # The SDK's protection against DNS rebinding checks Host and Origin for browsers' sake; a browser
        # cannot send the bearer key this endpoint requires without the key's owner, so it is off (and
        # would refuse every host name but localhost).
        server.streamable_http_app(
            stateless_http=True,
            json_response=True,
            max_request_body_size=self.services.settings.api_json_body_bytes,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        return server.session_manager

    async def _run_manager(self) -> None:
        try:
            manager = self._build_manager()
            async with manager.run():
                self._manager = manager
                self._manager_ready.set()
                await self._stop.wait()
        finally:
            self._manager = None
            self._manager_ready.set()  # waiters see no manager: the endpoint is down

    async def _started_manager(self) -> StreamableHTTPSessionManager:
        if self._manager_task is None:
            self._manager_task = asyncio.create_task(self._run_manager(), name="mcp-session-manager")
        await self._manager_ready.wait()
        if self._manager is None:
            raise errors.Unavailable("the MCP endpoint is not running")
        return self._manager

    def mount(self, app: FastAPI) -> None:
        """Serve at MCP_PATH of `app`; the tools' requests go through `app` whole (middleware included)."""
        self.app = app
        # A plain route (not in /openapi.json: MCP is JSON-RPC, described by tools/list) to an ASGI app.
        app.router.routes.append(
            Route(MCP_PATH, endpoint=self, methods=["GET", "POST", "DELETE"], include_in_schema=False)
        )

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The mounted app (the tools' transport), known once mount() ran."""
        if self.app is None:
            raise errors.Unavailable("the MCP endpoint is not mounted")
        await self.app(scope, receive, send)

    def running(self) -> AbstractAsyncContextManager[None]:
        """For the app's lifespan: stops the session manager (if a request started it) at shutdown."""
        return self._running()

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            self._stop.set()
            if self._manager_task is not None:
                await asyncio.gather(self._manager_task, return_exceptions=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        try:
            # The limits middleware has authenticated the key and taken its token; this keeps an app
            # mounted without that middleware from serving an unauthenticated request.
            await authenticate(self.services, headers.get("authorization"), headers.get("x-space-project"))
            manager = await self._started_manager()
        except errors.SpaceError as exc:
            # The body is never read: the connection closes after the refusal.
            response = rest_errors.error_response(exc, {"Connection": "close"})
            await response(scope, receive, send)
            return
        await manager.handle_request(scope, receive, send)


def _headers(scope: Scope) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, value in scope.get("headers", []):
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return found
