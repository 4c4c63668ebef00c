"""The snapshot scheduler under a storage budget (ADR 0027), over the in-memory control-plane world of
test_controlplane_suspend_logic: a scheduled snapshot the node refuses for lack of budget is made to fit by
deleting the oldest prunable snapshots (never a user's, never the newest full checkpoint), and when nothing
prunable would free enough, nothing is deleted and the sandbox's notice says why."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from space.core import errors, retention
from space.core.ids import new_snapshot_id
from space.node.agent import rpc_models as rm
from tests.support.reconciler_world import FakeNodeApi, World

MiB = 1 << 20
SIZE = 10 * MiB  # what every snapshot costs on the budgeted fake node


class BudgetedNode:
    """Wraps a FakeNodeApi: every snapshot costs SIZE, and the node refuses one that would go over."""

    def __init__(self, api: FakeNodeApi, budget: int) -> None:
        self.api, self.budget = api, budget
        self.refusals = 0

    def used(self, sandbox_id: str) -> int:
        return SIZE * len(self.api.sandboxes[sandbox_id]["snapshots"])

    async def create_snapshot(self, sandbox_id: str, *, full: bool = False) -> rm.SnapshotInfo:
        used = self.used(sandbox_id)
        if used + SIZE > self.budget:
            self.refusals += 1
            raise errors.StorageExhausted(
                "over budget", reason="storage_budget", used_bytes=used, needed_bytes=SIZE,
                budget_bytes=self.budget, sandbox_id=sandbox_id,
            )  # fmt: skip
        snapshot_id = new_snapshot_id()
        sb = self.api.sandboxes[sandbox_id]
        sb["snapshots"][snapshot_id] = {"kind": "full" if full else "disk", "files": dict(sb["files"])}
        return rm.SnapshotInfo(
            snapshot_id=snapshot_id, sandbox_id=sandbox_id, kind="full" if full else "disk",
            created_at=time.time(), image_bytes=SIZE,
        )  # fmt: skip

    async def list_snapshots(self, sandbox_id: str) -> list[rm.SnapshotInfo]:
        return [
            rm.SnapshotInfo(
                snapshot_id=i, sandbox_id=sandbox_id, kind=s["kind"], created_at=0, image_bytes=SIZE
            )
            for i, s in self.api.sandboxes[sandbox_id]["snapshots"].items()
        ]


@pytest.fixture
def world(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    monkeypatch.setattr(retention, "_minimums", retention.MinimumIntervals(disk_s=1, full_s=1))
    made = World(tmp_path)
    try:
        yield made
    finally:
        made.close()


def budgeted(world: World, node_id: str, budget: int, monkeypatch: pytest.MonkeyPatch) -> BudgetedNode:
    api = world.api[node_id]
    node = BudgetedNode(api, budget)
    monkeypatch.setattr(api, "create_snapshot", node.create_snapshot)
    monkeypatch.setattr(api, "list_snapshots", node.list_snapshots)
    return node


def backdate(world: World, snapshot_id: str, seconds: float) -> None:
    """Move a snapshot's row into the past (so 'oldest' is unambiguous and the policy is due)."""
    from space.controlplane.store.models import Snapshot

    with world.store._tx("backdating") as session:
        row = session.get(Snapshot, snapshot_id)
        assert row is not None
        row.created_at = row.created_at - timedelta(seconds=seconds)


def test_a_scheduled_snapshot_prunes_the_oldest_to_fit(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    sb = world.running_sandbox()
    assert sb.node_id is not None
    node = budgeted(world, sb.node_id, 4 * SIZE, monkeypatch)
    keeper = world.keeper
    user = asyncio.run(keeper.take(sb, full=False, origin="user"))
    full = asyncio.run(keeper.take(sb, full=True))  # the newest full checkpoint: never pruned
    old = [asyncio.run(keeper.take(sb, full=False)) for _ in range(2)]
    for age, snap in zip((400, 300, 200, 100), (user, full, *old), strict=True):
        backdate(world, snap.id, age)
    world.store.update_observed(
        sb.id, snapshot_policy={"disk_every_s": 1, "tiers": [{"every_s": 1, "for_s": 9999}]}
    )
    sb = world.store.load_sandbox(sb.id)  # type: ignore[assignment]
    assert sb is not None
    taken = asyncio.run(keeper.take_fitting(sb, full=False))
    assert taken is not None and node.refusals == 1
    kept = {s.id for s in world.store.list_snapshots(sb.id, include_deleting=True)}
    assert kept == {user.id, full.id, old[1].id, taken.id}, "only the oldest prunable one went"
    assert set(world.api[sb.node_id].sandboxes[sb.id]["snapshots"]) == kept, "gone from the node at once"


def test_when_nothing_prunable_frees_enough_nothing_is_deleted_and_the_sandbox_says_why(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = world.running_sandbox()
    assert sb.node_id is not None
    node = budgeted(world, sb.node_id, 2 * SIZE, monkeypatch)
    keeper = world.keeper
    users = [asyncio.run(keeper.take(sb, full=False, origin="user")) for _ in range(2)]
    world.store.update_observed(sb.id, snapshot_policy={"disk_every_s": 1})
    assert asyncio.run(keeper.run_policies()) == 0
    kept = {s.id for s in world.store.list_snapshots(sb.id, include_deleting=True)}
    assert kept == {u.id for u in users}, "a user's snapshots are never pruned to fit"
    after = world.store.load_sandbox(sb.id)
    assert after is not None and after.notice is not None
    assert after.notice.startswith("scheduled snapshots paused") and "over budget" in after.notice
    # It backs off instead of asking the node every second.
    refusals = node.refusals
    assert asyncio.run(keeper.run_policies()) == 0
    assert node.refusals == refusals
    # Room again (the user deleted a snapshot) and the back-off over: it resumes and clears the notice.
    asyncio.run(world.api[sb.node_id].delete_snapshot(sb.id, users[0].id))
    world.store.delete_snapshot(users[0].id)
    world.store.purge_snapshot(users[0].id)
    keeper._full_until.clear()
    assert asyncio.run(keeper.run_policies()) == 1
    cleared = world.store.load_sandbox(sb.id)
    assert cleared is not None and cleared.notice is None


def test_max_retained_keeps_the_newest_prunable(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    sb = world.running_sandbox()
    keeper = world.keeper
    user = asyncio.run(keeper.take(sb, full=False, origin="user"))
    scheduled = [asyncio.run(keeper.take(sb, full=False)) for _ in range(5)]
    for age, snap in enumerate(reversed(scheduled)):
        backdate(world, snap.id, 10 * (age + 1))
    policy: dict[str, Any] = {
        "disk_every_s": 3600,
        "max_retained": 2,
        "tiers": [{"every_s": 1, "for_s": 9999}],
    }
    dropped = asyncio.run(keeper.prune(sb, retention.SnapshotPolicy.model_validate(policy)))
    assert sorted(dropped) == sorted(s.id for s in scheduled[:3])
    left = {s.id for s in world.store.list_snapshots(sb.id)}
    assert left == {user.id, scheduled[3].id, scheduled[4].id}
