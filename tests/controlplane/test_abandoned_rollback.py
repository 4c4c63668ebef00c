"""A rollback runs inside its API request, which holds the sandbox's work lease (store `hold`); the
reconciler leaves a `rolling_back` row alone while that lease is held, and takes over one left by a control
plane that died mid-way: the table's `fail` edge (crashed, with the reason and a `step.abandoned` event),
then recovery like any crash (found by the crash-injection harness: such rows stayed `rolling_back`)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator

import pytest

from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import open_store
from space.core.lifecycle import Event, State
from tests.support.reconciler_world import World


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[World]:
    open_store(sqlite_url(tmp_path / "db")).close()
    made = World(tmp_path)
    yield made
    made.close()


def test_hold_takes_a_free_or_own_or_expired_lease_only(world: World) -> None:
    sb = world.store.create_sandbox(world.project, "python")
    assert world.store.hold(sb.id, "api:a", 60)
    assert world.store.hold(sb.id, "api:a", 60)  # its own: renewed
    assert not world.store.hold(sb.id, "api:b", 60)
    assert world.store.release(sb.id, "api:a")
    assert world.store.hold(sb.id, "api:b", 0.0001)
    assert world.store.hold(sb.id, "api:c", 60)  # b's lease expired


def test_a_held_rollback_is_left_alone_and_an_abandoned_one_is_failed_then_recovered(world: World) -> None:
    sb = world.running_sandbox()
    rolling = world.store.transition(sb.id, sb.state, sb.generation, Event.ROLLBACK)
    assert world.store.hold(sb.id, "api:alive", 60)  # a live control plane's request is still running
    for _ in range(3):  # the reconciler's claim loop (World.run would bypass the leases)
        asyncio.run(world.reconciler.run_once())
    held = world.store.load_sandbox(sb.id)
    assert held is not None and held.state == State.ROLLING_BACK
    assert world.store.list_events(sb.id) == []

    assert world.store.release(sb.id, "api:alive")  # ...its process died: the lease is free (or expired)
    after = world.run(sb.id, rounds=10)
    kinds = [event.kind for event in world.store.list_events(sb.id)]
    assert kinds[0] == "step.abandoned", kinds
    assert "sandbox.recovered" in kinds, kinds
    assert after.state == State.RUNNING and after.generation > rolling.generation
    abandoned = world.store.list_events(sb.id, kind="step.abandoned")[0]
    assert "stopped before it finished" in abandoned.message and abandoned.detail == {"state": "rolling_back"}
    assert world.copies(sb.id) == {after.node_id: "running"}
