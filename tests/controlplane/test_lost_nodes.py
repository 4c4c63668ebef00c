"""No sandbox waits on a node that is gone (docs/adr/0032-lost-nodes-and-incarnations.md): the scheduler
chooses only ready nodes with a fresh heartbeat; every in-progress step on a lost or offline node is
re-planned each round (creating -> pending and placed elsewhere, restoring -> suspended and restored
elsewhere, live steps -> crashed and recovered from the newest uploaded checkpoint, or crashed until the
node returns), with a sandbox event for each move; deletes and orphan sweeps name the incarnation they mean.

The control plane's reconciler and store are real (SQLite, a local object store, real artifacts and keys);
the nodes are the in-memory FakeNodeApi of tests/support/reconciler_world.py, which keeps incarnations the
way the node agent does (tests/node/test_incarnation.py tests the agent itself)."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from space.controlplane import scheduler
from space.controlplane.snapshots import report_lost_node_crashes
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import open_store
from space.core import errors
from space.core.lifecycle import IN_PROGRESS_STATES, Event, State
from tests.support.reconciler_world import Killed, World


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One migrated, empty database for the module: each test starts from a copy (migrating is slow)."""
    root = tmp_path_factory.mktemp("migrated")
    open_store(sqlite_url(root / "db")).close()
    return root / "db"


@pytest.fixture
def world(tmp_path: pathlib.Path, migrated: pathlib.Path) -> Iterator[World]:
    shutil.copytree(migrated, tmp_path / "db")
    made = World(tmp_path)
    yield made
    made.close()


def replan(world: World) -> list[str]:
    return asyncio.run(report_lost_node_crashes(world.reconciler))


def lose(world: World, node_id: str, status: Any = "lost") -> None:
    """The node is gone: the control plane marked it (lost or offline) and nothing reaches it."""
    world.store.set_node_status(node_id, status)
    world.pool.nodes.pop(node_id, None)


def come_back(world: World, node_id: str) -> None:
    world.pool.nodes[node_id] = world.api[node_id]
    world.store.heartbeat(node_id, used={})


def other(world: World, node_id: str | None) -> str:
    return next(n for n in world.node_ids if n != node_id)


def begin(world: World, sb: SandboxRecord, event: Event, **fields: Any) -> SandboxRecord:
    """A step begun (its in-progress state recorded) whose control plane died before the node answered."""
    return world.store.transition(sb.id, sb.state, sb.generation, event, **fields)


def kinds(world: World, sandbox_id: str) -> list[str]:
    return [e.kind for e in world.store.list_events(sandbox_id)]


def settled(world: World, sandbox_id: str) -> SandboxRecord:
    sb = world.run(sandbox_id, rounds=10)
    assert sb.state not in IN_PROGRESS_STATES, sb
    return sb


# -- the scheduler -------------------------------------------------------------------------------------------
def test_the_scheduler_chooses_only_ready_nodes_with_a_fresh_heartbeat(world: World) -> None:
    assert scheduler.freshness_bound() == scheduler.DEFAULT_FRESH_S == 6.0  # 3 x 2 s heartbeats
    assert scheduler.freshness_bound(node_lost_after_s=4.0) == 4.0  # never fresher than "not lost yet"
    assert scheduler.freshness_bound(heartbeat_interval_s=10.0) == 15.0
    stale, fresh = world.node_ids
    sb = world.store.create_sandbox(world.project, "python")
    time.sleep(0.3)
    world.store.heartbeat(fresh, used={})
    for _ in range(5):
        assert scheduler.choose_node(world.store, sb, fresh_within_s=0.25) == fresh
    assert scheduler.choose_node(world.store, sb) in world.node_ids  # freshness not asked: any ready one
    for status in ("draining", "offline", "lost"):
        world.store.set_node_status(fresh, status)  # type: ignore[arg-type]
        with pytest.raises(errors.ResourceExhausted):
            scheduler.choose_node(world.store, sb, fresh_within_s=0.25)
        assert scheduler.choose_node(world.store, sb) == stale  # the only ready one
    world.store.set_node_status(stale, "lost")
    with pytest.raises(errors.ResourceExhausted):
        scheduler.choose_node(world.store, sb)


