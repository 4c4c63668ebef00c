"""A restore from object storage alone knows the runtime its checkpoint needs (ADR 0035), over the fake
driver through the node RPC: the manifest of every uploaded checkpoint names it, and a node whose runtime
differs refuses the restore with `runtime_incompatible` (409) naming the difference, before it downloads
anything; the node reports its runtime in its info."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import httpx
import pytest

from space.core import errors, runtimes
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.service_core import ServiceCore
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from space.objectstore.artifacts import read_manifest
from space.objectstore.backends import open_store
from space.rest.errors import STATUS_BY_CODE
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop

TOKEN = "test-token"


@pytest.fixture
def pair(
    loop: BackgroundLoop, tmp_path: pathlib.Path
) -> Iterator[tuple[NodeAgent, NodeClient, NodeAgent, NodeClient, str]]:
    store_url = (tmp_path / "objects").as_uri()
    made = []
    for name in ("a", "b"):
        agent = NodeAgent(FakeDriver(tmp_path / name), store=open_store(store_url))
        loop.run(agent.prepare(templates=()))
        client = NodeClient("http://node", TOKEN, transport=httpx.ASGITransport(app=create_app(agent, TOKEN)))
        made.append((agent, client))
    (a, ca), (b, cb) = made
    yield a, ca, b, cb, store_url
    for agent, client in made:
        loop.run(agent.delete_all())
        loop.run(client.aclose())
        loop.run(agent.close())


def test_the_manifest_names_the_runtime_and_another_runtime_refuses(loop: BackgroundLoop, pair) -> None:  # type: ignore[no-untyped-def]
    a, ca, b, cb, store_url = pair
    sid, snap = new_sandbox_id(), new_snapshot_id()
    prefix = f"sandboxes/{sid}/s1"
    assert a.node_runtime() == runtimes.describe("fake")
    assert ServiceCore(a).info().runtime == runtimes.describe("fake")

    async def scenario() -> None:
        await ca.create_sandbox(sid)
        await ca.suspend(sid, store_url=store_url, prefix=prefix, snapshot_id=snap)
        manifest = read_manifest(open_store(store_url), prefix)
        assert manifest.metadata["runtime"] == runtimes.describe("fake")

        b._runtime = runtimes.describe("runsc", platform="ptrace", network="none")  # another kind of node
        with pytest.raises(errors.RuntimeIncompatible) as refused:
            await cb.restore(sid, store_url=store_url, prefix=prefix)
        assert refused.value.details["field"] == "driver"
        assert "isolation driver 'fake'" in refused.value.details["reason"]
        assert STATUS_BY_CODE[refused.value.code] == 409
        assert sid not in b.sandboxes
        assert isinstance(b.driver, FakeDriver) and not any((b.driver.base_dir / "staging").glob("*"))

        b._runtime = None  # the fake node again: the same artifact restores
        observed = await cb.restore(sid, store_url=store_url, prefix=prefix)
        assert observed.state == "running"
        await ca.delete_sandbox(sid)

    loop.run(scenario())
