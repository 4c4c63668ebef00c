"""`space mcp`: SPACE's sandboxes as MCP tools over stdio, for an agent that starts it as its MCP server
(configured like every other command: --url/--api-key, SPACE_URL/SPACE_API_KEY, or `space up`'s config
file). The same tools are served over streamable HTTP at the control plane's /mcp."""

from __future__ import annotations

from typing import Annotated

import anyio
import typer

from space.cli._common import handles_errors, state
from space.sdk import resolve_config


@handles_errors
def mcp_command(
    project: Annotated[
        str | None,
        typer.Option("--project", metavar="NAME", help="The project an organization key acts in."),
    ] = None,
) -> None:
    """Serve SPACE's sandboxes as MCP tools over stdin/stdout (an agent starts this as its MCP server)."""
    # Imported here: the MCP SDK takes ~0.6 s to import, which no other command should pay.
    from space.mcp.stdio import serve_stdio

    config = resolve_config(state.url, state.api_key)  # no server configured: exit 2 before serving
    anyio.run(serve_stdio, config.url, config.api_key, project)
