"""Cordon and drain (docs/adr/0065-node-operations.md): a cordoned node takes no new sandbox, a drain moves
every sandbox off its node through the reconciler's own steps (running and paused ones suspended to object
storage and restored on the other node with their files; stopped ones started first), the node becomes
`drained` only when empty, a control plane killed mid-drain converges, and a drained node that registers
again stays cordoned. Removal refuses a node that holds sandboxes and an active one.

Real store and reconciler (SQLite, a local object store, real artifacts and keys); the nodes are the
in-memory FakeNodeApi of tests/support/reconciler_world.py."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import pytest

from space.controlplane import node_drain, scheduler
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import open_store
from space.core import errors, node_states
from space.core.lifecycle import State
from space.core.node_states import NodeAdmin, NodeAdminEvent
from tests.support.reconciler_world import World


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("migrated")
    open_store(sqlite_url(root / "db")).close()
    return root / "db"


@pytest.fixture
def world(tmp_path: pathlib.Path, migrated: pathlib.Path) -> Iterator[World]:
    shutil.copytree(migrated, tmp_path / "db")
    made = World(tmp_path)
    yield made
    made.close()


def admin(world: World, node_id: str) -> NodeAdmin:
    node = world.store.get_node(node_id)
    assert node is not None
    return node_states.of_labels(node.labels)


def drain_until_drained(world: World, node_id: str, sandbox_ids: list[str], rounds: int = 8) -> None:
    """What the housekeeping job and the claim loop do, alternately, until the node is drained."""
    for _ in range(rounds):
        node_drain.drain_round(world.store)
        for sandbox_id in sandbox_ids:
            world.run(sandbox_id)
        world.collect_orphans()
        if admin(world, node_id) is NodeAdmin.DRAINED:
            return
    raise AssertionError(f"node {node_id} is still {admin(world, node_id)}")


def test_cordon_stops_placement_and_keeps_running_sandboxes(world: World) -> None:
    a, b = world.node_ids
    sb = world.running_sandbox()
    world.store.node_admin_event(sb.node_id or "", NodeAdminEvent.CORDON)
    for _ in range(3):
        fresh = world.running_sandbox()
        assert fresh.node_id != sb.node_id  # only the other node takes new sandboxes
    assert world.store.load_sandbox(sb.id).state == State.RUNNING  # type: ignore[union-attr]
    node_drain.drain_round(world.store)  # a cordon moves nothing
    assert world.copies(sb.id) == {sb.node_id: "running"}
    # Both cordoned: nothing fits; uncordoned: placeable again.
    other = b if sb.node_id == a else a
    world.store.node_admin_event(other, NodeAdminEvent.CORDON)
    with pytest.raises(errors.ResourceExhausted):
        scheduler.choose_node(world.store, world.store.create_sandbox(world.project, "python"))
    world.store.node_admin_event(other, NodeAdminEvent.UNCORDON)
    assert admin(world, other) is NodeAdmin.ACTIVE
    with pytest.raises(errors.InvalidState) as refused:
        world.store.node_admin_event(other, NodeAdminEvent.DRAINED)
    assert refused.value.state == "active"


def test_drain_moves_running_paused_and_stopped_sandboxes_with_their_files(world: World) -> None:
    a, b = world.node_ids
    world.store.node_admin_event(b, NodeAdminEvent.CORDON)  # everything lands on a
    wanted = {State.RUNNING: State.RUNNING, State.PAUSED: State.PAUSED, State.STOPPED: State.STOPPED}
    made = {}
    for state in wanted:
        sb = world.running_sandbox({"a.txt": f"{state}".encode()})
        assert sb.node_id == a
        if state != State.RUNNING:
            world.store.set_desired(sb.id, state)
            assert world.run(sb.id).state == state
        made[sb.id] = state
    world.store.node_admin_event(b, NodeAdminEvent.UNCORDON)
    world.store.node_admin_event(a, NodeAdminEvent.DRAIN)
    drain_until_drained(world, a, list(made))
    for sandbox_id, state in made.items():
        sb = world.store.load_sandbox(sandbox_id)
        assert sb is not None and sb.node_id == b and sb.state == state == sb.desired_state
        assert world.copies(sandbox_id) == {b: state.value}
        if state != State.STOPPED:  # the fake node keeps a stopped sandbox's files only on its disk
            assert world.api[b].sandboxes[sandbox_id]["files"] == {"a.txt": f"{state}".encode()}
    node = world.store.get_node(a)
    assert node is not None and not node_states.drain_entries(node.labels)
    # A drained node that registers again (a restart, an upgrade) stays out of placement.
    world.store.register_node(node.url, "tok", capacity=node.capacity, labels={"zone": "z1"})
    again = world.store.get_node(a)
    assert again is not None and node_states.of_labels(again.labels) is NodeAdmin.DRAINED
    assert again.labels["zone"] == "z1"
    # The API's path: a node that was lost, or left cleanly (offline), registers with its identity.
    world.store.register_node(node.url, "tok", capacity=node.capacity, identity="identity-of-a")
    for status in ("lost", "offline"):
        world.store.set_node_status(a, status)  # type: ignore[arg-type]
        back = world.store.reregister_node(a, "identity-of-a", node.url, rpc_token_sealed=b"sealed")
        assert back is not None and back.status == "ready"
        assert node_states.of_labels(back.labels) is NodeAdmin.DRAINED
    world.store.heartbeat(a, used={})
    assert a not in [n.id for n in scheduler.schedulable_nodes(world.store, None)]
    world.store.node_admin_event(a, NodeAdminEvent.UNCORDON)
    assert a in [n.id for n in scheduler.schedulable_nodes(world.store, None)]


def test_drain_without_room_leaves_sandboxes_suspended_then_restores_them(world: World) -> None:
    a, b = world.node_ids
    sb = world.running_sandbox()
    here, there = (a, b) if sb.node_id == a else (b, a)
    world.store.node_admin_event(there, NodeAdminEvent.CORDON)
    world.store.node_admin_event(here, NodeAdminEvent.DRAIN)
    drain_until_drained(world, here, [sb.id])
    moved = world.store.load_sandbox(sb.id)
    # Its data is only in object storage; its wish is kept: the restore waits, with back-off, for room.
    assert moved is not None and moved.state in (State.SUSPENDED, State.RESTORING) and moved.node_id is None
    assert moved.desired_state == State.RUNNING and moved.error_code == "resource_exhausted"
    assert world.copies(sb.id) == {}
    world.store.node_admin_event(there, NodeAdminEvent.UNCORDON)
    restored = world.run(sb.id)
    assert restored.state == State.RUNNING and restored.node_id == there


def test_a_control_plane_killed_mid_drain_converges(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the drain remembered a sandbox but before it changed its wish, and again after the
    wish was given back but before it was forgotten: the next rounds still finish the move."""
    a, b = world.node_ids
    sb = world.running_sandbox()
    here, there = (a, b) if sb.node_id == a else (b, a)
    world.store.node_admin_event(here, NodeAdminEvent.DRAIN)

    class Killed(BaseException):
        pass

    real_set_desired = world.store.set_desired

    def killed(*args: object, **kw: object) -> None:
        raise Killed

    monkeypatch.setattr(world.store, "set_desired", killed)
    with pytest.raises(Killed):
        node_drain.drain_round(world.store)
    node = world.store.get_node(here)
    assert node is not None and node_states.drain_entries(node.labels) == {sb.id: "running"}
    monkeypatch.setattr(world.store, "set_desired", real_set_desired)
    node_drain.drain_round(world.store)
    assert world.run(sb.id).state == State.SUSPENDED
    real_note = world.store.note_drain

    def dies_on_forget(node_id: str, sandbox_id: str, desired: str | None) -> bool:
        if desired is None:
            raise Killed
        return real_note(node_id, sandbox_id, desired)

    monkeypatch.setattr(world.store, "note_drain", dies_on_forget)
    with pytest.raises(Killed):
        node_drain.drain_round(world.store)  # the wish (running) is given back, then the process dies
    monkeypatch.setattr(world.store, "note_drain", real_note)
    drain_until_drained(world, here, [sb.id])
    moved = world.store.load_sandbox(sb.id)
    assert moved is not None and moved.state == State.RUNNING and moved.node_id == there


def test_remove_refuses_a_node_with_sandboxes_or_an_active_one(world: World) -> None:
    a, b = world.node_ids
    sb = world.running_sandbox()
    here, there = (a, b) if sb.node_id == a else (b, a)
    with pytest.raises(errors.InvalidState, match="active"):
        world.store.node_admin_event(there, NodeAdminEvent.REMOVE)  # empty, but could get one any time
    world.store.node_admin_event(here, NodeAdminEvent.CORDON)
    with pytest.raises(errors.InvalidState, match="still holds sandboxes") as refused:
        world.store.node_admin_event(here, NodeAdminEvent.REMOVE)
    assert refused.value.state == "cordoned"
    with pytest.raises(errors.NotFound):
        world.store.node_admin_event("node_unknown", NodeAdminEvent.CORDON)
    world.store.node_admin_event(here, NodeAdminEvent.DRAIN)
    drain_until_drained(world, here, [sb.id])
    assert world.store.node_admin_event(here, NodeAdminEvent.REMOVE) is None
    assert world.store.get_node(here) is None
    assert world.store.load_sandbox(sb.id).node_id == there  # type: ignore[union-attr]
