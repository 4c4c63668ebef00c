"""`space trace SANDBOX_ID [--last] [--limit N] [--json]`: a sandbox's recent operations as waterfalls in
the terminal, from `GET /v1/sandboxes/{id}/traces` (ADR 0072), with no collector.

Each trace is a table: one row per span, indented under its parent, its layer, when it started after the
trace's first span, how long it took and a bar placed on the trace's time line.

Invariants:
- Drawing is a pure function of the answer (`waterfall`): the tests render the same rows.
- A span whose parent is not in the answer (a parent in another replica's ring) is drawn at the top level.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from space.cli._common import client, handles_errors, print_json

BAR_WIDTH = 40
LAYER_STYLES = {
    "space.controlplane": "cyan",
    "space.node": "green",
    "space.node.helper": "magenta",
    "space.guest": "yellow",
}
LAYER_NAMES = {
    "space.controlplane": "control plane",
    "space.node": "node agent",
    "space.node.helper": "helper",
    "space.guest": "spaced",
}


@handles_errors
def trace_command(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox whose operations to draw.")],
    last: Annotated[bool, typer.Option("--last", help="Only the newest operation.")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=100, help="How many operations.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="The traces as JSON.")] = False,
) -> None:
    """Where the milliseconds of a sandbox's recent operations went, layer by layer."""
    traces = client().sandboxes.ref(sandbox_id).traces(limit=1 if last else limit)
    if as_json:
        print_json(traces)
        return
    console = Console()
    if not traces:
        console.print(f"no traces kept for {sandbox_id} (this control plane served none of its operations)")
        return
    for trace in traces:
        console.print(waterfall(trace))


def waterfall(trace: Mapping[str, Any]) -> Table:
    spans: list[Mapping[str, Any]] = list(trace.get("spans", []))
    start = min((s["start_ns"] for s in spans), default=0)
    end = max((s["end_ns"] for s in spans), default=start)
    total = max(end - start, 1)
    root = spans[0]["name"] if spans else "?"
    table = Table(
        title=f"{root}  {total / 1e6:.1f} ms  trace {trace.get('trace_id', '?')}", title_justify="left"
    )
    table.add_column("span")
    table.add_column("layer")
    table.add_column("start ms", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("", no_wrap=True)
    for depth, span in ordered(spans):
        offset, length = span["start_ns"] - start, span["end_ns"] - span["start_ns"]
        layer = str(span.get("layer", ""))
        style = "red" if span.get("error") else LAYER_STYLES.get(layer, "white")
        table.add_row(
            "  " * depth + str(span["name"]),
            LAYER_NAMES.get(layer, layer),
            f"{offset / 1e6:.1f}",
            f"{length / 1e6:.2f}",
            bar(offset, length, total, style),
        )
    return table


def ordered(spans: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(depth, span) depth-first, children by start time; orphans (parent unknown) at the top level."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    for span in sorted(spans, key=lambda s: s["start_ns"]):
        parent = span.get("parent_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    todo = [(0, s) for s in reversed(children.get(None, []))]
    while todo:
        depth, span = todo.pop()
        yield depth, span
        todo.extend((depth + 1, c) for c in reversed(children.get(span["span_id"], [])))


def bar(offset: int, length: int, total: int, style: str) -> Text:
    left = round(BAR_WIDTH * offset / total)
    width = max(1, round(BAR_WIDTH * length / total))
    width = min(width, BAR_WIDTH - min(left, BAR_WIDTH - 1))
    return Text(" " * min(left, BAR_WIDTH - 1) + "█" * width, style=style)
