"""The reconciler's steps run side by side (docs/adr/0087-reconciler-steps-run-side-by-side.md): a step
that takes long (a deletion whose node call does not return) never holds back another sandbox's step, which
the loop claims and finishes meanwhile; the slow one still ends, and a stop gives every lease back. A step
whose lease was taken away while its node call hangs (re-planned: its node is gone) is ended when the loop
claims its sandbox again, and the sandbox's step runs afresh. The loop itself runs, over a SQLite store and
in-memory nodes (tests/support/reconciler_world)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from space.core.lifecycle import State
from tests.support.reconciler_world import FakeNodeApi, World


class GatedDeleteNode(FakeNodeApi):
    """A node whose deletions wait for the test to let them go, and whose first `hang_pauses` pauses never
    answer."""

    gate: asyncio.Event | None = None
    deleting: asyncio.Event | None = None
    hang_pauses = 0
    pausing: asyncio.Event | None = None

    async def pause(self, sandbox_id: str) -> Any:
        if self.hang_pauses:
            self.hang_pauses -= 1
            assert self.pausing is not None
            self.pausing.set()
            await asyncio.Event().wait()  # a node that stopped answering
        return await super().pause(sandbox_id)

    async def delete_sandbox(self, sandbox_id: str, **kw: Any) -> Any:
        assert self.gate is not None and self.deleting is not None
        self.deleting.set()
        await self.gate.wait()
        return await super().delete_sandbox(sandbox_id, **kw)


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[World]:
    made = World(tmp_path)
    made.use_nodes(GatedDeleteNode)
    yield made
    made.close()


async def _state_becomes(world: World, sandbox_id: str, state: State, timeout: float = 10.0) -> None:
    async def reached() -> None:
        while True:
            sb = world.store.load_sandbox(sandbox_id)
            assert sb is not None
            if sb.state == state:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(reached(), timeout)


def test_a_step_that_takes_long_does_not_hold_back_another_sandbox(world: World) -> None:
    slow, other = world.running_sandbox(), world.running_sandbox()

    async def go() -> None:
        gate, deleting = asyncio.Event(), asyncio.Event()
        for node in world.api.values():
            node.gate, node.deleting = gate, deleting  # type: ignore[attr-defined]
        world.reconciler.start()
        try:
            world.store.set_desired(slow.id, State.DELETED)
            world.reconciler.poke()
            await asyncio.wait_for(deleting.wait(), 10)  # its node call is under way, and does not return
            world.store.set_desired(other.id, State.PAUSED)
            world.reconciler.poke()
            await _state_becomes(world, other.id, State.PAUSED)  # meanwhile: not after the deletion
            slow_now = world.store.load_sandbox(slow.id)
            assert slow_now is not None and slow_now.state == State.DELETING
            gate.set()
            await _state_becomes(world, slow.id, State.DELETED)
        finally:
            gate.set()
            await world.reconciler.stop()
        assert world.store.lease_owners() == []

    asyncio.run(go())


def test_a_step_whose_lease_was_taken_away_is_ended_and_runs_afresh(world: World) -> None:
    sb = world.running_sandbox()
    node = world.api[sb.node_id]  # type: ignore[index]

    async def go() -> None:
        node.hang_pauses, node.pausing = 1, asyncio.Event()  # type: ignore[attr-defined]
        world.reconciler.start()
        try:
            world.store.set_desired(sb.id, State.PAUSED)
            world.reconciler.poke()
            await asyncio.wait_for(node.pausing.wait(), 10)  # type: ignore[attr-defined]
            # What re-planning does to the row's lease: taken away from the step under way.
            assert world.store.release(sb.id, world.reconciler.owner)
            world.reconciler.poke()
            await _state_becomes(world, sb.id, State.PAUSED)
        finally:
            await world.reconciler.stop()
        assert world.store.lease_owners() == []

    asyncio.run(go())
