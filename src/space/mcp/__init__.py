"""SPACE's sandboxes as MCP tools, on the official `mcp` SDK: `space mcp` (stdio) and the control plane's
streamable-HTTP endpoint `/mcp` serve the same tools (space.mcp.tools), rendered as short text
(space.mcp.render). docs/adr/0049-mcp-server.md.

Invariants:
- A tool acts only through SPACE's own async SDK, with the caller's key: over stdio the key `space mcp` was
  configured with, over HTTP the key of the request (the endpoint hands the tools a client whose
  transport is the same API app, so every call passes the same authentication, roles and limits).
- A failure is a tool error (`isError`) naming the error's code, its message and, for a request the
  lifecycle refuses, the sandbox's state; it never ends the server.
"""
