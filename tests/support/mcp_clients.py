"""The `mcp` SDK's own client against SPACE's MCP server, over both transports: streamable HTTP to a control
plane's /mcp, and stdio to a `space mcp` subprocess. `McpCaller.call` answers (is_error, text) of a tool.

The client negotiates the protocol the way any client of the SDK does (mode "auto": the newest version,
falling back to the initialize handshake), unless a test names the mode."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from mcp import Client

REPO_BIN = os.path.dirname(sys.executable)


@dataclass
class McpCaller:
    client: Client

    async def tool_names(self) -> list[str]:
        return [tool.name for tool in (await self.client.list_tools()).tools]

    async def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> tuple[bool, str]:
        result = await self.client.call_tool(name, dict(arguments or {}))
        text = "\n".join(getattr(part, "text", "") for part in result.content)
        return bool(result.is_error), text

    async def ok(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """The text of a call that must succeed."""
        is_error, text = await self.call(name, arguments)
        assert not is_error, f"{name}({arguments}) failed: {text}"
        return text

    async def refused(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """The text of a call that must be a tool error."""
        is_error, text = await self.call(name, arguments)
        assert is_error, f"{name}({arguments}) succeeded: {text}"
        return text


@contextlib.asynccontextmanager
async def over_http(
    url: str, key: str | None, *, project: str | None = None, mode: str = "auto"
) -> AsyncIterator[McpCaller]:
    """A client of `url`/mcp sending `key` as its bearer key."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if project:
        headers["X-Space-Project"] = project
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(300.0, connect=10.0)) as http,
        Client(streamable_http_client(f"{url}/mcp", http_client=http), mode=mode) as client,  # type: ignore[arg-type]
    ):
        yield McpCaller(client)


@contextlib.asynccontextmanager
async def over_stdio(url: str, key: str, *, project: str | None = None) -> AsyncIterator[McpCaller]:
    """`space mcp` as a subprocess (the installed entry point), configured by SPACE_URL/SPACE_API_KEY."""
    params = StdioServerParameters(
        command=os.path.join(REPO_BIN, "space"),
        args=["mcp", *(["--project", project] if project else [])],
        env={"SPACE_URL": url, "SPACE_API_KEY": key, "SPACE_CONFIG": os.devnull},
    )
    async with Client(params) as client:
        yield McpCaller(client)


def first_word_after(text: str, prefix: str) -> str:
    """The word after `prefix` in `text` (an id in a tool's answer: "Created sandbox sb-...: ...")."""
    assert prefix in text, f"{prefix!r} not in {text!r}"
    return text.split(prefix, 1)[1].split(maxsplit=1)[0].rstrip(":.,")
