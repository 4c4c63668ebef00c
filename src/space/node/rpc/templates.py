"""Node-level template calls over RPC (space.node.agent.routes.templates, docs/adr/0054-template-build.md).

Invariants:
- The template name is validated (space.core.ids.parse_template_name) and quoted as ONE path segment before
  any request, so no name can reach another route.
- `build_template` yields the node's NDJSON items as they come, never buffering the stream: `{"log"}`
  items, then one `{"done"}` or `{"error"}` item, which it yields (the caller settles the build with it)
  instead of raising; a refused request (before the stream starts) raises its typed error.
- Node-level calls carry the node token only: no sandbox capability.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from space.core import errors
from space.core.ids import parse_template_name
from space.node.rpc.transport import STREAM_TIMEOUT, NodeTransport, _seg, raise_for_error, translated

#: One NDJSON line of a build stream at most (the node bounds its lines well below this).
MAX_BUILD_LINE = 1 << 20


def _template_path(name: str, *segments: str) -> str:
    return "/templates/" + "/".join(_seg(piece) for piece in (parse_template_name(name), *segments))


class TemplateCalls(NodeTransport):
    async def build_template(self, name: str, spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Build user template `name` on the node; yields the stream's items (see the module invariants)."""
        path = _template_path(name, "build")
        with translated(f"POST {path}"):
            async with self._http.stream("POST", path, json=spec, timeout=STREAM_TIMEOUT) as response:
                await raise_for_error(response)
                async for line in response.aiter_lines():
                    if len(line) > MAX_BUILD_LINE:
                        raise errors.Unavailable(
                            f"node build stream of {name}: a line over {MAX_BUILD_LINE} bytes"
                        )
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if isinstance(item, dict):
                        yield item

    async def delete_template(self, name: str) -> dict[str, Any]:
        """Delete user template `name` from the node (NotFound: the node does not hold it)."""
        answer: dict[str, Any] = await self._request("DELETE", _template_path(name))
        return answer

    async def list_templates(self) -> list[dict[str, Any]]:
        """Every complete template the node holds: {"name", "builtin", "metadata"}."""
        answer = await self._request("GET", "/templates")
        templates = answer.get("templates") if isinstance(answer, dict) else None
        return [t for t in templates or [] if isinstance(t, dict)]
