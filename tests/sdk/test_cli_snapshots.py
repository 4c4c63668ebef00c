"""`space sandbox create` snapshot-policy options and `space snapshot list` sizes and locations."""

from __future__ import annotations

import httpx

from tests.support.sdk_server import FakeServer, invoke, sandbox_json


def test_create_with_a_snapshot_policy(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json()))
    result = invoke("sandbox", "create", "--checkpoint-every", "3600", "--upload-checkpoints",
                    "--disk-snapshot-every", "300")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert server.body()["snapshot_policy"] == {
        "disk_every_s": 300,
        "full_every_s": 3600,
        "upload_full": True,
    }
    assert invoke("sandbox", "create").exit_code == 0
    assert "snapshot_policy" not in server.body()
    refused = invoke("sandbox", "create", "--upload-checkpoints")
    assert refused.exit_code != 0 and "--checkpoint-every" in refused.output


def test_snapshot_list_shows_sizes_and_locations(server: FakeServer) -> None:
    snaps = [
        {"id": "snap-1", "kind": "full", "created_at": "t1", "size_bytes": 3 << 20,
         "exclusive_bytes": 10 << 20, "locations": ["node:node-1", "objectstore"]},
        {"id": "snap-2", "kind": "disk", "created_at": "t2", "size_bytes": None, "exclusive_bytes": 512,
         "locations": ["objectstore"]},
    ]  # fmt: skip
    server.on("GET", "/v1/sandboxes/sb-1/snapshots", httpx.Response(200, json={"snapshots": snaps}))
    lines = invoke("snapshot", "list", "sb-1").stdout.splitlines()
    assert lines[0].split() == ["ID", "KIND", "CREATED", "EXCLUSIVE", "SIZE", "LOCATION"]
    assert lines[1].split() == [
        "snap-1",
        "full",
        "t1",
        "10.0",
        "MiB",
        "3.0",
        "MiB",
        "node:node-1,objectstore",
    ]
    assert lines[2].split() == ["snap-2", "disk", "t2", "512", "B", "-", "objectstore"]
