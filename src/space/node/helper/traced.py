"""The helper's side of tracing (ADR 0072): a request may carry the agent's trace context, `"trace"`, a W3C
traceparent value; the verb then runs in a span of that trace (with the runsc and btrfs spans under it) and
the answer brings those spans back in `"spans"`, so the agent keeps them with the rest of the trace.

Invariants:
- `"trace"` is optional and never an error: a value that is not a valid traceparent (wrong type, malformed,
  all-zero, longer than tracing.MAX_TRACEPARENT) is dropped and the verb runs untraced.
- The span is named after the verb only when it is in the verb table; it carries no argument values.
- An answer carries at most MAX_SPANS span records, all of this request's trace and under its verb's span.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from space.core import tracing
from space.node.helper.verbs import VERBS

LAYER = tracing.Layer("space.node.helper")
MAX_SPANS = 64
TRACE_FIELD = "trace"

Dispatch = Callable[[Any, Any, Any], dict[str, Any]]


def traced_dispatch(dispatch: Dispatch, ctx: Any, request: Any, send_progress: Any) -> dict[str, Any]:
    """`dispatch(ctx, request, send_progress)` inside the request's trace, its spans added to the answer."""
    value = request.pop(TRACE_FIELD, None) if isinstance(request, dict) else None
    parent = tracing.context_of(value) if isinstance(value, str) and tracing.enabled() else None
    if parent is None:
        return dispatch(ctx, request, send_progress)
    name = request.get("verb")
    verb = name if isinstance(name, str) and name in VERBS else "unknown"
    with tracing.attached(value), LAYER.span(f"helper.{verb}", verb=verb) as span:
        answer = dispatch(ctx, request, send_progress)
        if not answer.get("ok"):
            tracing.mark_error(span)
    if span is not None:
        ctx_ids = span.get_span_context()
        records = tracing.RING.trace(f"{ctx_ids.trace_id:032x}")
        answer["spans"] = tracing.descendants(records, f"{ctx_ids.span_id:016x}")[:MAX_SPANS]
    return answer
