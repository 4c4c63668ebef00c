"""The node's `PUT /node/v1/sandboxes/{id}/egress` (policy pushes from the control plane), over a real uvicorn
with the fake driver and no egress wiring (network "none"): recorded per sandbox, stale versions ignored, the
answer says it was not applied, 404 for a sandbox the node does not run. (With network "sandbox" the route
hands the policy to space.node.agent.egress_wiring, tested with the gateway.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from tests.support.loop import BackgroundLoop
from tests.support.node_rpc import TOKEN, Rpc, serve_in


@pytest.fixture(scope="module")
def rpc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rpc]:
    loop = BackgroundLoop()
    agent = NodeAgent(FakeDriver(tmp_path_factory.mktemp("node")))
    loop.run(agent.prepare())
    app = create_app(agent, TOKEN)
    server, future, url = serve_in(loop, app)

    async def make_client() -> NodeClient:
        return NodeClient(url, TOKEN)

    client = loop.run(make_client())
    try:
        yield Rpc(loop, agent, url, client, None)  # type: ignore[arg-type]
    finally:
        loop.run(client.aclose())
        server.should_exit = True
        future.result(15)
        loop.run(agent.delete_all())
        loop.run(agent.close())
        loop.close()


def test_policy_push_is_recorded_without_a_gateway(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    push = rpc.client.set_egress
    answer: dict[str, Any] = rpc.run(
        push(sandbox_id, {"allow": ["a.example.com"], "deny": [], "version": 2}, ["k"])
    )
    assert answer["applied"] is False and "gateway" in answer["reason"]
    stale = rpc.run(push(sandbox_id, {"allow": [], "deny": [], "version": 1}, []))
    assert stale == {"applied": False, "reason": "stale", "version": 2}

    with pytest.raises(errors.NotFound):
        rpc.run(push(new_sandbox_id(), {"allow": [], "deny": [], "version": 1}, []))
