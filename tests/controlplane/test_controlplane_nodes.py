"""Node registration and loss: a node that stops heartbeating (SIGSTOP: hung, not dead) is marked lost once
its last heartbeat is older than the threshold (housekeeping: `store.mark_lost(node_lost_after_s)`), the
scheduler places nothing on it meanwhile, and when it comes back (SIGCONT) it is ready again and the work
resumes. The threshold is a setting: these clusters use LOST_AFTER_S (production 15 s) so the wait is short;
the fake driver's node does not fence itself, so a short lease changes nothing else."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from tests.support import cluster as c

LOST_AFTER_S = 6.0  # the control plane's SPACE_NODE_LOST_AFTER_S (housekeeping: store.mark_lost)
FENCE_GRACE_S = 2.0  # must stay below LOST_AFTER_S (settings validation)
HOUSEKEEPING_S = 1.0
HEARTBEAT_S = 2.0  # node agent: HEARTBEAT_INTERVAL_S


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    """The module's own cluster (its tests restart, stop and continue its node; each leaves it ready)."""
    env = {"SPACE_NODE_LOST_AFTER_S": str(LOST_AFTER_S), "SPACE_FENCE_GRACE_S": str(FENCE_GRACE_S)}
    with c.start_fake_cluster(tmp_path_factory.mktemp("nodes"), control_plane_env=env) as made:
        yield made


def status(cluster: c.Cluster) -> str:
    record = cluster.node_record()
    assert record is not None
    return record.status


def test_registration_reports_capacity_and_templates(cluster: c.Cluster) -> None:
    nodes = cluster.store.list_nodes(None)
    assert [n.url for n in nodes] == [cluster.node.url]
    node = nodes[0]
    assert node.status == "ready" and "python" in node.templates
    assert node.capacity["cpus"] > 0 and node.capacity["memory_mb"] > 0 and node.capacity["sandboxes"] > 0
    # Heartbeats keep coming (bounded wait for the next one).
    first = node.last_heartbeat_at
    c.wait_for(
        lambda: cluster.node_record().last_heartbeat_at > first,  # type: ignore[union-attr]
        timeout=3 * HEARTBEAT_S,
        what="a newer heartbeat",
    )
    # A restarted node agent registers again under the same id.
    cluster.node.stop()
    cluster.node.start()
    c.wait_for(lambda: cluster.node_record().last_heartbeat_at > first, timeout=30, what="re-registered")  # type: ignore[union-attr]
    assert [n.id for n in cluster.store.list_nodes(None)] == [node.id]


def test_a_hung_node_is_marked_lost_and_comes_back(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        before = sp.sandboxes.create(limits=c.SMALL)
        cluster.node.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            bound = LOST_AFTER_S + HEARTBEAT_S + 2 * HOUSEKEEPING_S + 5
            try:
                c.wait_for(lambda: status(cluster) == "lost", timeout=bound, interval=0.2, what="node lost")
            except AssertionError:
                pytest.fail(
                    f"the node was not marked lost {bound:.0f}s after its heartbeats stopped (threshold "
                    f"{LOST_AFTER_S:.0f}s); last heartbeat {cluster.node_record().last_heartbeat_at}, "  # type: ignore[union-attr]
                    f"now {cluster.store.now()}\n{cluster.logs()}"
                )
            lost_after = time.monotonic() - stopped
            record = cluster.node_record()
            assert record is not None
            silence = (cluster.store.now() - record.last_heartbeat_at).total_seconds()
            assert silence >= LOST_AFTER_S, f"marked lost after only {silence:.1f}s without a heartbeat"
            # Nothing is placed on a lost node: a new sandbox waits.
            waiting = sp.sandboxes.create(limits=c.SMALL, wait=False)

            def refused() -> str | None:
                record = cluster.store.load_sandbox(waiting.id)
                assert record is not None and record.node_id is None, record
                return record.error if record.error and "no ready node" in record.error else None

            c.wait_for(refused, timeout=10, what="the scheduler refusing the lost node")
        finally:
            cluster.node.signal(signal.SIGCONT)
        c.wait_for(lambda: status(cluster) == "ready", timeout=3 * HEARTBEAT_S + 5, what="node ready again")
        print(f"\nmarked lost {lost_after:.1f}s after SIGSTOP; ready again after SIGCONT")
        c.wait_for(
            lambda: waiting.refresh().state == "running", timeout=30, what="the waiting sandbox placed"
        )
        assert waiting.exec("echo placed").stdout == "placed\n"
        assert before.exec("echo survived").stdout == "survived\n"
    cluster.wait_converged(10)
