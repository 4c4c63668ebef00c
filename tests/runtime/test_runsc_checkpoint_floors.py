"""The checkpoint, rollback and fork floors of ADR 0077 on real runsc.

- A checkpoint answers before its runtime resumes: the runtime is left paused by `runsc checkpoint` and
  resumed in the background under the sandbox's lock. The sandbox runs on (its counter counts, an exec
  answers), a pause asked for at once is a real pause (runsc says paused, the counter stands still) and
  a fork right after the checkpoint works.
- A rollback (to a full checkpoint or to a disk snapshot) discards the sandbox's current runtime: its
  processes are SIGKILLed directly instead of through `runsc kill` (nothing of them is kept: the root
  filesystem is replaced by the snapshot's), and their end is not waited for (ADR 0088). Whatever state
  it was in (running, paused), nothing of the old incarnation is left: its sandbox, gofer and holder
  processes are gone soon after the rollback answers, and its holder leaves the run directory to the new
  incarnation (its socket stays, no exit record appears); its runsc container and cgroup go too (retired
  in the background); the files are the snapshot's, and the processes carry on from the checkpoint
  (full) or start from the template's init (disk).
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from tests.support.runsc_state import alive, cgroup_left, runsc_knows, runtime_processes, runtime_status
from tests.support.sandboxes import (
    counter_above,
    eventually,
    new_sandbox,
    read_int,
    running_ids,
    start_counter,
)

pytestmark = pytest.mark.root


@pytest.mark.parametrize("kind", ["full", "disk"])
@pytest.mark.parametrize("paused", [False, True], ids=["running", "paused"])
def test_rollback_leaves_nothing_of_the_old_runtime(node, paused: bool, kind: str) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent
    data_dir: pathlib.Path = node.data_dir

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            counter = await start_counter(sb.session)
            at_checkpoint = await read_int(sb.session, "/work/counter")
            snap = await (agent.checkpoint if kind == "full" else agent.disk_snapshot)(sid)
            await eventually(
                lambda: counter_above(sb, at_checkpoint + 10), what="counting on after the snapshot"
            )  # fmt: skip
            await sb.session.write_file("/work/after.txt", b"after the snapshot")
            before = await read_int(sb.session, "/work/counter")
            old_container, old = runtime_processes(data_dir, sid)
            assert all(alive(pid) for pid in old.values()), old  # the oracle sees them now
            if paused:
                await agent.pause(sid)
                assert sb.state == State.PAUSED

            await agent.rollback(sid, snap.snapshot_id)

            new_container, new = runtime_processes(data_dir, sid)
            assert new_container != old_container and all(alive(pid) for pid in new.values())
            assert sb.state == State.RUNNING

            async def old_gone() -> bool:
                return not any(alive(pid) for pid in old.values())

            await eventually(old_gone, timeout=10, what=f"the processes of {old_container} gone: {old}")
            # The old holder ended after the new one took the run directory: it left it alone.
            run_dir = data_dir / "run" / sid
            assert (run_dir / "channel.sock").exists() and not (run_dir / "exit.json").exists()
            assert runtime_status(data_dir, sid) == "running"
            await sb.session.ping()  # the new incarnation's channel outlived the old holder's end
            assert "after.txt" not in {e["name"] for e in await sb.session.list_dir("/work")}
            restored = await read_int(sb.session, "/work/counter")
            assert at_checkpoint <= restored < before, (at_checkpoint, restored, before)
            if kind == "full":  # the processes as they were, counting on
                assert counter in await running_ids(sb.session)
                await eventually(
                    lambda: counter_above(sb, restored + 5), what="counting on from the checkpoint"
                )
            else:  # the files as they were, the processes from the template's init
                assert counter not in await running_ids(sb.session)

            async def retired() -> bool:
                return not runsc_knows(data_dir, old_container) and not cgroup_left(old_container)

            await eventually(retired, timeout=30, what=f"container {old_container} retired")
            assert os.path.isdir(data_dir / "run" / sid)

    node.run(scenario())


def test_a_checkpoint_answers_and_what_follows_waits_for_its_resume(node) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent
    data_dir: pathlib.Path = node.data_dir

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            await start_counter(sb.session)
            await agent.checkpoint(sid)
            assert sb.state == State.RUNNING
            assert (await sb.session.exec(["true"])).exit_code == 0  # answered: it runs
            async with sb.lock:  # the background resume has let go
                assert runtime_status(data_dir, sid) == "running"
            await eventually(lambda: counter_above(sb, 3), what="counting after the checkpoint")

            await agent.checkpoint(sid)
            await agent.pause(sid)  # asked at once: it must not be undone by the checkpoint's resume
            await asyncio.sleep(0.3)
            assert sb.state == State.PAUSED and runtime_status(data_dir, sid) == "paused"
            await agent.resume(sid)
            standing = await read_int(sb.session, "/work/counter")
            await eventually(lambda: counter_above(sb, standing + 3), what="counting after the resume")

            snap = await agent.checkpoint(sid)
            children = await agent.fork(
                sid, snapshot_id=snap.snapshot_id
            )  # restored while the parent resumes
            try:
                assert (await children[0].session.exec(["true"])).exit_code == 0
            finally:
                await agent.delete(children[0].sandbox_id)
            async with sb.lock:
                assert runtime_status(data_dir, sid) == "running"

    node.run(scenario())
