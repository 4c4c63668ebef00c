"""Traces through the API (ADR 0072) against a real control plane and node agent (fake driver: spaced runs
as a host process): an exec is one trace with spans of the control plane, the node agent and spaced under
one trace id, continuing the caller's traceparent; `GET /v1/sandboxes/{id}/traces`, the SDK's `traces()`
and `space trace` answer it; and attacked: another tenant's sandbox answers like a missing one, a hostile
traceparent is ignored, no span carries an env value, a command line or file contents."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from space.cli.main import app
from space.core.ids import new_sandbox_id
from tests.support import cluster as c

fake_cluster = c.fake_cluster


@pytest.fixture(scope="module")
def two(fake_cluster: c.Cluster) -> Iterator[tuple[c.Project, str, c.Project, str]]:
    with c.two_tenants(fake_cluster) as tenants:
        yield tenants


def _traces(http: httpx.Client, sandbox_id: str, **params: Any) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/traces", params=params)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["traces"])


def _exec(http: httpx.Client, sandbox_id: str, headers: dict[str, str] | None = None, **body: Any) -> None:
    answer = http.post(
        f"/v1/sandboxes/{sandbox_id}/exec", json={"argv": ["true"], **body}, headers=headers or {}
    )
    assert answer.status_code == 200, answer.text


def test_an_exec_is_one_trace_across_the_control_plane_the_node_and_spaced(two: Any) -> None:
    victim, sandbox_id, _attacker, _other = two
    http = victim.http()
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    _exec(http, sandbox_id, {"traceparent": f"00-{trace_id}-{parent}-01"})
    traces = {t["trace_id"]: t for t in _traces(http, sandbox_id, limit=100)}
    assert trace_id in traces, "the caller's trace is continued"
    spans = traces[trace_id]["spans"]
    assert {s["trace_id"] for s in spans} == {trace_id}
    layers = {s["layer"] for s in spans}
    assert {"space.controlplane", "space.node", "space.guest"} <= layers, layers
    names = [s["name"] for s in spans]
    assert "POST /v1/sandboxes/{sandbox_id}/exec" in names
    assert any(n.startswith("node.rpc POST /sandboxes/{id}/exec") for n in names), names
    assert any(n.startswith("guest.process.") for n in names) and any(n.startswith("spaced.") for n in names)
    by_id = {s["span_id"]: s for s in spans}
    root = next(s for s in spans if s["name"] == "POST /v1/sandboxes/{sandbox_id}/exec")
    assert root["parent_id"] == parent
    spaced = next(s for s in spans if s["layer"] == "space.guest")
    guest_call = by_id[spaced["parent_id"]]
    assert guest_call["layer"] == "space.node" and guest_call["start_ns"] <= spaced["end_ns"]


@pytest.mark.parametrize(
    "hostile",
    [
        "garbage",
        "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "z" * 6000,
    ],
)
def test_a_hostile_traceparent_is_ignored_not_an_error(two: Any, hostile: str) -> None:
    victim, sandbox_id, _attacker, _other = two
    before = {t["trace_id"] for t in _traces(victim.http(), sandbox_id, limit=100)}
    _exec(victim.http(), sandbox_id, {"traceparent": hostile})
    new = [t for t in _traces(victim.http(), sandbox_id, limit=100) if t["trace_id"] not in before]
    assert new, "the request made a trace of its own"
    assert all(t["trace_id"] != "a" * 32 for t in new)


def test_spans_carry_no_secret(two: Any) -> None:
    victim, sandbox_id, _attacker, _other = two
    secret = "sekret-" + secrets.token_hex(12)
    http = victim.http()
    _exec(http, sandbox_id, env={"TOKEN": secret}, argv=["sh", "-c", f"echo {secret}"])
    path = {"path": f"/tmp/{secret}.txt"}
    written = http.put(f"/v1/sandboxes/{sandbox_id}/files", params=path, content=secret.encode())
    assert written.status_code < 300, written.text
    assert http.get(f"/v1/sandboxes/{sandbox_id}/files", params=path).content == secret.encode()
    dumped = json.dumps(_traces(http, sandbox_id, limit=100))
    assert secret not in dumped
    assert "/files" in dumped, "the file calls were traced"


def test_traces_are_project_scoped(two: Any) -> None:
    victim, victim_sb, attacker, attacker_sb = two
    _exec(victim.http(), victim_sb)
    for target in (victim_sb, new_sandbox_id()):
        answer = attacker.http().get(f"/v1/sandboxes/{target}/traces")
        assert answer.status_code == 404, answer.text
    for path in (f"{victim_sb}%2F..%2F{attacker_sb}", "..%2F" + victim_sb, "x" * 5000):
        assert attacker.http().get(f"/v1/sandboxes/{path}/traces").status_code in {400, 404, 422}
    assert (
        attacker.http().get(f"/v1/sandboxes/{attacker_sb}/traces", params={"limit": 10_000}).status_code
        == 422
    )
    assert attacker.cluster.http(None).get(f"/v1/sandboxes/{victim_sb}/traces").status_code == 401


def test_reading_traces_makes_no_trace(two: Any) -> None:
    victim, sandbox_id, _attacker, _other = two
    first = _traces(victim.http(), sandbox_id, limit=100)
    second = _traces(victim.http(), sandbox_id, limit=100)
    assert [t["trace_id"] for t in first] == [t["trace_id"] for t in second]


def test_the_sdk_and_space_trace_draw_the_waterfall(two: Any) -> None:
    victim, sandbox_id, _attacker, _other = two
    _exec(victim.http(), sandbox_id)
    with victim.sdk() as sp:
        traces = sp.sandboxes.ref(sandbox_id).traces(limit=1)
    assert len(traces) == 1 and traces[0]["spans"]
    cluster = victim.cluster
    args = ["--url", cluster.url, "--api-key", victim.key, "trace", sandbox_id, "--last"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "POST /v1/sandboxes/{sandbox_id}/exec" in result.output
    assert "spaced" in result.output and "node agent" in result.output and "control plane" in result.output
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)[0]["trace_id"] == traces[0]["trace_id"]


def test_the_nodes_traces_route_answers_only_traces_about_the_capabilitys_sandbox(two: Any) -> None:
    victim, victim_sb, _attacker, attacker_sb = two
    _exec(victim.http(), victim_sb)
    victim_traces = [t["trace_id"] for t in _traces(victim.http(), victim_sb, limit=100)]
    node = victim.cluster.node
    own = node.get(f"/sandboxes/{victim_sb}/traces", params={"trace_id": victim_traces})
    assert own.status_code == 200 and own.json()["spans"], own.text
    # A capability for the attacker's sandbox, naming the victim's trace ids: nothing of them.
    stolen = node.get(f"/sandboxes/{attacker_sb}/traces", params={"trace_id": victim_traces})
    assert stolen.status_code == 200 and stolen.json() == {"spans": []}, stolen.text
    for hostile in (["x" * 32], ["A" * 32], [secrets.token_hex(16)] * 101, ["0" * 10_000]):
        answer = node.get(f"/sandboxes/{attacker_sb}/traces", params={"trace_id": hostile})
        assert answer.status_code == 422, answer.text
    bare = httpx.get(f"{node.url}/node/v1/sandboxes/{victim_sb}/traces", params={"trace_id": victim_traces})
    assert bare.status_code == 401


def test_a_lifecycle_requests_trace_holds_its_reconciler_steps(two: Any) -> None:
    """The request drives the reconciler's step itself (the direct path): one trace, request to node."""
    victim, sandbox_id, _attacker, _other = two
    with victim.sdk() as sp:
        sb = sp.sandboxes.ref(sandbox_id)
        sb.pause()
        sb.resume()
    names = [[s["name"] for s in t["spans"]] for t in _traces(victim.http(), sandbox_id, limit=100)]
    steps = [n for n in names if any(name.startswith("reconcile.") for name in n)]
    assert any("node.rpc POST /sandboxes/{id}/pause" in n for n in steps), steps
    assert any("node.rpc POST /sandboxes/{id}/resume" in n for n in steps), steps
    assert any("db.transaction" in n for n in steps), steps
