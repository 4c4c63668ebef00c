"""The request span middleware (space.rest.tracing, ADR 0072), in process: the span is named after the route
template with its router's prefix (never the raw path), carries the path's sandbox id and the status,
continues a valid traceparent and ignores a hostile one; skipped paths and the traces routes make none; a
node-side app (roots off) traces only requests that carry a trace."""

from __future__ import annotations

import secrets

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from space.core import tracing
from space.rest.tracing import TraceRequests


@pytest.fixture(autouse=True)
def _traced() -> None:
    tracing.configure("test")


def _app(**options: object) -> TestClient:
    router = APIRouter()

    @router.get("/sandboxes/{sandbox_id}/files")
    def files(sandbox_id: str, path: str) -> dict[str, str]:
        return {"ok": sandbox_id}

    @router.get("/sandboxes/{sandbox_id}/traces")
    def traces(sandbox_id: str) -> dict[str, str]:
        return {}

    app = FastAPI()
    app.include_router(router, prefix="/v1")
    app.add_api_route("/healthz", lambda: {}, methods=["GET"])
    app.add_middleware(TraceRequests, layer="space.test", **options)
    return TestClient(app)


def _spans_of(trace_id: str) -> list[dict[str, object]]:
    return tracing.RING.trace(trace_id)


def test_a_request_span_is_named_by_its_route_and_continues_the_callers_trace() -> None:
    client = _app(skip=("/healthz",))
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    answer = client.get(
        "/v1/sandboxes/sb-x/files", params={"path": "/secret/name.txt"},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )  # fmt: skip
    assert answer.status_code == 200
    (span,) = _spans_of(trace_id)
    assert span["name"] == "GET /v1/sandboxes/{sandbox_id}/files" and span["parent_id"] == parent
    assert span["attributes"] == {
        "route": "/v1/sandboxes/{sandbox_id}/files",
        "status": 200,
        "sandbox_id": "sb-x",
    }
    assert "secret" not in repr(span)


@pytest.mark.parametrize(
    "hostile", ["x", "00-" + "f" * 32 + "-" + "f" * 16 + "-01" + "x" * 5000, b"\xff" * 60]
)
def test_a_hostile_traceparent_starts_a_new_trace(hostile: str | bytes) -> None:
    client = _app()
    before = len(tracing.RING)
    answer = client.get("/v1/sandboxes/sb-y/files", params={"path": "/a"}, headers={"traceparent": hostile})
    assert answer.status_code == 200
    assert len(tracing.RING) == min(before + 1, tracing.RING.max_traces)
    assert tracing.RING.trace("f" * 32) == []


def test_skipped_paths_and_the_traces_routes_make_no_span() -> None:
    client = _app(skip=("/healthz",))
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert client.get("/healthz", headers=headers).status_code == 200
    assert client.get("/v1/sandboxes/sb-z/traces", headers=headers).status_code == 200
    assert _spans_of(trace_id) == []


def test_without_roots_only_a_request_in_a_trace_makes_a_span() -> None:
    client = _app(roots=False)
    tracing.RING.clear()
    assert client.get("/v1/sandboxes/sb-n/files", params={"path": "/a"}).status_code == 200
    assert len(tracing.RING) == 0
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert client.get("/v1/sandboxes/sb-n/files", params={"path": "/a"}, headers=headers).status_code == 200
    assert [s["name"] for s in _spans_of(trace_id)] == ["GET /v1/sandboxes/{sandbox_id}/files"]
