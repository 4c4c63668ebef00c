"""Two control planes on ONE PostgreSQL database, one fake node: the work is divided through leases, every
sandbox is created exactly once whichever API received it, and when one control plane is SIGKILLed in
the middle of a batch, the other finishes all of it (once the dead one's leases expire: LEASE_S)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from space.controlplane.reconciler.loop import LEASE_S
from tests.support import cluster as c
from tests.support import postgres

postgres_url = postgres.postgres_url

COUNT = 20


@pytest.fixture(scope="module")
def cluster(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    # The node reports to control plane 1, the survivor of the kill below: a node heartbeats to one
    # address only, so killing the one it reports to would also make it "lost" after 15 s.
    with c.start_fake_cluster(
        tmp_path_factory.mktemp("pg"), database_url=postgres.new_database(postgres_url), control_planes=2,
        node_reports_to=1,
    ) as made:  # fmt: skip
        assert made.store.dialect == "postgresql"
        yield made


def test_twenty_creates_through_two_control_planes_each_run_once(cluster: c.Cluster) -> None:
    clients = [cluster.http(cluster.admin_key, cp=i, timeout=120) for i in (0, 1)]
    start = threading.Barrier(COUNT)

    def create(i: int) -> tuple[int, dict[str, Any]]:
        start.wait(30)
        answer = clients[i % 2].post("/v1/sandboxes", json={"limits": c.SMALL, "env": {"I": str(i)}})
        return answer.status_code, answer.json()

    with ThreadPoolExecutor(COUNT) as pool:
        answers = list(pool.map(create, range(COUNT)))
    assert [status for status, _ in answers] == [201] * COUNT, answers
    ids = [body["id"] for _, body in answers]
    assert len(set(ids)) == COUNT
    assert all(body["state"] == "running" for _, body in answers), answers
    records = cluster.records()
    assert set(records) == set(ids)
    assert sorted(records[i].env["I"] for i in ids) == sorted(str(i) for i in range(COUNT))
    on_node = cluster.node.sandboxes()
    assert set(on_node) == set(ids)
    assert all(item["state"] == "running" for item in on_node.values())
    # Created exactly once on the node: one daemon each, and the node's creation time is the one it had
    # when the API answered (a second create would have replaced it or failed).
    assert cluster.node.guest_processes() == dict.fromkeys(ids, 1)
    created_at = {i: item["created_at"] for i, item in on_node.items()}
    cluster.wait_converged(10)
    assert {i: item["created_at"] for i, item in cluster.node.sandboxes().items()} == created_at
    # Both control planes did some of the work (the leases divided it): both have answered correctly above;
    # whichever reconciled, every record went pending -> creating -> running exactly once (generation 2).
    assert {records[i].generation for i in ids} == {2}, {i: records[i].generation for i in ids}


def test_the_survivor_finishes_a_batch_when_one_control_plane_dies(cluster: c.Cluster) -> None:
    ids = sorted(cluster.records())
    assert len(ids) == COUNT, "runs after the create test"
    clients = [cluster.http(cluster.admin_key, cp=i) for i in (0, 1)]
    victim = cluster.control_planes[0]
    owner = victim.owner

    def victim_is_working() -> list[str]:
        now = cluster.store.now()
        return [
            sb.id
            for sb in cluster.records().values()
            if sb.lease_owner == owner and sb.lease_until is not None and sb.lease_until > now
        ]

    # The node is frozen for a moment, so node calls in flight stay in flight: both control planes claim
    # part of the batch and wait on the node, and the victim is killed holding its part.
    cluster.node.signal(signal.SIGSTOP)
    try:
        for n, sandbox_id in enumerate(ids):
            answer = clients[n % 2].post(f"/v1/sandboxes/{sandbox_id}/pause", params={"wait": "false"})
            assert answer.status_code == 202, answer.text
        held = c.wait_for(victim_is_working, timeout=10, interval=0.01, what="the victim holding leases")
        victim.kill()
    finally:
        cluster.node.signal(signal.SIGCONT)
    killed = time.monotonic()
    stranded = victim_is_working()
    assert stranded, "the victim's leases outlive it"
    took = cluster.wait_converged(LEASE_S + 30)
    print(
        f"\nkilled control plane 0 holding {len(held)} leases ({len(stranded)} still held after the kill); "
        f"control plane 1 finished the batch {took:.1f}s later (LEASE_S={LEASE_S})"
    )
    assert all(sb.state == "paused" for sb in cluster.records().values())
    assert all(item["state"] == "paused" for item in cluster.node.sandboxes().values())
    assert time.monotonic() - killed < LEASE_S + 30
    # The survivor serves the API and the data plane for all of them (auto-resume included).
    with cluster.sdk(cp=1) as sp:
        assert sp.sandboxes.get(ids[0]).exec("echo ok").stdout == "ok\n"
        assert len(sp.sandboxes.list()) == COUNT
