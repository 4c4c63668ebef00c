"""Placement of restores and recoveries by runtime (ADR 0035): nodes report their runtime with their
heartbeat, a full checkpoint's row records the runtime of the node that took it, and the scheduler sends a
sandbox that comes back from a checkpoint only to a node whose runtime can restore it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from space.controlplane.scheduler import choose_node
from space.controlplane.store import Store, open_store, sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.core import errors, runtimes
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits
from tests.support import cluster as c
from tests.support import node_identity as ni

PTRACE = runtimes.describe("runsc", platform="ptrace", network="sandbox", runtime_version="0.0~20240729.0")
SYSTRAP = runtimes.describe("runsc", platform="systrap", network="sandbox", runtime_version="0.0~20240729.0")
CAPACITY = {"cpus": 8.0, "memory_mb": 16384, "sandboxes": 100}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    with open_store(sqlite_url(tmp_path)) as opened:
        yield opened


def _node(store: Store, name: str, runtime: dict[str, str | None] | None, memory_used: int = 0) -> str:
    node = store.register_node(f"http://{name}.test:1", "t" * 32, capacity=CAPACITY)
    store.heartbeat(node.id, used={"memory_mb": memory_used, "sandboxes": 0, "cpus": 0}, runtime=runtime)
    return node.id


def _recovering(store: Store, node_id: str) -> tuple[SandboxRecord, str]:
    """A sandbox that crashed on `node_id` and now recovers from a full checkpoint taken there."""
    org = store.create_org("o")
    project = store.create_project(org.id, "p")
    sb = store.create_sandbox(project.id, "python", {}, SandboxLimits())
    sb = store.transition(sb.id, State.PENDING, sb.generation, Event.CREATE, node_id=node_id)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATED)
    snap = store.create_snapshot(sb.id, "full", node_id)
    store.mark_snapshot_ready(snap.id, 1)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CRASH)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.RECOVER, recovered_from=snap.id, node_id=None)
    return sb, snap.id


def test_heartbeats_record_the_runtime_and_checkpoints_copy_their_nodes(store: Store) -> None:
    node = _node(store, "a", PTRACE)
    assert store.get_node(node) is not None and store.get_node(node).runtime == PTRACE  # type: ignore[union-attr]
    _sb, snap_id = _recovering(store, node)
    snap = store.get_snapshot(snap_id)
    assert snap is not None and snap.runtime == PTRACE
    # A heartbeat without a runtime keeps the one reported before.
    store.heartbeat(node, used={})
    assert store.get_node(node).runtime == PTRACE  # type: ignore[union-attr]


def test_a_recovery_goes_only_to_a_node_that_can_restore_its_checkpoint(store: Store) -> None:
    source = _node(store, "a", PTRACE, memory_used=15000)  # the fitting node has the least room
    other = _node(store, "b", SYSTRAP)
    sb, _snap = _recovering(store, source)
    assert choose_node(store, sb) == source
    store.set_node_status(source, "lost")
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)
    assert "gVisor platform 'ptrace'" in caught.value.message and other in caught.value.message
    assert caught.value.details["reason"] == "no_compatible_runtime"


def test_nodes_that_never_reported_a_runtime_stay_candidates(store: Store) -> None:
    source = _node(store, "a", PTRACE)
    legacy = _node(store, "b", None)
    sb, _snap = _recovering(store, source)
    store.set_node_status(source, "lost")
    assert choose_node(store, sb) == legacy


def test_placements_that_restore_nothing_are_not_filtered(store: Store) -> None:
    _node(store, "b", SYSTRAP)
    org = store.create_org("o")
    project = store.create_project(org.id, "p")
    fresh = store.create_sandbox(project.id, "python", {}, SandboxLimits())
    assert choose_node(store, fresh)


fake_cluster = c.fake_cluster


def test_a_real_node_reports_its_runtime_and_its_checkpoints_carry_it(fake_cluster: c.Cluster) -> None:
    """Through the real heartbeat route: the fake node reports the fake driver's descriptor, a full
    checkpoint's row records it, and a heartbeat with an unreadable runtime is no report (kept as it was)."""
    fake = runtimes.describe("fake")
    c.wait_for(lambda: (fake_cluster.node_record() or None) and fake_cluster.node_record().runtime == fake,  # type: ignore[union-attr]
               timeout=15, what="the node's runtime recorded")  # fmt: skip
    project = c.new_project(fake_cluster)
    try:
        with project.sdk() as sp:
            sb = sp.sandboxes.create(limits=c.SMALL)
            snap = sb.snapshots.create(full=True)
        row = fake_cluster.store.get_snapshot(snap.id)
        assert row is not None and row.runtime == fake
        with ni.as_node(fake_cluster) as (node_id, identity):
            for hostile in ({"driver": "x" * 10_000}, "runsc", [1, 2], {"driver": "runsc", "platform": 7}):
                answer = ni.client(fake_cluster, identity).post(
                    f"/v1/nodes/{node_id}/heartbeat",
                    json={"sandboxes": [], "templates": ["python"], "runtime": hostile},
                )
                assert answer.status_code == 200, answer.text
                assert fake_cluster.node_record().runtime == fake  # type: ignore[union-attr]
    finally:
        c.delete_all(fake_cluster, project)
