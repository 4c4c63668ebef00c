"""The user-facing finding of issue 11, reproduced through real components (a control plane and two node
agents as subprocesses, fake driver): a node agent restarted keeps its node id and a create right after the
restart works; a sandbox whose create was sent to a node that then hangs is re-placed on another node as
soon as that node is marked lost (docs/adr/0032-lost-nodes-and-incarnations.md), and the copy the hung node
made late is collected by its incarnation when it wakes."""

from __future__ import annotations

import pathlib
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support import cluster as c

LOST_AFTER_S = 8.0  # (default 15 s) a node's fencing lease is this less FENCE_GRACE_S (ADR 0033)
FENCE_GRACE_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    root: pathlib.Path = tmp_path_factory.mktemp("restart")
    env = {"SPACE_NODE_LOST_AFTER_S": str(LOST_AFTER_S), "SPACE_FENCE_GRACE_S": str(FENCE_GRACE_S)}
    with c.start_fake_cluster(root, nodes=2, control_plane_env=env) as made:
        yield made


def node_id(cluster: c.Cluster, node: c.FakeNode) -> str:
    return next(n.id for n in cluster.store.list_nodes(None) if n.url == node.url)


def test_a_create_right_after_a_node_restart_works_and_the_node_keeps_its_id(cluster: c.Cluster) -> None:
    a, b = cluster.node, cluster.more_nodes[0]
    ids = sorted(n.id for n in cluster.store.list_nodes(None))
    a_id, b_id = node_id(cluster, a), node_id(cluster, b)
    cluster.store.set_node_status(b_id, "draining")  # the restarted node is the only place to go
    try:
        a.stop()
        a.start()
        started = time.monotonic()
        with cluster.sdk() as sp:
            try:
                sandbox = sp.sandboxes.create(limits=c.SMALL)  # at once, as `space up` users do
            except Exception as exc:
                records = cluster.store.list_sandboxes(cluster.project_id)
                nodes = cluster.store.list_nodes(None)
                pytest.fail(f"create after a restart: {exc}\n{records}\n{nodes}\n{cluster.logs()}")
            took = time.monotonic() - started
            assert sandbox.exec("echo up").stdout == "up\n"
            record = cluster.store.load_sandbox(sandbox.id)
            assert record is not None and record.node_id == a_id
            sandbox.delete()
    finally:
        cluster.store.set_node_status(b_id, "ready")
    print(f"\ncreate right after a node agent restart: running after {took:.1f}s")
    assert took < 30.0, f"the create took {took:.1f}s"
    assert sorted(n.id for n in cluster.store.list_nodes(None)) == ids  # no new node record
    cluster.wait_converged(30)


def test_a_sandbox_creating_on_a_node_marked_lost_is_placed_elsewhere(cluster: c.Cluster) -> None:
    a, b = cluster.node, cluster.more_nodes[0]
    a_id, b_id = node_id(cluster, a), node_id(cluster, b)
    cluster.store.set_node_status(b_id, "draining")  # the create goes to A...
    a.signal(signal.SIGSTOP)  # ...which hangs right then: its create never answers
    hung = time.monotonic()
    try:
        with cluster.sdk() as sp:
            sandbox = sp.sandboxes.create(limits=c.SMALL, wait=False)

            def creating_on_a() -> bool:
                record = cluster.store.load_sandbox(sandbox.id)
                return record is not None and record.state == "creating" and record.node_id == a_id

            c.wait_for(creating_on_a, timeout=20, what="the create sent to node A")
            cluster.store.set_node_status(b_id, "ready")

            def running_on_b() -> bool:
                record = cluster.store.load_sandbox(sandbox.id)
                return record is not None and record.state == "running" and record.node_id == b_id

            c.wait_for(running_on_b, timeout=LOST_AFTER_S + 30, interval=0.2, what="re-placed on node B")
            replaced = time.monotonic() - hung
            assert sandbox.exec("echo moved").stdout == "moved\n"
            node_a = next(n for n in cluster.store.list_nodes(None) if n.id == a_id)
            assert node_a.status == "lost"
            events = cluster.store.list_events(sandbox.id)
            replanned = [e for e in events if e.kind == "step.replanned"]
            assert replanned and replanned[0].detail["from"] == "creating"
            assert replanned[0].detail["node_id"] == a_id
    finally:
        a.signal(signal.SIGCONT)
        cluster.store.set_node_status(b_id, "ready")
    print(f"\ncreating on a hung node: running on another node {replaced:.1f}s after it hung")
    # Node A wakes and answers the create it was sent: that late copy (the old incarnation) is collected.
    c.wait_for(lambda: sandbox.id not in a.sandboxes(), timeout=60, interval=0.5, what="A's copy collected")
    assert sandbox.id in b.sandboxes()
    with cluster.sdk() as sp:
        sp.sandboxes.get(sandbox.id).delete()
    cluster.wait_converged(30)
