"""The MCP tools name a full snapshot (`snapshot(name=)`) and start a sandbox from one
(`create_sandbox(from_snapshot=)`): what they send to SPACE's API, driven directly against a recording app
(the API's own handling is tested in tests/e2b/test_snapshot_names.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from mcp.server.mcpserver.exceptions import ToolError

from space.mcp.in_process import caller_clients
from space.mcp.tools import SpaceTools

SNAP = {"id": "snap-1", "sandbox_id": "sb-1", "kind": "full", "state": "ready", "name": "golden"}
SANDBOX = {"id": "sb-2", "state": "running", "template": "python"}


class Api:
    """Answers like SPACE's API would, recording (method, path, JSON body) of each request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["method"], scope["path"], json.loads(body) if body else None))
        if scope["path"].endswith("/snapshots"):
            status, answer = 201, SNAP
        elif json.loads(body or b"{}").get("from_snapshot") == "missing":
            status, answer = 404, {"error": {"code": "not_found", "message": "snapshot missing not found"}}
        else:
            status, answer = 201, SANDBOX
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def test_named_snapshot_and_a_sandbox_from_it() -> None:
    api = Api()
    tools = SpaceTools(caller_clients(api))
    ctx: Any = SimpleNamespace(headers={"authorization": "Bearer sk-caller"})

    async def scenario() -> None:
        said = await tools.snapshot(ctx, id="sb-1", kind="full", name="golden")
        assert "snap-1" in said and "create_sandbox(from_snapshot='golden')" in said
        made = await tools.create_sandbox(ctx, from_snapshot="golden", env={"A": "1"})
        assert made.startswith("Created sandbox sb-2")
        with pytest.raises(ToolError, match="not_found"):
            await tools.create_sandbox(ctx, from_snapshot="missing")

    asyncio.run(scenario())
    assert api.seen[0] == ("POST", "/v1/sandboxes/sb-1/snapshots", {"full": True, "name": "golden"})
    method, path, body = api.seen[1]
    assert (method, path) == ("POST", "/v1/sandboxes")
    assert body["from_snapshot"] == "golden" and "template" not in body and body["env"] == {"A": "1"}
