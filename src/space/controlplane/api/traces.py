"""A sandbox's recent operations as traces: `GET /v1/sandboxes/{id}/traces?limit=` (ADR 0072), what
`space trace` draws. The control plane's spans come from this process's ring (space.core.tracing.RING),
the node's (agent, helper, spaced) from the node that holds the sandbox, joined by trace id.

Invariants:
- A read-only key suffices. A key sees only its project's sandboxes: another project's sandbox answers
  exactly like a missing one (404), before any ring or node is read.
- Passive: reading traces neither resumes a sandbox nor counts as activity, and is itself never traced.
- A node that cannot answer leaves its spans out (the control plane's are still answered), never fails
  the request. The rings are per process: a replica answers the operations it served itself.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query

from space.controlplane.api.deps import Auth, Svc, find_sandbox
from space.core import errors, tracing
from space.node.agent.trace_models import MAX_LIMIT, SpanView, TracesAnswer, TraceView

router = APIRouter()
log = logging.getLogger(__name__)


@router.get("/sandboxes/{sandbox_id}/traces", response_model=TracesAnswer)
async def sandbox_traces(
    sandbox_id: str, who: Auth, services: Svc, limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 10
) -> TracesAnswer:
    """The sandbox's newest `limit` operations (API requests, reconciler steps), oldest first: each
    trace's spans from every layer (control plane, node agent, root helper, spaced), by start time."""
    who.require("read-only")
    sb = await find_sandbox(services, who, sandbox_id)
    trace_ids = tracing.RING.traces_of(sb.id)[-limit:]
    spans: dict[str, list[dict[str, Any]]] = {t: tracing.RING.trace(t) for t in trace_ids}
    if sb.node_id is not None and trace_ids:
        try:
            answer = await services.nodes.client(sb.node_id).traces(sb.id, trace_ids)
        except errors.SpaceError as exc:
            log.info("sandbox %s: the node's spans are left out: %s", sb.id, exc)
        else:
            for span in answer.spans:
                if span.trace_id in spans:
                    spans[span.trace_id].append(span.model_dump())
    return TracesAnswer(sandbox_id=sb.id, traces=[_trace(t, spans[t]) for t in trace_ids])


def _trace(trace_id: str, records: list[dict[str, Any]]) -> TraceView:
    unique = {r["span_id"]: r for r in records}  # one process can be both sides (tests, one machine)
    ordered = sorted(unique.values(), key=lambda r: (r["start_ns"], r["end_ns"]))
    return TraceView(trace_id=trace_id, spans=[SpanView.model_validate(r) for r in ordered])
