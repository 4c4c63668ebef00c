"""The helper's trace context field (ADR 0072): a valid `trace` runs the verb in a span of that trace and
the answer carries the spans under it; anything else in `trace` is dropped and the verb runs untraced
(never an error); the agent keeps only valid records of the answer."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from space.core import tracing
from space.core.ids import new_sandbox_id
from space.node.agent import helper_client
from space.node.helper import traced
from space.node.rpc.traced import route_shape


@pytest.fixture(autouse=True)
def _traced() -> None:
    tracing.configure("test")


def _verb(ctx: Any, request: Any, send_progress: Any) -> dict[str, Any]:
    assert "trace" not in request, "the field never reaches the verb table's strict request check"
    with traced.LAYER.span("runsc.state", command="state"):
        pass
    return {"ok": True, "result": {}}


def test_a_traced_verb_answers_its_spans() -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    request = {"verb": "sandbox.state", "args": {}, "trace": f"00-{trace_id}-{parent}-01"}
    answer = traced.traced_dispatch(_verb, None, request, None)
    spans = {s["name"]: s for s in answer["spans"]}
    assert set(spans) == {"helper.sandbox.state", "runsc.state"}
    assert spans["helper.sandbox.state"]["parent_id"] == parent
    assert spans["runsc.state"]["parent_id"] == spans["helper.sandbox.state"]["span_id"]
    assert {s["trace_id"] for s in answer["spans"]} == {trace_id}


@pytest.mark.parametrize(
    "hostile", [5, None, "", "x" * 100_000, ["00"], {"a": 1}, "00-" + "0" * 32 + "-" + "1" * 16 + "-01"]
)
def test_a_hostile_trace_field_is_dropped_and_the_verb_runs(hostile: Any) -> None:
    answer = traced.traced_dispatch(
        _verb, None, {"verb": "sandbox.state", "args": {}, "trace": hostile}, None
    )
    assert answer == {"ok": True, "result": {}}


def test_an_unknown_verb_is_not_named_in_its_span() -> None:
    trace_id = secrets.token_hex(16)
    request = {"verb": "evil" * 50, "args": {}, "trace": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    answer = traced.traced_dispatch(
        lambda *_: {"ok": False, "error": {"code": "invalid_argument"}}, None, request, None
    )
    (span,) = answer["spans"]
    assert span["name"] == "helper.unknown" and span["error"] is True


def test_the_agent_keeps_only_valid_records_of_an_answer() -> None:
    trace_id = secrets.token_hex(16)
    good = {
        "trace_id": trace_id, "span_id": secrets.token_hex(8), "parent_id": None, "name": "helper.x",
        "layer": "space.node.helper", "start_ns": 1, "end_ns": 2,
        "attributes": {"verb": "x", "env": "SECRET"},
    }  # fmt: skip
    helper_client._keep_spans([good, {**good, "span_id": "nope"}, "junk", 5])
    helper_client._keep_spans("not a list")
    (kept,) = tracing.RING.trace(trace_id)
    assert kept["attributes"] == {"verb": "x"}


def test_a_node_call_is_named_by_its_route_shape_never_its_path() -> None:
    sandbox_id = new_sandbox_id()
    assert route_shape(f"/node/v1/sandboxes/{sandbox_id}/files/secret-name") == (
        "/sandboxes/{id}/files",
        sandbox_id,
    )
    assert route_shape("/node/v1/sandboxes/restore") == ("/sandboxes/restore", None)
    assert route_shape("/node/v1/sandboxes/My%2FSecret/x") == ("/sandboxes/{?}/x", None)
    assert route_shape("/node/v1/sandboxes/../x") == ("/sandboxes/{?}/x", None)