def test_a_step_is_never_begun_on_a_gone_node(world: World) -> None:
    sb = world.running_sandbox()
    lose(world, sb.node_id)  # type: ignore[arg-type]
    world.store.set_desired(sb.id, State.PAUSED)
    after = world.run(sb.id, rounds=2)
    assert (after.state, after.error_code) == (State.RUNNING, "unavailable")
    assert "gone" in (after.error or "")


# -- re-planning the steps of gone nodes ---------------------------------------------------------------------
def test_creating_on_a_lost_node_is_placed_again_and_its_copy_collected_by_incarnation(world: World) -> None:
    sb = world.store.create_sandbox(world.project, "python")
    lost = world.node_ids[0]
    sb = begin(world, sb, Event.CREATE)
    sb = world.store.update_observed(sb.id, node_id=lost, incarnation=sb.generation)
    old = sb.generation
    asyncio.run(world.api[lost].create_sandbox(sb.id, template="python", env={}, limits={}, incarnation=old))
    lose(world, lost)

    assert replan(world) == [sb.id]
    moved = world.store.load_sandbox(sb.id)
    assert moved is not None
    assert (moved.state, moved.node_id, moved.incarnation) == (State.PENDING, None, None)
    assert f"node {lost} is lost" in (moved.notice or "")
    (event,) = world.store.list_events(sb.id)
    assert event.kind == "step.replanned"
    assert event.detail == {
        "node_id": lost, "node_status": "lost", "from": "creating", "to": "pending",
        "reason": "node_lost", "incarnation": old,
    }  # fmt: skip
    assert replan(world) == []  # level-triggered, and idempotent: nothing left to move

    done = settled(world, sb.id)
    placed = other(world, lost)
    assert (done.state, done.node_id) == (State.RUNNING, placed)
    assert done.incarnation is not None and done.incarnation > old
    assert world.api[placed].incarnations[sb.id] == done.incarnation

    # The lost node returns with its copy of the old incarnation: the sweep removes it, by that incarnation.
    come_back(world, lost)
    assert asyncio.run(world.reconciler.collect_orphans()) == [sb.id]
    assert world.copies(sb.id) == {placed: "running"}


def test_a_create_placed_again_on_a_node_holding_an_older_copy_deletes_that_copy_first(world: World) -> None:
    sb = world.store.create_sandbox(world.project, "python")
    node, busy = world.node_ids
    sb = begin(world, sb, Event.CREATE)
    sb = world.store.update_observed(sb.id, node_id=node, incarnation=sb.generation)
    asyncio.run(world.api[node].create_sandbox(sb.id, template="python", env={}, limits={}, incarnation=1))
    lose(world, node)
    assert replan(world) == [sb.id]
    world.store.set_node_status(busy, "draining")  # the returning node is the only choice
    come_back(world, node)
    done = settled(world, sb.id)
    assert (done.state, done.node_id) == (State.RUNNING, node)
    assert world.api[node].incarnations[sb.id] == done.incarnation != 1
    assert world.api[node].calls.count("create_sandbox") == 3  # the stale copy's, refused, then ours


def test_restoring_on_a_lost_node_goes_back_to_suspended_and_is_restored_elsewhere(world: World) -> None:
    sb = world.running_sandbox({"work.txt": b"precious"})
    world.store.set_desired(sb.id, State.SUSPENDED)
    sb = settled(world, sb.id)
    assert sb.state == State.SUSPENDED and sb.node_id is None
    target = world.node_ids[0]
    sb = begin(world, sb, Event.RESTORE)
    sb = world.store.update_observed(sb.id, node_id=target, incarnation=sb.generation)
    world.store.set_desired(sb.id, State.RUNNING)
    lose(world, target)

    assert replan(world) == [sb.id]
    back = world.store.load_sandbox(sb.id)
    assert back is not None
    assert (back.state, back.node_id, back.incarnation) == (State.SUSPENDED, None, None)
    assert back.suspended_snapshot_id == sb.suspended_snapshot_id  # the artifact it is restored from
    assert kinds(world, sb.id) == ["step.replanned"]

    done = settled(world, sb.id)
    elsewhere = other(world, target)
    assert (done.state, done.node_id) == (State.RUNNING, elsewhere)
    assert world.api[elsewhere].sandboxes[sb.id]["files"] == {"work.txt": b"precious"}


