"""`space snapshot create --name` and `space sandbox create --from-snapshot` (CLI and SDK bodies), against
a fake API: the name goes with a full snapshot, a create from a snapshot sends no template."""

from __future__ import annotations

import json

import httpx

from tests.support.sdk_server import FakeServer, invoke, sandbox_json


def test_snapshot_create_with_a_name(server: FakeServer) -> None:
    snap = {"id": "snap-1", "sandbox_id": "sb-1", "kind": "full", "created_at": "t", "name": "golden"}
    server.on("POST", "/v1/sandboxes/sb-1/snapshots", httpx.Response(201, json=snap))
    result = invoke("snapshot", "create", "sb-1", "--full", "--name", "golden")
    assert result.exit_code == 0 and result.stdout == "snap-1\n", result.output
    assert server.body() == {"full": True, "name": "golden"}


def test_sandbox_create_from_a_snapshot(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-child")))
    result = invoke("sandbox", "create", "--from-snapshot", "golden", "--env", "A=1", "--metadata", "k=v")
    assert result.exit_code == 0 and result.stdout == "sb-child\n", result.output
    body = server.body()
    assert body["from_snapshot"] == "golden" and "template" not in body  # the source's template
    assert body["env"] == {"A": "1"} and body["metadata"] == {"k": "v"}


def test_project_snapshots_listed_and_deleted_by_name(server: FakeServer) -> None:
    """`space snapshot list --name` and `space snapshot delete` reach the project's snapshots without a
    sandbox (a named one outlives its sandbox: ADR 0060)."""
    snap = {"id": "snap-1", "sandbox_id": "sb-gone", "kind": "full", "created_at": "t", "name": "golden",
            "locations": ["objectstore"]}  # fmt: skip
    server.on("GET", "/v1/snapshots", httpx.Response(200, json={"snapshots": [snap]}))
    listed = invoke("snapshot", "list", "--name", "golden", "--json")
    assert listed.exit_code == 0, listed.output
    assert [s["id"] for s in json.loads(listed.stdout)] == ["snap-1"]
    assert server.requests[-1].url.params["name"] == "golden"
    server.on("DELETE", "/v1/snapshots/golden", httpx.Response(200, json={"deleted": ["snap-1"]}))
    deleted = invoke("snapshot", "delete", "golden")
    assert deleted.exit_code == 0 and deleted.stdout == "snap-1\n", deleted.output
    server.on("DELETE", "/v1/snapshots/nothing", httpx.Response(404, json=_not_found()))
    missing = invoke("snapshot", "delete", "nothing")
    assert missing.exit_code != 0 and "snap-" not in missing.stdout


def _not_found() -> dict[str, object]:
    return {"error": {"code": "not_found", "message": "snapshot nothing not found", "details": {}}}
