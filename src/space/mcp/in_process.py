"""The tools' client on the control plane: an SDK client of the CALLER's key whose requests the API app
itself answers, in process (httpx's ASGI transport), so that a tool call is an ordinary /v1 request.

Invariants:
- Only the caller's `Authorization` and `X-Space-Project` headers are forwarded; the client has no key
  of its own (its base URL is a name that never resolves, so nothing could leave the process).
- Every request passes the app whole: authentication, roles, the project, rate and stream limits.
- No retries: a refusal (a 429 included) is the tool's error at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from space.core import errors
from space.mcp.tools import ClientSource, ToolContext
from space.sdk import AsyncSpace

__all__ = ["IN_PROCESS_URL", "caller_clients"]

IN_PROCESS_URL = "http://control-plane.invalid"


def caller_clients(app: Any) -> ClientSource:
    """A ClientSource handing each tool call a client of the caller's headers over `app` (an ASGI app)."""

    @asynccontextmanager
    async def client(ctx: ToolContext) -> AsyncIterator[AsyncSpace]:
        headers = ctx.headers or {}
        authorization = headers.get("authorization")
        if not authorization:  # the endpoint authenticates first: a request without one never gets here
            raise errors.Unauthenticated("missing API key (Authorization: Bearer <key>)")
        forwarded = {"Authorization": authorization}
        project = headers.get("x-space-project")
        if project:
            forwarded["X-Space-Project"] = project
        # An exception the app lets out is its 500 answer here too (an `internal` tool error), not a crash
        # of the tool with the exception's text.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with AsyncSpace(IN_PROCESS_URL, headers=forwarded, transport=transport, max_retries=0) as space:
            yield space

    return client