def _uploaded_checkpoint(world: World, sb: SandboxRecord) -> str:
    snap = asyncio.run(world.keeper.take(sb, full=True))
    asyncio.run(world.keeper.upload(sb, snap))
    return snap.id


def test_a_live_step_on_a_lost_node_crashes_and_recovers_from_the_uploaded_checkpoint(world: World) -> None:
    sb = world.running_sandbox({"work.txt": b"checkpointed"})
    checkpoint = _uploaded_checkpoint(world, sb)
    lost = sb.node_id
    assert lost is not None
    world.store.set_desired(sb.id, State.PAUSED)
    sb = begin(world, sb, Event.PAUSE)
    lose(world, lost)

    assert replan(world) == [sb.id]
    crashed = world.store.load_sandbox(sb.id)
    assert crashed is not None
    assert (crashed.state, crashed.node_id, crashed.crash_count) == (State.CRASHED, lost, 1)
    assert crashed.notice == f"node {lost} is lost: pausing could not finish there"

    done = settled(world, sb.id)
    elsewhere = other(world, lost)
    assert (done.state, done.node_id) == (State.PAUSED, elsewhere)  # recovered, then paused as asked
    assert world.api[elsewhere].sandboxes[sb.id]["files"] == {"work.txt": b"checkpointed"}
    events = world.store.list_events(sb.id)
    assert [e.kind for e in events] == ["sandbox.crashed", "sandbox.recovered"]
    recovered = events[1].detail
    assert (recovered["checkpoint"], recovered["node_id"]) == (checkpoint, elsewhere)
    assert recovered["reason"] == crashed.notice
    assert done.incarnation is not None and world.api[elsewhere].incarnations[sb.id] == done.incarnation


def test_a_live_step_without_a_checkpoint_stays_crashed_until_its_node_returns(world: World) -> None:
    sb = world.running_sandbox({"work.txt": b"on the kept disk"})
    lost = sb.node_id
    assert lost is not None
    world.store.set_desired(sb.id, State.STOPPED)
    sb = begin(world, sb, Event.STOP)
    world.store.set_desired(sb.id, State.RUNNING)  # and then the user wants it back
    lose(world, lost)
    assert replan(world) == [sb.id]

    for _ in range(3):  # every round: crashed, never re-begun on the gone node, never moved again
        waiting = world.run(sb.id, rounds=2)
        assert (waiting.state, waiting.node_id, waiting.error_code) == (State.CRASHED, lost, "unavailable")
        assert replan(world) == []
    assert kinds(world, sb.id) == ["sandbox.crashed"]

    come_back(world, lost)
    done = settled(world, sb.id)
    assert (done.state, done.node_id) == (State.RUNNING, lost)
    assert world.api[lost].sandboxes[sb.id]["files"] == {"work.txt": b"on the kept disk"}
    recovered = world.store.list_events(sb.id)[-1]
    assert (recovered.kind, recovered.detail["checkpoint"]) == ("sandbox.recovered", None)
    assert recovered.detail["how"] == "restarted on the kept disk"


def test_deleting_on_a_lost_node_completes_and_the_copy_goes_when_the_node_returns(world: World) -> None:
    sb = world.running_sandbox()
    lost = sb.node_id
    assert lost is not None
    lose(world, lost)
    world.store.set_desired(sb.id, State.DELETED)
    done = settled(world, sb.id)
    assert done.state == State.DELETED
    assert world.copies(sb.id) == {lost: "running"}  # the node was unreachable
    come_back(world, lost)
    assert asyncio.run(world.reconciler.collect_orphans()) == [sb.id]
    assert world.copies(sb.id) == {}


def test_a_suspend_verified_before_its_node_was_lost_is_finished_not_crashed(world: World) -> None:
    sb = world.running_sandbox()
    node = sb.node_id
    assert node is not None
    world.api[node].kill_after.add("suspend")
    world.store.set_desired(sb.id, State.SUSPENDED)
    with pytest.raises(Killed):  # the control plane died right after the node uploaded
        world.run(sb.id)
    sb = world.store.load_sandbox(sb.id)  # type: ignore[assignment]
    assert sb.state == State.SUSPENDING and sb.suspended_snapshot_id and sb.suspended_prefix
    asyncio.run(world.reconciler.verify_uploaded(sb.suspended_snapshot_id, sb.suspended_prefix))
    lose(world, node)
    assert replan(world) == []
    done = settled(world, sb.id)
    assert (done.state, done.node_id) == (State.SUSPENDED, None)
    assert kinds(world, sb.id) == []


