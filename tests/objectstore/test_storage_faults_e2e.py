"""Suspend and restore through the faulty S3 proxy, end to end through the node RPC (fake driver, fast):
two node agents whose store URL points at the proxy (tests/support/s3faults.py) in front of the S3
server. Each round suspends a sandbox on node A (artifact upload) and restores it on node B (download,
verify, import) while the proxy drops connections, answers 5xx, slows, truncates and flips bits.

Properties: a suspend either succeeds (and the server then holds an artifact that verifies) or fails with
a typed error and leaves nothing restorable; a restore either brings back exactly the written files or
fails with a typed error (and is simply asked again, as the reconciler would); never a corrupt restore.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.crypto.envelope import DataKey
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from space.objectstore.artifacts import read_manifest, restorable, verify
from space.objectstore.backends import open_store
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop
from tests.support.s3faults import FaultSchedule, FaultyProxy
from tests.support.s3server import REGION, S3Server

loop = fake_agent.loop  # a fresh BackgroundLoop per test

BUCKET = "space-faults"
TOKEN = "test-token"
ROUNDS = 2
ATTEMPTS = 4  # restore requests per round before the round counts as failed


def _url(endpoint: str, prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint={endpoint}&region={REGION}"


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultyProxy]:
    s3_server.create_bucket(BUCKET)
    with FaultyProxy(s3_server.endpoint, FaultSchedule(11, 0.4)) as made:
        yield made


def _node(loop: BackgroundLoop, base: pathlib.Path, store_url: str) -> tuple[NodeAgent, NodeClient]:
    agent = NodeAgent(FakeDriver(base), store=open_store(store_url))
    loop.run(agent.prepare(templates=()))
    transport = httpx.ASGITransport(app=create_app(agent, TOKEN))
    return agent, NodeClient("http://node", TOKEN, transport=transport)


def test_suspend_and_restore_through_a_faulty_store(
    loop: BackgroundLoop, proxy: FaultyProxy, s3_server: S3Server, tmp_path: pathlib.Path
) -> None:
    root = f"e2e-{uuid.uuid4().hex[:10]}"
    store_url = _url(proxy.endpoint, root)
    clean = open_store(_url(s3_server.endpoint, root))
    (agent_a, a), (agent_b, b) = (
        _node(loop, tmp_path / "a", store_url),
        _node(loop, tmp_path / "b", store_url),
    )
    outcomes: Counter[str] = Counter()

    async def one_round(round_no: int) -> None:
        sid, snap = new_sandbox_id(), new_snapshot_id()
        key = DataKey("key-1", b"wrapped", os.urandom(32))
        prefix = f"sandboxes/{sid}/s1"
        content = os.urandom(150_000 + round_no)
        await a.create_sandbox(sid)
        await a.write_file(sid, "kept.bin", content)
        try:
            await a.suspend(sid, store_url=store_url, prefix=prefix, snapshot_id=snap, data_key=key)
        except errors.SpaceError:
            outcomes["suspend failed (typed)"] += 1
            assert not restorable(clean, prefix), "a failed suspend left a manifest"
            await a.delete_sandbox(sid)
            return
        outcomes["suspended"] += 1
        verify(clean, read_manifest(clean, prefix), data_key=key.plaintext)  # what the server holds is whole
        for _attempt in range(ATTEMPTS):
            try:
                observed = await b.restore(sid, store_url=store_url, prefix=prefix, data_key=key.plaintext)
            except errors.SpaceError:
                outcomes["restore failed (typed), asked again"] += 1
                assert sid not in agent_b.sandboxes, "a failed restore left a sandbox behind"
                continue
            assert observed.state == "running"
            got = await b.read_file(sid, "kept.bin")
            outcomes["restored exactly" if got == content else "CORRUPT"] += 1
            await b.delete_sandbox(sid)
            break
        await a.delete_sandbox(sid)

    try:
        for round_no in range(ROUNDS):
            loop.run(one_round(round_no), timeout=300)
    finally:
        for agent, client in ((agent_a, a), (agent_b, b)):
            loop.run(agent.delete_all())
            loop.run(client.aclose())
            loop.run(agent.close())
        clean.delete_prefix("")
        clean.close()
    faults = proxy.counts()
    print(f"\nsuspend/restore through faults: {dict(outcomes)}; faults {dict(faults)}")
    assert outcomes["CORRUPT"] == 0, outcomes
    assert outcomes["restored exactly"] >= 1 and sum(faults.values()) >= 5, (outcomes, faults)
