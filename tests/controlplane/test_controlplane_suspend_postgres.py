"""Suspend and restore with two control planes on ONE PostgreSQL database (two fake nodes, one object store,
one shared key directory): the replica that started a suspend is SIGKILLed after the node's upload and the
other one finishes it once the dead one's lease expires; the restore asked from the survivor runs too.
The sandbox ends running on exactly one node, with exactly one artifact in the store."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from space.controlplane.reconciler.loop import LEASE_S
from space.controlplane.store.records import SandboxRecord
from space.core.lifecycle import State
from space.objectstore.backends import open_store
from tests.support import cluster as c
from tests.support import postgres

postgres_url = postgres.postgres_url

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def cluster(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    # The nodes report to control plane 1, the survivor: a node heartbeats to one address only.
    with c.start_fake_cluster(
        tmp_path_factory.mktemp("pg-suspend"), database_url=postgres.new_database(postgres_url),
        control_planes=2, node_reports_to=1, nodes=2, object_store=True,
    ) as made:  # fmt: skip
        assert made.store.dialect == "postgresql"
        yield made


def copies(cluster: c.Cluster, sandbox_id: str) -> list[str]:
    return [node.name for node in cluster.nodes if sandbox_id in node.sandboxes()]


def settled(cluster: c.Cluster, sandbox_id: str, state: State) -> SandboxRecord | None:
    sb = cluster.store.load_sandbox(sandbox_id)
    assert sb is not None
    return sb if sb.state == state and sb.desired_state == state else None


def test_a_replica_dies_mid_suspend_and_the_other_finishes(cluster: c.Cluster) -> None:
    first = cluster.control_planes[0]
    with cluster.sdk(cp=0) as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"across replicas")
    try:
        first.kill()
        first.extra_env = {"SPACE_FAILPOINTS": "suspend.uploaded"}
        first.start_and_wait()
        answer = cluster.http(cluster.admin_key, cp=0).post(
            f"/v1/sandboxes/{sb.id}/suspend", params={"wait": "false"}
        )
        assert answer.status_code == 202, answer.text
        c.wait_for(lambda: not first.alive, timeout=60, interval=0.05, what="replica 0 killed mid-suspend")
        assert cluster.store.load_sandbox(sb.id).state == State.SUSPENDING  # type: ignore[union-attr]
        done = c.wait_for(
            lambda: settled(cluster, sb.id, State.SUSPENDED), timeout=LEASE_S + 60, interval=0.1,
            what="suspended by replica 1",
        )  # fmt: skip
        assert done is not None and done.lease_owner in (None, cluster.control_planes[1].owner)
        c.wait_for(lambda: copies(cluster, sb.id) == [], timeout=30, interval=0.2, what="node copy freed")
        with cluster.sdk(cp=1) as sp:
            back = sp.sandboxes.get(sb.id).restore()
            assert back.state == "running"
            assert back.files.read("f") == b"across replicas"
        assert len(copies(cluster, sb.id)) == 1
        assert cluster.store_url is not None
        keys = open_store(cluster.store_url).list(f"sandboxes/{done.project_id}/{sb.id}/")
        assert keys and {k.split("/")[3] for k in keys} == {done.suspended_snapshot_id}
    finally:
        first.kill()
        first.extra_env = {}
        with contextlib.suppress(httpx.HTTPError, AssertionError):
            first.start_and_wait()
        with cluster.sdk(cp=1) as sp:
            sp.sandboxes.get(sb.id).delete()
