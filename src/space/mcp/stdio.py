"""`space mcp`: the tools of space.mcp.tools over stdio, acting with one configured key.

Invariants:
- stdout carries the MCP protocol alone (logs go to stderr).
- One SDK client for the whole run, configured like the CLI (its --url/--api-key, else SPACE_URL and
  SPACE_API_KEY, else the config file `space up` writes), closed when the client hangs up.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from space.mcp.tools import ToolContext, build_server
from space.sdk import AsyncSpace

__all__ = ["serve_stdio"]


async def serve_stdio(url: str | None = None, api_key: str | None = None, project: str | None = None) -> None:
    """Serve until stdin ends; `project`: the project an organization key acts in (X-Space-Project)."""
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="space mcp %(levelname)s %(message)s"
    )
    headers = {"X-Space-Project": project} if project else None
    async with AsyncSpace(url, api_key, headers=headers) as space:

        @asynccontextmanager
        async def the_client(ctx: ToolContext) -> AsyncIterator[AsyncSpace]:
            yield space

        await build_server(the_client).run_stdio_async()
