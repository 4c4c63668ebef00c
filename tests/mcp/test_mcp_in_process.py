"""The /mcp tools' client (space.mcp.in_process) against small ASGI apps: it forwards exactly the caller's
Authorization and X-Space-Project, sends nothing else of the MCP request, never retries, and an exception
the app lets out is its 500 answer (a typed SpaceError), not the exception itself."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from space.core.errors import ResourceExhausted, SpaceError
from space.mcp.in_process import caller_clients


class Recorder:
    """An ASGI app answering every request with `status`, recording what it was sent."""

    def __init__(self, status: int = 200, body: Any = None) -> None:
        self.status = status
        self.body = {"sandboxes": []} if body is None else body
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(self.body).encode()})


async def crashing(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise RuntimeError("the app's internals")


def context(**headers: str) -> Any:
    return SimpleNamespace(headers=headers)


def test_only_the_callers_key_and_project_are_forwarded() -> None:
    app = Recorder()
    ctx = context(
        **{"authorization": "Bearer sk-caller", "x-space-project": "p1", "cookie": "c=1", "x-other": "o"}
    )

    async def scenario() -> None:
        async with caller_clients(app)(ctx) as space:
            assert await space.sandboxes.list() == []

    asyncio.run(scenario())
    (seen,) = app.seen
    assert seen["authorization"] == "Bearer sk-caller" and seen["x-space-project"] == "p1"
    assert "cookie" not in seen and "x-other" not in seen


def test_a_refusal_is_not_retried_and_a_crash_is_a_500() -> None:
    limited = Recorder(429, {"error": {"code": "resource_exhausted", "message": "slow down"}})

    async def scenario() -> None:
        async with caller_clients(limited)(context(authorization="Bearer k")) as space:
            with pytest.raises(ResourceExhausted):
                await space.sandboxes.list()
        async with caller_clients(crashing)(context(authorization="Bearer k")) as space:
            with pytest.raises(SpaceError) as caught:
                await space.sandboxes.list()
            assert "internals" not in str(caught.value)
        with pytest.raises(SpaceError, match="missing API key"):
            async with caller_clients(limited)(context()):
                pass

    asyncio.run(scenario())
    assert len(limited.seen) == 1
