"""The lifecycle of a real gVisor sandbox: pause/resume, stop/start, checkpoint, rollback, fork."""

from __future__ import annotations

import asyncio

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from tests.support.sandboxes import (
    delete_quietly,
    eventually,
    new_sandbox,
    read_int,
    running_ids,
    start_counter,
)

pytestmark = pytest.mark.root


def test_pause_freezes_and_resume_continues(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid, s = sb.sandbox_id, sb.session
            await start_counter(s)
            await asyncio.sleep(0.5)
            before = await read_int(s, "/work/counter")
            await agent.pause(sid)
            assert sb.state == State.PAUSED
            await asyncio.sleep(1.5)  # ~15 ticks if it were running
            with pytest.raises(errors.InvalidState) as refused:
                await agent.pause(sid)
            assert refused.value.state == "paused"
            with pytest.raises(errors.InvalidState) as refused:
                await agent.checkpoint(sid)
            assert refused.value.state == "paused"
            assert sb.state == State.PAUSED
            await agent.resume(sid)
            assert sb.state == State.RUNNING
            after_resume = await read_int(s, "/work/counter")
            assert after_resume - before <= 5, (
                f"the counter advanced while paused: {before} -> {after_resume}"
            )
            await eventually(
                lambda: _above(s, after_resume + 5), what="the counter advances after resume", timeout=10
            )
            with pytest.raises(errors.InvalidState) as refused:
                await agent.resume(sid)
            assert refused.value.state == "running"

    node.run(scenario())


async def _above(session, value: int) -> bool:  # type: ignore[no-untyped-def]
    return await read_int(session, "/work/counter") >= value


def test_stop_keeps_files_and_start_brings_fresh_processes(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            old_counter = await start_counter(sb.session)
            await sb.session.write_file("/work/kept.txt", b"kept across stop")
            boot_before = (await sb.session.info())["boot_id"]
            await agent.stop(sid)
            assert sb.state == State.STOPPED
            with pytest.raises(errors.InvalidState) as no_session:
                _ = sb.session
            assert no_session.value.state == "stopped"
            with pytest.raises(errors.InvalidState) as refused:
                await agent.pause(sid)
            assert refused.value.state == "stopped"
            observed = await agent.driver.state(sid)
            assert observed.runtime in {"absent", "stopped"} and not observed.channel_open

            await agent.start(sid)
            assert sb.state == State.RUNNING
            s = sb.session
            assert await s.read_file("/work/kept.txt") == b"kept across stop"
            info = await s.info()
            assert info["boot_id"] != boot_before and info["running_processes"] == 0
            assert old_counter not in {p["process_id"] for p in await s.processes()}
            r = await s.exec("ps -e -o comm=")
            assert "sleep" not in r.stdout.decode() and "bash" not in r.stdout.decode()
            with pytest.raises(errors.InvalidState) as refused:
                await agent.start(sid)
            assert refused.value.state == "running"

    node.run(scenario())


def test_checkpoint_keeps_running_and_rollback_returns_to_it(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            counter = await start_counter(sb.session)
            await sb.session.write_file("/work/before.txt", b"before the checkpoint")
            at_checkpoint = await read_int(sb.session, "/work/counter")
            snap = await agent.checkpoint(sid)
            assert snap.kind == "full" and snap.image_bytes > 0
            assert sb.state == State.RUNNING

            # the channel survived the checkpoint and the counter keeps counting
            s = sb.session
            assert counter in await running_ids(s)
            after_checkpoint = await read_int(s, "/work/counter")
            await eventually(lambda: _above(s, after_checkpoint + 15), what="counting after the checkpoint")
            await s.write_file("/work/after.txt", b"after the checkpoint")
            before_rollback = await read_int(s, "/work/counter")

            await agent.rollback(sid, snap.snapshot_id)
            assert sb.state == State.RUNNING
            s = sb.session
            names = {e["name"] for e in await s.list_dir("/work")}
            assert "after.txt" not in names and "before.txt" in names
            restored = await read_int(s, "/work/counter")
            assert at_checkpoint <= restored < before_rollback, (at_checkpoint, restored, before_rollback)
            assert counter in await running_ids(s), "the checkpointed process is back under its id"
            await eventually(lambda: _above(s, restored + 5), what="counting on from the checkpoint")

            with pytest.raises(errors.NotFound):
                await agent.rollback(sid, "snap-" + "a" * 26)

    node.run(scenario())


def test_disk_snapshot_rollback_restores_files_and_restarts_processes(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            counter = await start_counter(sb.session)
            await sb.session.write_file("/work/a.txt", b"version 1")
            snap = await agent.disk_snapshot(sid)
            assert snap.kind == "disk"
            await sb.session.write_file("/work/a.txt", b"version 2")
            await sb.session.write_file("/work/b.txt", b"new")
            boot_before = (await sb.session.info())["boot_id"]

            await agent.rollback(sid, snap.snapshot_id)
            s = sb.session
            assert await s.read_file("/work/a.txt") == b"version 1"
            with pytest.raises(errors.NotFound):
                await s.read_file("/work/b.txt")
            info = await s.info()
            assert info["boot_id"] != boot_before, "processes restart from the template's init"
            assert counter not in {p["process_id"] for p in await s.processes()}

    node.run(scenario())


def test_fork_children_continue_the_parent_and_diverge(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent, env={"FROM_PARENT": "yes"}) as parent:
            pid = parent.sandbox_id
            counter = await start_counter(parent.session)
            await parent.session.write_file("/work/shared.txt", b"written by the parent")
            children = await agent.fork(pid)
            try:
                assert len(children) == 1
                child = children[0]
                assert child.sandbox_id != pid and child.state == State.RUNNING
                c = child.session
                p = parent.session
                assert await c.read_file("/work/shared.txt") == b"written by the parent"
                assert counter in await running_ids(c), "the child runs the parent's processes"
                assert counter in await running_ids(p)
                start = await read_int(c, "/work/counter")
                await eventually(lambda: _above(c, start + 5), what="the child's counter counts")
                assert (await c.exec("echo $FROM_PARENT")).stdout == b"yes\n"

                # they diverge
                await p.write_file("/work/parent-only.txt", b"p")
                await c.write_file("/work/child-only.txt", b"c")
                p_names = {e["name"] for e in await p.list_dir("/work")}
                c_names = {e["name"] for e in await c.list_dir("/work")}
                assert "parent-only.txt" in p_names and "child-only.txt" not in p_names
                assert "child-only.txt" in c_names and "parent-only.txt" not in c_names
                await c.signal(counter, "KILL")
                await eventually(lambda: _stopped(c, counter), what="the child's counter killed")
                assert counter in await running_ids(p), "killing it in the child leaves the parent's"

                # reseeded: different boot ids, different random bytes
                p_info, c_info = await p.info(), await c.info()
                assert p_info["boot_id"] != c_info["boot_id"]
                read = "head -c 32 /dev/urandom | od -An -tx1"
                assert (await p.exec(read)).stdout != (await c.exec(read)).stdout
            finally:
                await delete_quietly(agent, *(ch.sandbox_id for ch in children))

    node.run(scenario())


async def _stopped(session, process_id: str) -> bool:  # type: ignore[no-untyped-def]
    return process_id not in await running_ids(session)


def test_fork_three_children_at_once(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as parent:
            await parent.session.write_file("/work/seed.txt", b"seed")
            counter = await start_counter(parent.session)
            snap = await agent.checkpoint(parent.sandbox_id)
            children = await agent.fork(parent.sandbox_id, snapshot_id=snap.snapshot_id, count=3)
            try:
                assert len({c.sandbox_id for c in children}) == 3
                boot_ids = {(await parent.session.info())["boot_id"]}
                randoms = set()
                for i, child in enumerate(children):
                    s = child.session
                    assert await s.read_file("/work/seed.txt") == b"seed"
                    assert counter in await running_ids(s)
                    await s.write_file("/work/me.txt", str(i).encode())
                    boot_ids.add((await s.info())["boot_id"])
                    randoms.add((await s.exec("head -c 32 /dev/urandom | od -An -tx1")).stdout)
                assert len(boot_ids) == 4, "every child is reseeded"
                assert len(randoms) == 3
                for i, child in enumerate(children):
                    assert await child.session.read_file("/work/me.txt") == str(i).encode()
                with pytest.raises(errors.NotFound):
                    await parent.session.read_file("/work/me.txt")
            finally:
                await delete_quietly(agent, *(c.sandbox_id for c in children))

    node.run(scenario())
