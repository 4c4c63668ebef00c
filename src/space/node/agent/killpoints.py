"""The node agent's kill points: before and after every route of its RPC app (crash injection).

`KillPointMiddleware` is installed by `create_app` only when the process is armed
(space.faults.failpoints.armed(); never in production), inside BearerAuth, so only authenticated requests
reach a kill point. For the route a request matches, it calls `agent.<route name>.before` before the
handler runs and `agent.<route name>.after` when the handler has finished and before the answer's first
byte is sent (the node did the step, the control plane never hears of it). The points are derived from the
routers (`agent_points`), so a new route is a new kill point.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastapi import APIRouter
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.faults import failpoints

PREFIX = "agent"


def _route_names(routes: Iterable[BaseRoute]) -> list[str]:
    return [name for route in routes if (name := getattr(route, "name", None))]


def agent_points(routers: Sequence[APIRouter]) -> list[str]:
    """Both kill points of every route of `routers`."""
    return sorted(failpoints.phased(PREFIX, {n for r in routers for n in _route_names(r.routes)}))


class KillPointMiddleware:
    """Pure ASGI middleware around the routes (see module docstring)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    def _route_name(self, scope: Scope) -> str | None:
        for route in self.routes:
            match, _child = route.matches(scope)
            if match is Match.FULL:
                return getattr(route, "name", None)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = self._route_name(scope) if scope["type"] in ("http", "websocket") else None
        if name is None:
            await self.app(scope, receive, send)
            return
        failpoints.hit(f"{PREFIX}.{name}.before")

        async def send_after_the_step(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                failpoints.hit(f"{PREFIX}.{name}.after")
            await send(message)

        await self.app(scope, receive, send_after_the_step)
