"""Traces through a real installation (root helper, runsc, btrfs; ADR 0072): creating a sandbox is one
trace with spans of the control plane (request, reconciler move, database transactions, node call), the
node agent, and the root helper (its verbs, with the runsc and btrfs calls under them); an exec is one trace
down to spaced's own time for the call; `space trace` draws both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from space.cli.main import app
from space.sdk import Sandbox
from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def sandbox(real_cluster: RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    with real_cluster.sdk() as sp:
        made = sp.sandboxes.create()
        try:
            yield made
        finally:
            made.delete(wait=True)


def _one_trace(traces: list[dict[str, Any]], root_name: str) -> dict[str, Any]:
    found = [t for t in traces if any(s["name"] == root_name for s in t["spans"])]
    assert found, [[s["name"] for s in t["spans"]][:3] for t in traces]
    return found[-1]


def test_create_is_one_trace_through_the_helper(sandbox: Sandbox) -> None:
    create = _one_trace(sandbox.traces(limit=100), "POST /v1/sandboxes")
    spans = create["spans"]
    assert {s["trace_id"] for s in spans} == {create["trace_id"]}
    layers = {s["layer"] for s in spans}
    assert {"space.controlplane", "space.node", "space.node.helper"} <= layers, layers
    names = {s["name"] for s in spans}
    assert "reconcile.pending" in names or "reconcile.creating" in names, names
    assert "db.transaction" in names and "node.rpc PUT /sandboxes/{id}" in names, names
    assert "PUT /node/v1/sandboxes/{sandbox_id}" in names, names
    helper = [s for s in spans if s["layer"] == "space.node.helper"]
    assert any(s["name"].startswith("helper.") for s in helper), names
    assert any(s["name"].startswith(("runsc.", "btrfs.")) for s in helper), names
    by_id = {s["span_id"]: s for s in spans}
    for span in spans[1:]:  # one tree: every span but the request's hangs under another of the trace
        assert span["parent_id"] in by_id, span


def test_an_exec_reaches_spaced_in_the_same_trace(sandbox: Sandbox) -> None:
    assert sandbox.exec(["true"]).exit_code == 0
    exec_trace = _one_trace(sandbox.traces(limit=5), "POST /v1/sandboxes/{sandbox_id}/exec")
    layers = {s["layer"] for s in exec_trace["spans"]}
    assert {"space.controlplane", "space.node", "space.guest"} <= layers, layers
    spaced = next(s for s in exec_trace["spans"] if s["layer"] == "space.guest")
    assert spaced["name"] == "spaced.process.start" and spaced["end_ns"] > spaced["start_ns"]


def test_space_trace_draws_the_operations(real_cluster: RealCluster, sandbox: Sandbox) -> None:  # noqa: F811
    args = ["--url", real_cluster.url, "--api-key", real_cluster.api_key, "trace", sandbox.id]
    result = CliRunner().invoke(app, [*args, "--limit", "100"], env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    for word in ("POST /v1/sandboxes", "helper.", "spaced.process.start", "node agent", "helper"):
        assert word in result.output, word
