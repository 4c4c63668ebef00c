"""The channel survives the node agent restarting: a new agent adopts what the node runs.

These tests use their own agents (connect_agent on the session node's data directory), so closing one does
not disturb the session's agent. `recover()` adopts every sandbox on the node; the other tests delete what
they create, so here it adopts only the sandbox made by the test.
"""

from __future__ import annotations

import asyncio

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent.agent import NodeAgent
from space.node.local import connect_agent
from tests.support.sandboxes import delete_quietly, eventually, read_int, running_ids, start_counter

pytestmark = pytest.mark.root


def test_agent_restart_adopts_running_sandbox_and_its_processes(node) -> None:
    async def scenario() -> None:
        first: NodeAgent = connect_agent(node.data_dir)
        sb = await first.create("python")
        sid = sb.sandbox_id
        second: NodeAgent | None = None
        try:
            counter = await start_counter(sb.session)
            lines = await sb.session.start_background(
                "for i in $(seq 1 30); do echo tick$i; sleep 0.1; done", tag="ticks"
            )
            await sb.session.write_file("/work/before-restart.txt", b"kept")
            before = await read_int(sb.session, "/work/counter")

            await first.close()  # the agent goes away; the sandbox keeps running
            assert sb.channel is None
            await asyncio.sleep(1.0)  # output produced while nobody listens is kept by the holder

            second = connect_agent(node.data_dir)
            adopted = await second.recover()
            assert sid in adopted
            handle = second.get(sid)
            assert handle.state == State.RUNNING
            s = handle.session
            assert await s.read_file("/work/before-restart.txt") == b"kept"
            assert counter in await running_ids(s), "the counter started before the restart still runs"
            assert await read_int(s, "/work/counter") > before
            r = await asyncio.wait_for(s.attach(lines["process_id"], offset=0), 30)
            assert r.stdout == b"".join(b"tick%d\n" % i for i in range(1, 31))
            assert r.exit_code == 0
            await eventually(lambda: _above(s, before + 15), what="counting after the restart")

            # the adopted sandbox is fully manageable by the new agent
            await second.pause(sid)
            await second.resume(sid)
            assert (await handle.session.exec("echo still here")).stdout == b"still here\n"
        finally:
            if second is not None:
                await delete_quietly(second, sid)
                await second.close()
            else:
                fresh = connect_agent(node.data_dir)
                await fresh.recover()
                await delete_quietly(fresh, sid)
                await fresh.close()

    node.run(scenario())


async def _above(session, value: int) -> bool:  # type: ignore[no-untyped-def]
    return await read_int(session, "/work/counter") >= value


def test_recovered_sandbox_keeps_its_limits_for_forks(node) -> None:
    """After an agent restart the adopted sandbox's spec must still say what it was created with: a fork
    of it must not escape the parent's limits. (recover() builds a default SandboxSpec today.)"""
    limits = SandboxLimits(cpus=0.5, memory_mb=256, pids=128, disk_mb=256)

    async def scenario() -> None:
        first: NodeAgent = connect_agent(node.data_dir)
        sb = await first.create("python", limits=limits, env={"TEAM": "blue"})
        sid = sb.sandbox_id
        await first.close()
        second = connect_agent(node.data_dir)
        children: list[str] = []
        try:
            await second.recover()
            handle = second.get(sid)
            forked = await second.fork(sid)
            children = [c.sandbox_id for c in forked]
            limits_file = node.data_dir / "fs" / "sandboxes" / children[0] / "limits.json"
            child_limits = SandboxLimits.model_validate_json(limits_file.read_text())
            problems = []
            if handle.spec.limits != limits:
                problems.append(f"the adopted spec says {handle.spec.limits!r}")
            if handle.spec.env != {"TEAM": "blue"}:
                problems.append(f"the adopted spec's env is {handle.spec.env!r}")
            if child_limits != limits:
                problems.append(f"its fork runs with {child_limits!r}")
            assert not problems, f"created with {limits!r}, but after recover(): " + "; ".join(problems)
        finally:
            await delete_quietly(second, *children, sid)
            await second.close()

    node.run(scenario())


def test_recovered_agent_knows_existing_snapshots(node) -> None:
    """A checkpoint taken before an agent restart is still on the node; the new agent must be able to roll
    back to it (recover() starts every adopted sandbox with an empty snapshot table today)."""

    async def scenario() -> None:
        first: NodeAgent = connect_agent(node.data_dir)
        sb = await first.create("python")
        sid = sb.sandbox_id
        await sb.session.write_file("/work/v.txt", b"1")
        snap = await first.disk_snapshot(sid)
        await first.close()
        second = connect_agent(node.data_dir)
        try:
            await second.recover()
            await second.get(sid).session.write_file("/work/v.txt", b"2")
            try:
                await second.rollback(sid, snap.snapshot_id)
            except errors.NotFound as exc:
                pytest.fail(f"the snapshot taken before the restart is unknown to the new agent: {exc}")
            assert await second.get(sid).session.read_file("/work/v.txt") == b"1"
        finally:
            await delete_quietly(second, sid)
            await second.close()

    node.run(scenario())
