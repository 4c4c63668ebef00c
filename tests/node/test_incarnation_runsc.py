"""Incarnations on a real gVisor node (docs/adr/0032-lost-nodes-and-incarnations.md): a create names its
incarnation, a delete naming another one is refused and the sandbox keeps running, the map is persisted in
the agent's private directory (which the root helper made for the agent's user), and the right incarnation
deletes the sandbox."""

from __future__ import annotations

import httpx
import pytest

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.agent.app import create_app
from space.node.agent.incarnations import Incarnations
from space.node.rpc_client import NodeClient

pytestmark = pytest.mark.root

TOKEN = "incarnation-runsc-node-token-0123"


def test_a_stale_delete_leaves_a_running_gvisor_sandbox_alone(node) -> None:  # type: ignore[no-untyped-def]
    sandbox_id = new_sandbox_id()
    path = node.agent.driver.state_file("incarnations.json")
    assert path is not None and path.parent.name == "identity"

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=create_app(node.agent, TOKEN))
        async with NodeClient("http://node", TOKEN, transport=transport) as client:
            observed, created = await client.create_sandbox(sandbox_id, incarnation=11)
            try:
                assert (observed.state, created) == ("running", True)
                await client.write_file(sandbox_id, "/work/kept.txt", b"kept")
                with pytest.raises(errors.Conflict) as refused:
                    await client.delete_sandbox(sandbox_id, incarnation=10)
                assert refused.value.details["reason"] == "stale_incarnation"
                assert refused.value.details["incarnation"] == 11
                result = await client.exec(sandbox_id, "cat /work/kept.txt")
                assert (result.exit_code, result.stdout) == (0, "kept")
                # What a restarted agent starts from: the persisted map, 0600 in the agent's own directory.
                assert Incarnations(path).get(sandbox_id) == 11
                assert path.stat().st_mode & 0o777 == 0o600
                assert path.stat().st_uid == path.parent.stat().st_uid
            finally:
                deleted = await client.delete_sandbox(sandbox_id, incarnation=11)
            assert deleted.existed
            with pytest.raises(errors.NotFound):
                await client.get_incarnation(sandbox_id)
        assert Incarnations(path).get(sandbox_id) is None

    node.run(scenario())
