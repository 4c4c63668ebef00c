"""Warm pools on a real gVisor node (docs/adr/0047-warm-pools.md): a create binds a pooled sandbox and
gives it the caller's id, environment and fresh randomness; a pooled sandbox serves one user only; limits
the pool does not hold, an empty pool or a failed bind fall back to the usual create; deleting a bound
sandbox removes its runtime and its name; pooled runtimes left by an earlier agent are destroyed, never
adopted; a bound sandbox boots with its own environment after a stop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id
from space.core.settings import SandboxLimits
from space.node.agent.pools import WarmPools, clean_leftovers
from space.node.agent.runtime_names import RuntimeNames
from tests.support.realnode import RealNode

pytestmark = pytest.mark.root

READ_RANDOM = "head -c 16 /dev/urandom | od -An -tx1"


async def _filled(pools: WarmPools, template: str, size: int, timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while pools.counts().get(template, 0) < size:
            await asyncio.sleep(0.05)


async def _runtime_ids(node: RealNode) -> set[str]:
    """The runtime ids the root helper holds (sandbox.list answers them translated: undo that)."""
    names = node.agent.driver.names
    assert names is not None
    return {names.to_runtime(state.sandbox_id) for state in await node.agent.driver.list() if state.exists}


@pytest.fixture
def pools(node: RealNode) -> Iterator[WarmPools]:
    agent = node.agent
    pools = WarmPools(lambda: agent.driver, {"python": 2}, fill_yield_s=0.0, fill_concurrency=2)
    agent.pools = pools
    node.run(_start(pools))
    try:
        yield pools
    finally:
        agent.pools = None
        node.run(pools.close(destroy=True))


async def _start(pools: WarmPools) -> None:
    pools.start()
    await _filled(pools, "python", 2)


def test_a_create_binds_a_pooled_sandbox_with_its_own_id_env_and_randomness(
    node: RealNode, pools: WarmPools
) -> None:
    agent = node.agent
    names = agent.driver.names
    assert names is not None

    async def scenario() -> None:
        members = set(names.members())
        assert len(members) == 2
        first, second = new_sandbox_id(), new_sandbox_id()
        a = await agent.create("python", sandbox_id=first, env={"GREETING": "hello-a"})
        b = await agent.create("python", sandbox_id=second, env={"GREETING": "hello-b"})
        try:
            assert (a.created_from, b.created_from) == ("pool", "pool")
            runtime_a, runtime_b = names.to_runtime(first), names.to_runtime(second)
            assert {runtime_a, runtime_b} == members  # the two members, one each
            assert runtime_a not in names.members() and runtime_b not in names.members()
            assert names.to_sandbox(runtime_a) == first
            # The caller's environment, not the other's; the gateway's proxy variables where egress is on.
            out_a = await a.session.exec(["sh", "-c", "echo $GREETING"])
            out_b = await b.session.exec(["sh", "-c", "echo $GREETING"])
            assert (out_a.stdout.strip(), out_b.stdout.strip()) == (b"hello-a", b"hello-b")
            # Fresh randomness: copies of one checkpoint never share it.
            info_a, info_b = await a.session.info(), await b.session.info()
            assert info_a["boot_id"] != info_b["boot_id"]
            rand_a = (await a.session.exec(["sh", "-c", READ_RANDOM])).stdout
            rand_b = (await b.session.exec(["sh", "-c", READ_RANDOM])).stdout
            assert rand_a.strip() and rand_a != rand_b
            # The helper's answers name the sandbox, never the runtime.
            state = await agent.driver.state(first)
            assert state.sandbox_id == first and state.runtime == "running"
            # The pool refills with NEW runtimes: a bound one is never offered again.
            await _filled(pools, "python", 2)
            assert not set(names.members()) & {runtime_a, runtime_b}
            assert pools.stats["taken"] >= 2
        finally:
            await agent.delete(first)
            await agent.delete(second)
        # Deleting a bound sandbox removes its runtime and its name.
        assert names.to_runtime(first) == first and names.to_sandbox(runtime_a) == runtime_a
        held = await _runtime_ids(node)
        assert runtime_a not in held and runtime_b not in held
        # What a restarted agent reads: no alias left for the deleted sandboxes.
        persisted = RuntimeNames(names.path)
        assert persisted.to_runtime(first) == first
        assert set(persisted.members()) == set(names.members())

    node.run(scenario())


def test_other_limits_an_empty_pool_and_a_failed_bind_fall_back(node: RealNode, pools: WarmPools) -> None:
    agent = node.agent
    names = agent.driver.names
    assert names is not None

    async def scenario() -> None:
        created = []
        try:
            other = SandboxLimits(memory_mb=384)
            sandbox = await agent.create("python", sandbox_id=new_sandbox_id(), limits=other)
            created.append(sandbox.sandbox_id)
            assert sandbox.created_from == "warm"  # the pool holds default limits only
            assert names.to_runtime(sandbox.sandbox_id) == sandbox.sandbox_id
            assert pools.counts()["python"] == 2

            # A bind that fails destroys the member and creates the usual way.
            inner_bind = type(agent.driver).bind_pooled
            members_before = set(names.members())

            async def failing_bind(self, spec, channel):  # type: ignore[no-untyped-def]
                raise errors.Unavailable("injected: the bind failed")

            type(agent.driver).bind_pooled = failing_bind  # type: ignore[method-assign]
            try:
                sandbox = await agent.create("python", sandbox_id=new_sandbox_id(), env={"X": "1"})
            finally:
                type(agent.driver).bind_pooled = inner_bind  # type: ignore[method-assign]
            created.append(sandbox.sandbox_id)
            assert sandbox.created_from == "warm"
            assert names.to_runtime(sandbox.sandbox_id) == sandbox.sandbox_id
            lost = members_before - set(names.members())
            assert len(lost) == 1
            assert not lost & await _runtime_ids(node)  # the member that failed is gone, not leaked
            out = await sandbox.session.exec(["sh", "-c", "echo $X"])
            assert out.stdout.strip() == b"1"

            # An empty pool: the creates after it come from the warm start and say so.
            await pools.close(destroy=True)
            sandbox = await agent.create("python", sandbox_id=new_sandbox_id())
            created.append(sandbox.sandbox_id)
            assert sandbox.created_from == "warm"
            assert names.members() == {}
        finally:
            for sandbox_id in created:
                await agent.delete(sandbox_id)

    node.run(scenario())


def test_a_bound_sandbox_boots_with_its_env_and_leftover_members_are_destroyed(
    node: RealNode, pools: WarmPools
) -> None:
    agent = node.agent
    names = agent.driver.names
    assert names is not None

    async def scenario() -> None:
        sandbox_id = new_sandbox_id()
        sandbox = await agent.create("python", sandbox_id=sandbox_id, env={"COLOUR": "teal"})
        try:
            assert sandbox.created_from == "pool"
            await agent.stop(sandbox_id)
            await agent.start(sandbox_id)  # a boot from the bundle: the env written at the bind
            out = await agent.get(sandbox_id).session.exec(["sh", "-c", "echo $COLOUR"])
            assert out.stdout.strip() == b"teal"
            # Members left by an earlier agent (it stopped; its channels are gone): destroyed, not adopted.
            await _filled(pools, "python", 2)
            await pools.close()  # channels closed, runtimes and their records left, as after a crash
            leftovers = set(names.members())
            assert len(leftovers) == 2 and leftovers <= await _runtime_ids(node)
            assert sorted(await clean_leftovers(agent.driver)) == sorted(leftovers)
            assert names.members() == {}
            assert not leftovers & await _runtime_ids(node)
            adopted = await agent.recover()
            assert not set(adopted) & leftovers
            assert names.to_runtime(sandbox_id) != sandbox_id  # the bound sandbox keeps its runtime
        finally:
            await agent.delete(sandbox_id)

    node.run(scenario())
