"""What every node RPC route module shares: the service dependency and the common parameter types.

Invariants:
- The routes hold no state: each request gets the app's one NodeService (`app.state.service`, set by
  space.node.agent.app.create_app) through the `Service` dependency.
- These names live at module level in the route modules that use them: FastAPI resolves the (string)
  annotations of a route function in its module's globals.
"""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Header, Query, Response
from pydantic import BaseModel
from starlette.requests import HTTPConnection

from space.node.agent.service import NodeService


async def node_service(connection: HTTPConnection) -> NodeService:
    """The app's NodeService (HTTP and WebSocket routes alike). A coroutine on purpose: FastAPI runs a
    plain `def` dependency in its thread pool, a thread hop on every request (ADR 0044)."""
    return cast(NodeService, connection.app.state.service)


def json_answer(model: BaseModel, status_code: int = 200) -> Response:
    """A model as the JSON answer of a hot route, serialised by pydantic in one step: returned as a model,
    FastAPI would walk it with jsonable_encoder (and validate it again against the response model), several
    times the cost on every exec (ADR 0044). The bytes are the same."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


Service = Annotated[NodeService, Depends(node_service)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
PathQuery = Annotated[str, Query(min_length=1)]
