"""The MCP `create_sandbox` tool's `isolation` (issue 15, ADR 0076): what it sends to SPACE's API, what it
answers (a microVM says so, gVisor goes without saying), and the API's refusal as the tool's error; driven
against a recording app (the API's own handling: tests/controlplane/test_isolation_api.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from mcp.server.mcpserver.exceptions import ToolError

from space.mcp.in_process import caller_clients
from space.mcp.tools import SpaceTools

UNAVAILABLE = {
    "error": {
        "code": "unavailable",
        "message": "no node runs microvm sandboxes (the ready nodes run gvisor)",
        "details": {"reason": "no_node_for_isolation", "isolation": "microvm"},
    }
}


class Api:
    """Answers a create like SPACE's API, recording each JSON body; `refuse`: the next create is a 503."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.refuse = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        sent = json.loads(body) if body else {}
        self.bodies.append(sent)
        answer: Any = {"id": "sb-2", "state": "running", "template": "python"}
        status = 201
        if self.refuse:
            status, answer = 503, UNAVAILABLE
        elif "isolation" in sent:
            answer["isolation"] = sent["isolation"]
        else:
            answer["isolation"] = "gvisor"
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def test_create_sandbox_passes_the_isolation_and_says_microvm() -> None:
    api = Api()
    tools = SpaceTools(caller_clients(api))
    ctx: Any = SimpleNamespace(headers={"authorization": "Bearer sk-caller"})

    async def scenario() -> None:
        vm = await tools.create_sandbox(ctx, isolation="microvm")
        assert vm == "Created sandbox sb-2: sb-2  running  template=python  isolation=microvm"
        plain = await tools.create_sandbox(ctx)
        assert plain == "Created sandbox sb-2: sb-2  running  template=python"
        api.refuse = True
        with pytest.raises(ToolError, match="no node runs microvm sandboxes"):
            await tools.create_sandbox(ctx, isolation="microvm")

    asyncio.run(scenario())
    assert api.bodies[0]["isolation"] == "microvm" and "isolation" not in api.bodies[1]
