"""A sandbox's metrics history over RPC (space.node.agent.routes.metrics, ADR 0053).

Invariants:
- The answer is validated into MetricsAnswer before it is returned; the window goes as typed query values.
"""

from __future__ import annotations

from typing import Any

from space.node.agent.metrics_models import MAX_SAMPLES, MetricsAnswer
from space.node.rpc.transport import NodeTransport, sandbox_path


class MetricsCalls(NodeTransport):
    async def metrics(
        self,
        sandbox_id: str,
        *,
        start: float | None = None,
        end: float | None = None,
        limit: int = MAX_SAMPLES,
    ) -> MetricsAnswer:
        """The samples the node kept for the sandbox with start <= timestamp <= end (Unix seconds)."""
        params: dict[str, Any] = {"limit": limit}
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        answer = await self._request(
            "GET", sandbox_path(sandbox_id, "metrics"), params=params, sandbox_id=sandbox_id
        )
        return MetricsAnswer.model_validate(answer)
