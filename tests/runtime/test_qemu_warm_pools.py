"""Warm pools of real QEMU microVMs (under TCG on machines without KVM; ADR 0047, ADR 0068 "Warm pools"):
a qemu node with `pools python=1` restores a member from the template's checkpoint under a runtime id of
its own; a create is served from the pool (the node's answer says so) under the caller's id, with the
caller's environment and fresh randomness (each bound member reseeded: two members of one checkpoint draw
different bytes) and with the member's network slot; the pool refills with a new runtime; a member an
ended agent left is destroyed, never adopted; an empty pool falls back to a restore at create; deleting
leaves no microVM, disk or name behind."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from space.core.ids import new_sandbox_id
from space.node.agent import rpc_models as rm
from space.node.agent.agent import NodeAgent
from space.node.agent.helper_client import HelperClient
from space.node.agent.launch import start_pools
from space.node.agent.pools import WarmPools, clean_leftovers, parse_pool_sizes
from space.node.agent.service import NodeService
from space.node.agent.settings import NodeAgentSettings
from space.node.drivers.qemu import QemuDriver
from space.node.helper.microvm import MicroVMs

pytestmark = pytest.mark.root

TEMPLATE = "python"
READ_RANDOM = "head -c 16 /dev/urandom | od -An -tx1"
#: A restore under TCG on a busy 2-core machine answers within seconds; the template's cold boot (made here
#: only when no earlier test of the session made it) takes up to a few minutes.
FILL_TIMEOUT_S = 120.0


async def _filled(pools: WarmPools, size: int) -> None:
    async with asyncio.timeout(FILL_TIMEOUT_S):
        while pools.counts().get(TEMPLATE, 0) < size:
            await asyncio.sleep(0.05)


def test_a_qemu_node_serves_creates_from_its_warm_pool(node) -> None:  # type: ignore[no-untyped-def]
    layout = node.node.layout
    microvms = MicroVMs(layout, os.geteuid())  # only to look at the disks the helper keeps

    async def scenario() -> None:
        driver = QemuDriver(layout, HelperClient(str(layout.helper_socket)))
        await driver.ensure_template(TEMPLATE)  # the checkpoint (a cold boot if none is there yet)
        agent = NodeAgent(driver)
        service = NodeService(agent)
        # What `--pools python=1` gives a node (space.node.agent.launch): pools over the agent's driver.
        start_pools(agent, service, parse_pool_sizes("python=1"), NodeAgentSettings(pool_fill_yield_s=0.0))
        pools = agent.pools
        assert pools is not None  # the qemu driver keeps runtime names: its node keeps pools
        names = driver.names
        before = set(microvms.sandbox_ids())
        created: list[str] = []
        runtimes: list[str] = []
        try:
            await _filled(pools, 1)
            assert service.info().pools == {TEMPLATE: 1}
            (member,) = names.members()
            assert microvms.sandbox_dir(member).is_dir()  # restored under its runtime id
            assert (await service.observe_all()).unmanaged == []  # a member is nobody's sandbox

            first = new_sandbox_id()
            started = time.perf_counter()
            request = rm.CreateSandboxRequest(template=TEMPLATE, env={"WHO": "first"})
            observed, made = await service.create(first, request)  # the node's answer to the create
            created.append(first)
            handle = agent.get(first)
            assert (await handle.session.exec("echo $WHO")).stdout == b"first\n"
            create_ms = (time.perf_counter() - started) * 1000
            assert (made, observed.id, observed.state) == (True, first, "running")
            assert observed.created_from == "pool"
            assert names.to_runtime(first) == member != first
            runtimes.append(member)
            state = await driver.state(first)  # the helper's answer names the sandbox, not the runtime
            assert (state.sandbox_id, state.runtime) == (first, "running")

            # The pool refills with a NEW runtime; the next create binds that one.
            await _filled(pools, 1)
            (refill,) = names.members()
            assert refill != member
            second = new_sandbox_id()
            other = await agent.create(TEMPLATE, sandbox_id=second, env={"WHO": "second"})
            created.append(second)
            assert other.created_from == "pool" and names.to_runtime(second) == refill
            runtimes.append(refill)
            assert (await other.session.exec("echo $WHO")).stdout == b"second\n"
            if node.node.network == "sandbox":
                # The network slot is the runtime's, made at the fill (ADR 0080): the sandbox's id reaches
                # it, which is what the egress wiring asks at the bind to give the slot the sandbox's policy.
                slot_a = await driver.helper.call("sandbox.network", {"sandbox_id": first})
                slot_b = await driver.helper.call("sandbox.network", {"sandbox_id": second})
                assert slot_a["host_addr"] != slot_b["host_addr"]
                assert (await driver.helper.call("sandbox.network", {"sandbox_id": member})) == slot_a
            # Both members are copies of one checkpoint: only the bind's reseed tells them apart.
            info_a, info_b = await handle.session.info(), await other.session.info()
            assert info_a["boot_id"] != info_b["boot_id"]
            drawn_a = (await handle.session.exec(["sh", "-c", READ_RANDOM])).stdout
            drawn_b = (await other.session.exec(["sh", "-c", READ_RANDOM])).stdout
            assert drawn_a.strip() and drawn_a != drawn_b

            # A member left by an agent that ended (its channel gone, its runtime and record left, as after a
            # crash) is destroyed at the next start, never adopted.
            await _filled(pools, 1)
            await pools.close()
            (left,) = names.members()
            assert microvms.sandbox_dir(left).is_dir()
            assert await clean_leftovers(driver) == [left]
            assert names.members() == {} and not microvms.sandbox_dir(left).exists()

            # Without members a create restores the checkpoint.
            third = new_sandbox_id()
            started = time.perf_counter()
            plain = await agent.create(TEMPLATE, sandbox_id=third, env={"WHO": "third"})
            created.append(third)
            assert (await plain.session.exec("echo $WHO")).stdout == b"third\n"
            warm_ms = (time.perf_counter() - started) * 1000
            assert plain.created_from == "warm" and names.to_runtime(third) == third
            print(f"\nqemu create to first exec answered ({microvms.accel}): "
                  f"from the pool {create_ms:.0f} ms, restored at create {warm_ms:.0f} ms")  # fmt: skip
        finally:
            for sandbox_id in created:
                await agent.delete(sandbox_id)
            await pools.close(destroy=True)
            await agent.close()
        # Nothing left: no alias, no member, no microVM disk of any runtime the pool made.
        assert [names.to_runtime(s) for s in created] == created
        assert names.members() == {}
        for runtime_id in runtimes:
            assert not microvms.sandbox_dir(runtime_id).exists()
        assert set(microvms.sandbox_ids()) <= before  # nor of the member made after the last take

    node.run(scenario(), timeout=900)
