"""Which requests share a key's rate bucket, in process over a real store (no node needed): `/v1` and `/mcp`
are ONE bucket per key (a key does not get its rate twice by speaking MCP); the E2B control API (its list
route included) and the envd front each have their own, so a flood on one does not starve the other."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from space.controlplane.api.app import create_app
from space.controlplane.api.deps import Services
from space.controlplane.e2b.control import create_control_app
from space.controlplane.e2b.envd.app import envd_app
from space.controlplane.settings import ControlPlaneSettings
from space.core.ids import new_sandbox_id
from tests.support.cluster import bootstrap

BURST = 3
CLIENT = {"name": "t", "version": "1"}
INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": CLIENT},
}  # fmt: skip
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def slow(tmp_path: pathlib.Path) -> Iterator[tuple[FastAPI, str, str]]:
    """(SPACE's API app, an admin key, a member key) with BURST requests per key and almost no refill."""
    store, org_id, project_id, admin_key = bootstrap(f"sqlite:///{tmp_path / 'cp.db'}")
    try:
        settings = ControlPlaneSettings().model_copy(
            update={"api_requests_per_s": 0.001, "api_request_burst": BURST}
        )
        app = create_app(store, node_token="t" * 32, run_reconciler=False, settings=settings)
        _record, other_key = store.create_api_key(project_id, org_id, "member")
        yield app, admin_key, other_key
    finally:
        store.close()


def test_v1_and_mcp_share_one_bucket_per_key(slow: tuple[FastAPI, str, str]) -> None:
    app, key, other_key = slow
    with TestClient(app) as client:
        for _ in range(BURST - 1):
            assert client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        mcp = client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Authorization": f"Bearer {key}"})
        assert mcp.status_code == 200, mcp.text  # the last token of the key's one bucket
        refused = client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "resource_exhausted"
        again = client.post(
            "/mcp", json=INITIALIZE, headers={**MCP_HEADERS, "Authorization": f"Bearer {key}"}
        )
        assert again.status_code == 429 and int(again.headers["retry-after"]) >= 1
        # Another key has its own bucket; no key at all is a 401 before any bucket.
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {other_key}"}
        assert client.post("/mcp", json=INITIALIZE, headers=headers).status_code == 200
        assert client.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS).status_code == 401


def _envd_stat(client: TestClient, key: str) -> tuple[int, str]:
    """A Stat of a sandbox that does not exist: its token is taken before the sandbox is looked up."""
    answer = client.post(
        "/filesystem.Filesystem/Stat", json={"path": "/"},
        headers={"E2b-Sandbox-Id": new_sandbox_id(), "X-API-Key": key, "Content-Type": "application/json"},
    )  # fmt: skip
    return answer.status_code, str(answer.json().get("code"))


def test_e2b_control_and_envd_fronts_have_buckets_of_their_own(slow: tuple[FastAPI, str, str]) -> None:
    app, key, _other = slow
    services: Services = app.state.services
    with TestClient(create_control_app(services)) as control, TestClient(envd_app(services)) as envd:
        for _ in range(BURST):
            assert _envd_stat(envd, key) == (404, "not_found")
        assert _envd_stat(envd, key)[1] == "resource_exhausted"  # the envd front's bucket is empty
        for _ in range(BURST):  # ... and the control API's list still answers: a bucket of its own
            assert control.get("/v2/sandboxes", headers={"X-API-Key": key}).status_code == 200
        assert control.get("/v2/sandboxes", headers={"X-API-Key": key}).status_code == 429
        assert _envd_stat(envd, key)[1] == "resource_exhausted"  # nothing refilled it meanwhile
