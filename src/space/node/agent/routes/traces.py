"""The spans this node recorded for some traces of one sandbox: `GET /node/v1/sandboxes/{id}/traces?
trace_id=...` (ADR 0072), asked by the control plane's `GET /v1/sandboxes/{id}/traces`.

Invariants:
- Behind the node token and a capability for this sandbox (resource_router), like every node route.
- Only traces with a span of this node about this sandbox are answered: a capability for one sandbox
  reads nothing of another's, whatever trace ids it names. Reading is passive (no resume, no activity)
  and is itself never traced.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query

from space.core import tracing
from space.node.agent.rpc_auth import resource_router
from space.node.agent.trace_models import MAX_TRACE_IDS, NodeTracesAnswer, SpanView, TraceId

router = resource_router()


@router.get("/sandboxes/{sandbox_id}/traces", response_model=NodeTracesAnswer)
async def sandbox_traces(
    sandbox_id: str, trace_id: Annotated[list[TraceId], Query(max_length=MAX_TRACE_IDS)]
) -> NodeTracesAnswer:
    spans: list[dict[str, Any]] = []
    for one in dict.fromkeys(trace_id):
        records = tracing.RING.trace(one)
        if any(r["attributes"].get("sandbox_id") == sandbox_id for r in records):
            spans.extend(records)
    return NodeTracesAnswer(spans=[SpanView.model_validate(r) for r in spans])
