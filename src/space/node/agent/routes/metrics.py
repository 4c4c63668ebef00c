"""A sandbox's metrics history on its node: `GET /node/v1/sandboxes/{id}/metrics?start=&end=&limit=`
(space.node.agent.metrics, docs/adr/0053-sandbox-metrics-history.md).

Invariants:
- Read-only and passive: the route neither resumes a paused sandbox nor counts as activity, so reading
  metrics never keeps a sandbox from being paused when idle.
- It answers what this node kept for the sandbox (an empty list when nothing yet), NotFound for a sandbox
  the node does not hold; the window and `limit` are validated before the history is read.
"""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Query, Request

from space.node.agent.metrics import MetricsSampler
from space.node.agent.metrics_models import MAX_SAMPLES, MetricsAnswer, check_window
from space.node.agent.routes.deps import Service
from space.node.agent.rpc_auth import resource_router

router = resource_router()

Seconds = Annotated[float | None, Query(allow_inf_nan=False)]
Limit = Annotated[int, Query(ge=1, le=MAX_SAMPLES)]


@router.get("/sandboxes/{sandbox_id}/metrics", response_model=MetricsAnswer)
async def sandbox_metrics(
    svc: Service, request: Request, sandbox_id: str, *, start: Seconds = None, end: Seconds = None,
    limit: Limit = MAX_SAMPLES,
) -> MetricsAnswer:  # fmt: skip
    """The newest `limit` samples with start <= timestamp <= end (Unix seconds), oldest first."""
    check_window(start, end)
    svc.agent.get(sandbox_id)  # NotFound for a sandbox this node does not hold
    sampler = cast(MetricsSampler, request.app.state.metrics)
    return sampler.answer(sandbox_id, start, end, limit)
