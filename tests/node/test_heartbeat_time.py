"""A heartbeat's `time` is when its observation of the sandboxes began, never later: the control plane drops a
crash or halt report about a record that changed after that time (api/node_routes._crash_reports), so a
beat stamped after its observation could turn a sandbox restored meanwhile into `crashed`."""

from __future__ import annotations

import time
from typing import Any

from space.node.agent.agent import NodeAgent
from space.node.agent.service import NodeService
from tests.support.fake_agent import agent, loop
from tests.support.loop import BackgroundLoop

__all__ = ["agent", "loop"]


def test_the_beat_is_stamped_before_its_observation(agent: NodeAgent, loop: BackgroundLoop) -> None:
    service = NodeService(agent)
    observed_at: list[float] = []
    observe = service.observe_all

    async def slow_observation(**kwargs: Any) -> Any:
        observed_at.append(time.time())
        result = await observe(**kwargs)
        time.sleep(0.2)  # a loaded node: the listing, then the disk reading, take time
        return result

    service.observe_all = slow_observation  # type: ignore[method-assign]
    beat = loop.run(service.heartbeat("node-test", "http://127.0.0.1:1"))
    assert observed_at and beat.time <= observed_at[0]