def test_an_offline_node_replans_its_steps_but_keeps_its_stable_sandboxes(world: World) -> None:
    resting = world.running_sandbox()
    node = resting.node_id
    assert node is not None
    _uploaded_checkpoint(world, resting)
    creating = world.store.create_sandbox(world.project, "python")
    creating = begin(world, creating, Event.CREATE)
    world.store.update_observed(creating.id, node_id=node, incarnation=creating.generation)
    lose(world, node, "offline")  # `space down` deregistered it on purpose
    assert replan(world) == [creating.id]
    kept = world.store.load_sandbox(resting.id)
    assert kept is not None and (kept.state, kept.node_id) == (State.RUNNING, node)
    assert settled(world, creating.id).node_id == other(world, node)


def test_replanning_is_level_triggered_a_control_plane_dying_midway_strands_nothing(world: World) -> None:
    node = world.node_ids[0]
    stuck = []
    for _ in range(3):
        sb = world.store.create_sandbox(world.project, "python")
        sb = begin(world, sb, Event.CREATE)
        stuck.append(world.store.update_observed(sb.id, node_id=node, incarnation=sb.generation).id)
    lose(world, node)
    real = world.reconciler._transition
    calls = 0

    async def dies_after_the_first(*args: Any, **kwargs: Any) -> SandboxRecord:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise Killed("control plane killed while re-planning")
        return await real(*args, **kwargs)

    world.reconciler._transition = dies_after_the_first  # type: ignore[method-assign]
    with pytest.raises(Killed):
        replan(world)
    world.reconciler._transition = real  # type: ignore[method-assign]
    states = [world.store.load_sandbox(i).state for i in stuck]  # type: ignore[union-attr]
    assert states.count(State.PENDING) == 1 and states.count(State.CREATING) == 2
    assert sorted(replan(world)) == sorted(
        i for i, s in zip(stuck, states, strict=True) if s != State.PENDING
    )
    assert all(settled(world, i).state == State.RUNNING for i in stuck)
    assert all(kinds(world, i) == ["step.replanned"] for i in stuck)


# -- conditional node operations in the control plane --------------------------------------------------------
def test_a_late_free_of_the_suspended_copy_never_removes_the_restored_one(world: World) -> None:
    """A sandbox suspended from node N whose copy could not be freed at once is restored onto N again: the
    restore deletes the old copy by its incarnation, announces its own, and the late free (and a sweep that
    read the old incarnation) are refused by the node; the restored copy stays."""
    sb = world.running_sandbox({"work.txt": b"v1"})
    node = sb.node_id
    assert node is not None
    first = sb.incarnation
    assert first is not None
    world.api[node].fail["delete_sandbox"] = errors.Unavailable("node busy")  # the suspend's free fails
    world.store.set_desired(sb.id, State.SUSPENDED)
    assert settled(world, sb.id).state == State.SUSPENDED
    assert world.copies(sb.id) == {node: "paused"}
    world.store.set_node_status(other(world, node), "draining")  # the restore goes back to N
    world.store.set_desired(sb.id, State.RUNNING)
    done = settled(world, sb.id)
    assert (done.state, done.node_id) == (State.RUNNING, node)
    assert done.incarnation is not None and done.incarnation != first

    asyncio.run(world.reconciler._free_copy(node, sb.id, first))  # the late free: refused, logged
    with pytest.raises(errors.Conflict):
        asyncio.run(world.api[node].delete_sandbox(sb.id, incarnation=first))  # a sweep's late delete
    assert not asyncio.run(world.reconciler._destroy_orphan(world.api[node], node, sb.id))  # type: ignore[arg-type]
    assert world.copies(sb.id) == {node: "running"}
    assert world.api[node].sandboxes[sb.id]["files"] == {"work.txt": b"v1"}
