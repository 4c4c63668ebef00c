"""Suspend / upload / restore / recover through the node RPC over the fake driver (fast, no root): the same
agent flow as on real nodes (artifact with manifest last, download and verify before import, idempotent
repeats, the configured-store check), two "nodes" sharing one local-directory object store."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.core.lifecycle import State
from space.crypto.envelope import DataKey
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.drivers.base import SandboxSpec
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from space.objectstore.artifacts import read_manifest, restorable
from space.objectstore.backends import open_store
from space.objectstore.local import LocalDirectoryStore
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop  # a fresh BackgroundLoop per test (not the session loop)

TOKEN = "test-token"


@dataclass
class FakeNode:
    agent: NodeAgent
    client: NodeClient


@pytest.fixture
def store_url(tmp_path: pathlib.Path) -> str:
    return (tmp_path / "objects").as_uri()


def _node(loop: BackgroundLoop, base: pathlib.Path, store_url: str) -> FakeNode:
    agent = NodeAgent(FakeDriver(base), store=open_store(store_url))
    loop.run(agent.prepare(templates=()))
    app = create_app(agent, TOKEN)
    transport = httpx.ASGITransport(app=app)
    return FakeNode(agent, NodeClient("http://node", TOKEN, transport=transport))


@pytest.fixture
def nodes(
    loop: BackgroundLoop, tmp_path: pathlib.Path, store_url: str
) -> Iterator[tuple[FakeNode, FakeNode]]:
    a, b = _node(loop, tmp_path / "a", store_url), _node(loop, tmp_path / "b", store_url)
    yield a, b
    for node in (a, b):
        loop.run(node.agent.delete_all())
        loop.run(node.client.aclose())
        loop.run(node.agent.close())


def _key() -> DataKey:
    return DataKey(key_id="key-1", wrapped=b"wrapped-by-the-tenant-key", plaintext=os.urandom(32))


def test_suspend_on_one_node_restore_on_another(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode], store_url: str
) -> None:
    a, b = nodes
    sid, snap, key = new_sandbox_id(), new_snapshot_id(), _key()
    prefix = f"sandboxes/{sid}/s1"

    async def scenario() -> None:
        await a.client.create_sandbox(sid, env={"K": "V"})
        await a.client.write_file(sid, "kept.bin", b"x" * 100_000)
        result = await a.client.suspend(
            sid, store_url=store_url, prefix=prefix, snapshot_id=snap, data_key=key
        )
        assert result.snapshot_id == snap and result.stored_bytes > 0
        assert (await a.client.get_sandbox(sid)).state == "suspended"
        again = await a.client.suspend(
            sid, store_url=store_url, prefix=prefix, snapshot_id=snap, data_key=key
        )
        assert again.stored_bytes == result.stored_bytes, "a repeated suspend returns the same artifact"
        manifest = read_manifest(open_store(store_url), prefix)
        assert manifest.encrypted and manifest.metadata["snapshot_id"] == snap

        with pytest.raises(errors.ArtifactCorrupt):  # the wrong data key: refused, nothing left behind
            await b.client.restore(sid, store_url=store_url, prefix=prefix, data_key=os.urandom(32))
        assert sid not in b.agent.sandboxes
        assert isinstance(b.agent.driver, FakeDriver)
        assert not any((b.agent.driver.base_dir / "staging").glob("*"))

        observed = await b.client.restore(
            sid, store_url=store_url, prefix=prefix, data_key=key.plaintext, env={"K": "V"}
        )
        assert observed.state == "running"
        assert await b.client.read_file(sid, "kept.bin") == b"x" * 100_000
        repeat = await b.client.restore(sid, store_url=store_url, prefix=prefix, data_key=key.plaintext)
        assert repeat.state == "running" and repeat.created_at == observed.created_at
        await a.client.delete_sandbox(sid)

    loop.run(scenario())


def test_requests_naming_another_store_are_refused(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode], tmp_path: pathlib.Path
) -> None:
    a, _b = nodes
    sid = new_sandbox_id()
    other = (tmp_path / "elsewhere").as_uri()

    async def scenario() -> None:
        await a.client.create_sandbox(sid)
        with pytest.raises(errors.InvalidArgument) as refused:
            await a.client.suspend(sid, store_url=other, prefix="x/y", snapshot_id=new_snapshot_id())
        assert refused.value.details.get("field") == "store_url"
        with pytest.raises(errors.InvalidArgument):
            await a.client.restore(sid, store_url=other, prefix="x/y")
        assert (await a.client.get_sandbox(sid)).state == "running", "a refused request touched nothing"
        with pytest.raises(errors.NotFound) as missing:  # nothing was ever written there
            await _b_restore(nodes, sid, tmp_path)
        assert "restorable" in missing.value.message

    loop.run(scenario())


async def _b_restore(nodes: tuple[FakeNode, FakeNode], sid: str, tmp_path: pathlib.Path) -> None:
    _a, b = nodes
    assert b.agent.store is not None
    await b.client.restore(sid, store_url=b.agent.store.url, prefix=f"sandboxes/{sid}/never")


def test_upload_of_an_existing_checkpoint_is_idempotent(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode], store_url: str
) -> None:
    a, b = nodes
    sid = new_sandbox_id()
    prefix = f"sandboxes/{sid}/c1"

    async def scenario() -> None:
        await a.client.create_sandbox(sid)
        await a.client.write_file(sid, "a.txt", b"before")
        snap = (await a.client.create_snapshot(sid, full=True)).snapshot_id
        first = await a.client.upload_snapshot(sid, snap, store_url=store_url, prefix=prefix)
        second = await a.client.upload_snapshot(sid, snap, store_url=store_url, prefix=prefix)
        assert first.stored_bytes == second.stored_bytes
        assert (await a.client.get_sandbox(sid)).state == "running", "upload leaves the sandbox running"
        with pytest.raises(errors.Conflict):  # the prefix holds another checkpoint
            other = (await a.client.create_snapshot(sid, full=True)).snapshot_id
            await a.client.upload_snapshot(sid, other, store_url=store_url, prefix=prefix)
        observed = await b.client.restore(sid, store_url=store_url, prefix=prefix)
        assert observed.state == "running"
        assert await b.client.read_file(sid, "a.txt") == b"before"

    loop.run(scenario())


def test_crashed_sandbox_recovers_from_its_newest_checkpoint(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode]
) -> None:
    a, _b = nodes
    sid = new_sandbox_id()

    async def scenario() -> None:
        await a.client.create_sandbox(sid)
        await a.client.write_file(sid, "a.txt", b"checkpointed")
        await a.client.create_snapshot(sid, full=True)
        await a.client.write_file(sid, "a.txt", b"after the checkpoint")
        with pytest.raises(errors.InvalidState):  # only a crashed (or failed) sandbox recovers
            await a.agent.recover_from_checkpoint(sid)
        driver = a.agent.driver
        assert isinstance(driver, FakeDriver)
        os.kill(driver.processes[sid].pid, signal.SIGKILL)
        for _ in range(200):
            if (await a.client.get_sandbox(sid)).state == "crashed":
                break
            await asyncio.sleep(0.01)
        assert (await a.client.get_sandbox(sid)).state == "crashed"
        observed = await a.client.recover(sid)
        assert observed.state == "running"
        assert await a.client.read_file(sid, "a.txt") == b"checkpointed"

    loop.run(scenario())


def test_restore_where_the_paused_source_is_kept_resumes_it(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode], store_url: str
) -> None:
    a, _b = nodes
    sid = new_sandbox_id()
    prefix = f"sandboxes/{sid}/s1"

    async def scenario() -> None:
        await a.client.create_sandbox(sid)
        await a.client.write_file(sid, "a.txt", b"kept")
        await a.client.suspend(sid, store_url=store_url, prefix=prefix, snapshot_id=new_snapshot_id())
        with pytest.raises(errors.InvalidState) as refused:  # a suspended sandbox serves nothing
            await a.client.read_file(sid, "a.txt")
        assert refused.value.state == "suspended"
        observed = await a.client.restore(sid, store_url=store_url, prefix=prefix)
        assert observed.state == "running"
        assert await a.client.read_file(sid, "a.txt") == b"kept"

    loop.run(scenario())


class _FailingStore(LocalDirectoryStore):
    """A local store whose next `fail` writes of a manifest fail (an object store outage mid-upload)."""

    fail = 0

    def put(self, key: str, data: bytes) -> None:
        if key.endswith("manifest.json") and self.fail > 0:
            self.fail -= 1
            raise errors.Unavailable("object store unavailable")
        super().put(key, data)


def test_failed_upload_leaves_the_sandbox_paused_and_a_repeat_finishes(
    loop: BackgroundLoop, nodes: tuple[FakeNode, FakeNode], tmp_path: pathlib.Path
) -> None:
    a, b = nodes
    sid, snap = new_sandbox_id(), new_snapshot_id()
    store = _FailingStore(tmp_path / "flaky")
    store.fail = 1
    prefix = f"sandboxes/{sid}/s1"

    async def scenario() -> None:
        handle = await a.agent.create(sandbox_id=sid)
        await handle.session.write_file("a.txt", b"kept")
        with pytest.raises(errors.Unavailable):
            await a.agent.suspend(sid, store=store, prefix=prefix, snapshot_id=snap, data_key=None)
        assert handle.state == State.PAUSED, "a failed suspend settles in paused (the lifecycle table)"
        assert (await a.agent.driver.state(sid)).runtime == "paused"
        assert not restorable(store, prefix), "no manifest: never restorable"
        result = await a.agent.suspend(sid, store=store, prefix=prefix, snapshot_id=snap, data_key=None)
        assert result["snapshot_id"] == snap and a.agent.get(sid).state == State.SUSPENDED
        spec = SandboxSpec(sid)
        restored = await b.agent.restore_from_store(sid, store=store, prefix=prefix, data_key=None, spec=spec)
        assert await restored.session.read_file("a.txt") == b"kept"

    loop.run(scenario())
