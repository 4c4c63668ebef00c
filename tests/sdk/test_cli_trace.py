"""`space trace` over a fake server (ADR 0072): the waterfall's tree (children under their parent by start,
a span whose parent is elsewhere at the top), its columns and bars, `--last`, `--json`, an empty answer,
and another tenant's sandbox (the server's 404) as the usual not-found exit."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from rich.console import Console

from space.cli import trace as trace_cli
from space.cli.main import app
from tests.support.sdk_server import error_response, runner, serve_the_cli

T = "a" * 32


def span(
    span_id: str, parent: str | None, name: str, layer: str, start: int, end: int, **kw: Any
) -> dict[str, Any]:
    return {
        "trace_id": T, "span_id": span_id * 16, "parent_id": parent * 16 if parent else None, "name": name,
        "layer": layer, "start_ns": start * 1_000_000, "end_ns": end * 1_000_000, "attributes": {}, **kw,
    }  # fmt: skip


TRACE = {
    "trace_id": T,
    "spans": [
        span("1", None, "POST /v1/sandboxes/{sandbox_id}/exec", "space.controlplane", 0, 20),
        span("2", "1", "node.rpc POST /sandboxes/{id}/exec", "space.controlplane", 2, 18),
        span("4", "3", "guest.process.start", "space.node", 5, 16),
        span("3", "2", "POST /node/v1/sandboxes/{sandbox_id}/exec", "space.node", 3, 17),
        span("5", "4", "spaced.process.start", "space.guest", 6, 15, error=True),
        span("6", "9", "helper.sandbox.state", "space.node.helper", 1, 2),  # its parent is not here
    ],
}


def test_the_waterfall_is_the_span_tree_with_offsets_durations_and_bars() -> None:
    console = Console(record=True, width=200)
    console.print(trace_cli.waterfall(TRACE))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "│" in line and "ms" not in line.split("│")[1]]
    names = [row.split("│")[1].rstrip() for row in rows]
    assert names == [
        " POST /v1/sandboxes/{sandbox_id}/exec",
        "   node.rpc POST /sandboxes/{id}/exec",
        "     POST /node/v1/sandboxes/{sandbox_id}/exec",
        "       guest.process.start",
        "         spaced.process.start",
        " helper.sandbox.state",
    ]
    assert "20.0 ms" in text and f"trace {T}" in text
    assert "spaced" in text and "node agent" in text and "helper" in text and "control plane" in text
    assert "9.00" in text  # spaced: 6 ms to 15 ms


def test_bars_stay_within_their_column() -> None:
    for offset, length in ((0, 100), (99, 1), (100, 0), (50, 200)):
        assert len(trace_cli.bar(offset, length, 100, "white").plain) <= trace_cli.BAR_WIDTH


def test_last_json_and_nothing_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve_the_cli(monkeypatch)
    server.on(
        "GET",
        "/v1/sandboxes/sb-1/traces",
        httpx.Response(200, json={"sandbox_id": "sb-1", "traces": [TRACE]}),
    )
    result = runner.invoke(app, ["trace", "sb-1", "--last", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [TRACE]
    assert server.last().url.params["limit"] == "1"
    server.on(
        "GET", "/v1/sandboxes/sb-1/traces", httpx.Response(200, json={"sandbox_id": "sb-1", "traces": []})
    )
    result = runner.invoke(app, ["trace", "sb-1"])
    assert result.exit_code == 0 and "no traces kept for sb-1" in result.output
    assert server.last().url.params["limit"] == "5"


def test_another_tenants_sandbox_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve_the_cli(monkeypatch)
    server.on("GET", "/v1/sandboxes/sb-2/traces", error_response(404, "not_found", "no sandbox sb-2"))
    result = runner.invoke(app, ["trace", "sb-2"])
    assert result.exit_code not in (0, 1) and "sb-2" in result.output
    assert runner.invoke(app, ["trace", "sb-2", "--limit", "0"]).exit_code == 2
