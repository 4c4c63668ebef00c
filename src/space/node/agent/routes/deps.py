"""What every node RPC route module shares: the service dependency and the common parameter types.

Invariants:
- The routes hold no state: each request gets the app's one NodeService (`app.state.service`, set by
  space.node.agent.app.create_app) through the `Service` dependency.
- These names live at module level in the route modules that use them: FastAPI resolves the (string)
  annotations of a route function in its module's globals.
"""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Header, Query
from starlette.requests import HTTPConnection

from space.node.agent.service import NodeService


async def node_service(connection: HTTPConnection) -> NodeService:
    """The app's NodeService (HTTP and WebSocket routes alike). A coroutine on purpose: FastAPI runs a
    plain `def` dependency in its thread pool, a thread hop on every request (ADR 0044)."""
    return cast(NodeService, connection.app.state.service)


Service = Annotated[NodeService, Depends(node_service)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
PathQuery = Annotated[str, Query(min_length=1)]
