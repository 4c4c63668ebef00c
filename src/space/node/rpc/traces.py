"""A node's spans of some traces of one sandbox over RPC (space.node.agent.routes.traces, ADR 0072)."""

from __future__ import annotations

from space.node.agent.trace_models import MAX_TRACE_IDS, NodeTracesAnswer
from space.node.rpc.transport import NodeTransport, sandbox_path


class TraceCalls(NodeTransport):
    async def traces(self, sandbox_id: str, trace_ids: list[str]) -> NodeTracesAnswer:
        """The node's spans of `trace_ids` (the newest MAX_TRACE_IDS), only of traces about the sandbox."""
        params = {"trace_id": trace_ids[-MAX_TRACE_IDS:]}
        answer = await self._request(
            "GET", sandbox_path(sandbox_id, "traces"), params=params, sandbox_id=sandbox_id
        )
        return NodeTracesAnswer.model_validate(answer)
