"""The warm pool's bookkeeping (space.node.agent.pools, ADR 0047) over a stand-in driver: fills to size and
only while the node has room, never hands a member out twice, refills after a take, backs off after a failed
fill, refuses limits it does not hold, drops a member whose runtime dies, and destroys what it made (ready or
interrupted) when closed with `destroy`. The real thing runs in tests/node/test_warm_pools_runsc.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from space.core import errors
from space.core.settings import SandboxLimits
from space.node.agent import pools as pools_module
from space.node.agent.pools import WarmPools
from space.node.agent.runtime_names import RuntimeNames
from space.node.drivers.base import SandboxSpec


class StandInChannel:
    def __init__(self) -> None:
        self.on_lost: Callable[[str], None] | None = None
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class StandInDriver:
    """Only what WarmPools uses: names, warm_ready, create_pooled, destroy."""

    name = "stand-in"

    def __init__(self) -> None:
        self.names = RuntimeNames(None)
        self.running: dict[str, StandInChannel] = {}
        self.fail_next = 0
        self.gate: asyncio.Event | None = None

    async def warm_ready(self, template: str) -> bool:
        return True  # members restore the warm start (a cold member's start command: test_template_travel)

    async def create_pooled(self, spec: SandboxSpec) -> Any:
        assert self.names.is_member(spec.sandbox_id), "recorded before it is made"
        assert spec.env == {} and spec.limits == SandboxLimits()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise errors.Unavailable("injected: restore failed")
        channel = StandInChannel()
        self.running[spec.sandbox_id] = channel
        return channel

    async def destroy(self, sandbox_id: str) -> None:
        self.running.pop(sandbox_id, None)


async def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


def _pools(driver: StandInDriver, **kwargs: Any) -> WarmPools:
    return WarmPools(lambda: driver, {"python": 2}, fill_yield_s=0.0, **kwargs)  # type: ignore[arg-type,return-value]


def test_fills_to_size_and_a_member_is_taken_once() -> None:
    async def scenario() -> None:
        driver = StandInDriver()
        pools = _pools(driver, fill_concurrency=2)
        pools.start()
        await _until(lambda: pools.counts() == {"python": 2})
        assert set(driver.names.members()) == set(driver.running)
        first = pools.take("python", SandboxLimits())
        second = pools.take("python", SandboxLimits())
        assert first is not None and second is not None and first.runtime_id != second.runtime_id
        assert pools.take("python", SandboxLimits()) is None  # empty until refilled
        await _until(lambda: pools.counts() == {"python": 2})
        assert pools.take("python", SandboxLimits(memory_mb=384)) is None  # other limits: not from here
        assert pools.take("web", SandboxLimits()) is None
        third = pools.take("python", SandboxLimits())
        assert third is not None and third.runtime_id not in {first.runtime_id, second.runtime_id}
        await pools.close(destroy=True)
        # Taken members are the agent's to bind or destroy; closing destroys every one still recorded.
        assert driver.names.members() == {} and driver.running == {}

    asyncio.run(scenario())


def test_no_fill_without_room_and_what_is_held_counts() -> None:
    async def scenario() -> None:
        driver = StandInDriver()
        room = {"free": False}
        pools = _pools(driver, room=lambda _limits: room["free"])
        pools.start()
        await asyncio.sleep(0.1)
        assert pools.counts() == {"python": 0} and driver.running == {}
        room["free"] = True
        pools._wake.set()  # a take or a fill's end wakes it; a node freeing room is seen within ROOM_POLL_S
        await _until(lambda: pools.counts() == {"python": 2})
        limits = SandboxLimits()
        assert pools.reserved() == (2 * limits.cpus, 2 * limits.memory_mb, 2 * limits.disk_mb)
        await pools.close(destroy=True)
        assert driver.running == {}

    asyncio.run(scenario())


def test_members_give_way_when_the_node_needs_their_room() -> None:
    async def scenario() -> None:
        driver = StandInDriver()
        node_full = {"value": False}  # the node's sandboxes and members do not fit (a placement took room)

        def room(limits: SandboxLimits | None) -> bool:
            return not node_full["value"] and (limits is None or len(driver.running) < 2)

        pools = _pools(driver, room=room)
        pools.start()
        await _until(lambda: pools.counts() == {"python": 2})
        members = sorted(pools._ready["python"], key=lambda m: m.ready_at)
        oldest = members[0].runtime_id
        node_full["value"] = True
        pools.wake()
        await _until(lambda: pools.stats["evicted"] == 2 and driver.running == {})
        assert oldest not in driver.names.members() and driver.names.members() == {}
        assert pools.counts() == {"python": 0}  # and no refill while there is no room
        node_full["value"] = False
        pools.wake()
        await _until(lambda: pools.counts() == {"python": 2})
        await pools.close(destroy=True)

    asyncio.run(scenario())


def test_a_failed_fill_backs_off_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools_module, "FILL_BACKOFF_S", 0.05)

    async def scenario() -> None:
        driver = StandInDriver()
        driver.fail_next = 2
        pools = _pools(driver)
        pools.start()
        await _until(lambda: pools.counts() == {"python": 2})
        assert pools.stats["fill_failures"] == 2
        assert set(driver.names.members()) == set(driver.running)  # the failed ones are not recorded
        await pools.close(destroy=True)

    asyncio.run(scenario())


def test_a_lost_member_leaves_the_pool_and_is_replaced() -> None:
    async def scenario() -> None:
        driver = StandInDriver()
        pools = _pools(driver)
        pools.start()
        await _until(lambda: pools.counts() == {"python": 2})
        victim, channel = next(iter(driver.running.items()))
        assert channel.on_lost is not None
        channel.on_lost("the runtime died")
        assert pools.stats["lost"] == 1
        await _until(lambda: victim not in driver.running and pools.counts() == {"python": 2})
        assert victim not in driver.names.members()
        await pools.close(destroy=True)

    asyncio.run(scenario())


def test_closing_destroys_members_interrupted_in_their_making() -> None:
    async def scenario() -> None:
        driver = StandInDriver()
        driver.gate = asyncio.Event()  # every fill hangs in create_pooled
        pools = _pools(driver)
        pools.start()
        await _until(lambda: len(driver.names.members()) == 1)
        await pools.close(destroy=True)
        assert driver.names.members() == {} and driver.running == {}

    asyncio.run(scenario())
