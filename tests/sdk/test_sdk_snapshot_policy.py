"""SDK surface of issue 4: snapshot policy at create and by PATCH, snapshot sizes and locations (sync and
async, against a fake HTTP server)."""

from __future__ import annotations

import asyncio

import httpx

from space.sdk import AsyncSpace, Space
from tests.support.sdk_server import KEY, URL, FakeServer, sandbox_json

POLICY = {"disk_every_s": 300, "full_every_s": 3600, "upload_full": True}
SNAPSHOT = {
    "id": "snap-1", "sandbox_id": "sb-1", "kind": "full", "created_at": "t", "size_bytes": 5,
    "exclusive_bytes": 4096, "locations": ["node:node-1", "objectstore"],
}  # fmt: skip


def routes() -> FakeServer:
    server = FakeServer()
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json()))
    server.on("GET", "/v1/sandboxes/sb-1", httpx.Response(200, json=sandbox_json()))
    server.on(
        "PATCH", "/v1/sandboxes/sb-1", httpx.Response(200, json={**sandbox_json(), "snapshot_policy": None})
    )
    server.on("GET", "/v1/sandboxes/sb-1/snapshots", httpx.Response(200, json={"snapshots": [SNAPSHOT]}))
    return server


def test_sync_policy_and_snapshot_fields() -> None:
    server = routes()
    with Space(url=URL, api_key=KEY, transport=httpx.MockTransport(server), retry_backoff=0) as sp:
        sb = sp.sandboxes.create(snapshot_policy=POLICY)
        assert server.body()["snapshot_policy"] == POLICY
        sb.set_snapshot_policy(None)
        assert server.last().method == "PATCH" and server.body() == {"snapshot_policy": None}
        snap = sb.snapshots.list()[0]
        assert snap.exclusive_bytes == 4096 and snap.locations == ["node:node-1", "objectstore"]
        sp.sandboxes.create()
        assert "snapshot_policy" not in server.body(), "no policy unless asked"


def test_async_policy_and_snapshot_fields() -> None:
    server = routes()

    async def scenario() -> None:
        async with AsyncSpace(url=URL, api_key=KEY, transport=httpx.MockTransport(server)) as sp:
            sb = await sp.sandboxes.create(snapshot_policy=POLICY)
            assert server.body()["snapshot_policy"] == POLICY
            await sb.set_snapshot_policy({"disk_every_s": 60})
            assert server.body() == {"snapshot_policy": {"disk_every_s": 60}}
            snaps = await sb.snapshots.list()
            assert snaps[0].exclusive_bytes == 4096 and "objectstore" in snaps[0].locations

    asyncio.run(scenario())
