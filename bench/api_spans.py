"""Where each operation's milliseconds go: its median span breakdown (ADR 0072), from the traces the
control plane keeps (`GET /v1/sandboxes/{id}/traces`).

A sample's traces are those of the sandbox whose first span started within the sample's wall-clock window
(the request, the reconciler's moves it caused, the SDK's polls until it settled); its breakdown is, per span
name, the summed duration of those spans in ms. An operation's breakdown is each name's median over the
samples whose traces the control plane still kept (a missing name counts 0 in a sample), the TOP heaviest.

Invariants:
- Spans nest (a request's span contains its node call, which contains the helper's verb): the names are
  a breakdown to read top-down, not parts that add up to the total.
- Reading traces is never part of a timed sample (it happens between samples or after a series), and a
  control plane without the traces route (older, or tracing off) gives no breakdown, never a failure.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from space.sdk import Sandbox

#: Enough for every span name of the longest operation (a create has about 25), so that a layer whose span
#: is short still shows (the printed table keeps its own, shorter width).
TOP = 40
Window = tuple[int, int]


@contextmanager
def window(into: list[Window]) -> Iterator[None]:
    """Record the block's wall-clock window (ns: the clock the spans use) in `into`."""
    start = time.time_ns()
    try:
        yield
    finally:
        into.append((start, time.time_ns()))


def sample_breakdowns(traces: Iterable[dict[str, Any]], windows: Sequence[Window]) -> list[dict[str, float]]:
    """One {span name: summed ms} per window that has at least one trace starting in it."""
    starts = []
    for trace in traces:
        spans = trace.get("spans") or []
        if spans:
            starts.append((min(s["start_ns"] for s in spans), spans))
    samples = []
    for first, last in windows:
        totals: dict[str, float] = defaultdict(float)
        for start, spans in starts:
            if first <= start <= last:
                for span in spans:
                    totals[span["name"]] += (span["end_ns"] - span["start_ns"]) / 1e6
        if totals:
            samples.append(dict(totals))
    return samples


def median_breakdown(samples: Sequence[dict[str, float]], top: int = TOP) -> dict[str, float]:
    """Each span name's median ms over the samples (0 where a sample lacks it), the `top` heaviest first."""
    names = {name for sample in samples for name in sample}
    medians = {name: statistics.median(s.get(name, 0.0) for s in samples) for name in names}
    heaviest = sorted(medians.items(), key=lambda item: -item[1])[:top]
    return {name: round(ms, 2) for name, ms in heaviest if ms > 0}


def traces_of(sb: Sandbox, limit: int = 100) -> list[dict[str, Any]]:
    """The sandbox's newest traces; none when they cannot be read."""
    try:
        return sb.traces(limit=limit)
    except Exception:  # an older control plane, tracing off, a transient failure: no breakdown
        return []


def breakdown(sb: Sandbox, windows: Sequence[Window], limit: int = 100) -> dict[str, float]:
    """The median span breakdown of the samples in `windows` on `sb` ({} when none can be read)."""
    if not windows:
        return {}
    return median_breakdown(sample_breakdowns(traces_of(sb, limit), windows))


def format_breakdown(spans: dict[str, float], width: int = 6) -> str:
    """`name 12.3, name 4.5, ...` of the `width` heaviest (the table's column)."""
    return ", ".join(f"{name} {ms:.1f}" for name, ms in list(spans.items())[:width])
