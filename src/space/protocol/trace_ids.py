"""A trace id on the private channel (standard library only; ADR 0072).

A CALL frame may carry, beside "method" and "params", `"trace": "<32 lowercase hex digits>"`: the id of
the node's trace the call belongs to. spaced then answers its RESULT with `"spaced_ns"` added: the
nanoseconds it spent in the call's handler, which the node records as spaced's span of that trace.

Invariants:
- Only the id travels into the sandbox, never a span id, a name or an attribute; spaced records nothing.
- A "trace" that is not a valid id (type, length, digits, all zero) is ignored, never an error, by either
  end; so is a "spaced_ns" that is not a non-negative integer below MAX_SPACED_NS (a hostile guest).
"""

from __future__ import annotations

import re

TRACE_FIELD = "trace"
TIMING_FIELD = "spaced_ns"
MAX_SPACED_NS = 24 * 3600 * 10**9
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def valid_trace_id(value: object) -> bool:
    return isinstance(value, str) and _TRACE_ID.fullmatch(value) is not None and value != "0" * 32


def valid_timing(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_SPACED_NS
