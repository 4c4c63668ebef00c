"""A sandbox's metrics history: `GET /v1/sandboxes/{id}/metrics?start=&end=&limit=`, relayed from the
node that holds the sandbox (space.node.agent.metrics, docs/adr/0053-sandbox-metrics-history.md).

Invariants:
- A read-only key suffices. A key sees only its project's sandboxes: another project's sandbox answers
  exactly like a missing one (404), before any node is asked.
- The window and `limit` are validated here, before anything is read (400 for a window that is not one,
  422 for a value that is not a number or out of range).
- Reading metrics is passive: it neither resumes a paused or suspended sandbox nor counts as activity.
- A sandbox on no node (suspended, pending) or that its node no longer holds answers an empty history
  (`interval_s` null): what was kept went with the copy it described.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from space.controlplane.api.deps import Auth, Svc, find_sandbox
from space.core import errors
from space.node.agent.metrics_models import MAX_SAMPLES, MetricsAnswer, check_window

router = APIRouter()

Seconds = Annotated[float | None, Query(allow_inf_nan=False, description="Unix time, seconds")]
Limit = Annotated[int, Query(ge=1, le=MAX_SAMPLES)]


@router.get("/sandboxes/{sandbox_id}/metrics", response_model=MetricsAnswer)
async def sandbox_metrics(
    sandbox_id: str, who: Auth, services: Svc, *, start: Seconds = None, end: Seconds = None,
    limit: Limit = MAX_SAMPLES,
) -> MetricsAnswer:  # fmt: skip
    """CPU, memory and disk samples (every few seconds, the last hour by default) with start <= timestamp
    <= end, oldest first: the newest `limit` of them (`truncated` when the window held more)."""
    who.require("read-only")
    check_window(start, end)
    sb = await find_sandbox(services, who, sandbox_id)
    empty = MetricsAnswer(sandbox_id=sb.id, interval_s=None, samples=[], truncated=False)
    if sb.node_id is None:
        return empty
    node = services.nodes.client(sb.node_id)
    try:
        return await node.metrics(sb.id, start=start, end=end, limit=limit)
    except errors.NotFound:
        return empty
