"""A checkpoint holds the sandbox through its own control socket, not `runsc pause` (ADR 0084), on real runsc.

- A checkpoint left paused (a suspend's) holds the runtime: the node reports it paused, runsc's own state
  still says running (runsc was not asked), and the sandbox's processes stand still (a counter ticking every
  0.1 s does not move in a second). The resume lets them go on, and the hold's mark is gone.
- A helper that restarts while a runtime is held (a new `Runtimes` over the same files) still sees it
  paused and releases it.
- (A held sandbox is deleted like any other: tests/runtime/test_runsc_freezer.py.)
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from space.core.ids import new_snapshot_id
from space.node.agent.agent import NodeAgent
from space.node.helper.runsc import Runsc
from space.node.helper.runtime import Runtimes
from tests.support.runsc_state import runsc_state, runtime_processes
from tests.support.sandboxes import counter_above, eventually, new_sandbox, read_int, start_counter

pytestmark = pytest.mark.root


def test_a_checkpoint_left_paused_holds_the_sandbox_and_a_resume_lets_it_go(node) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent
    data_dir: pathlib.Path = node.data_dir

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            await start_counter(sb.session)
            await eventually(lambda: counter_above(sb, 2), what="counting")
            container, _ = runtime_processes(data_dir, sid)
            async with sb.lock:
                before = await read_int(sb.session, "/work/counter")
                await agent.driver.checkpoint(sid, new_snapshot_id(), keep_running=True, leave_paused=True)
                assert (await agent.driver.state(sid)).runtime == "paused"
                assert runsc_state(data_dir, container)["status"] == "running"  # runsc was not asked
                assert (data_dir / "run" / sid / "held").read_text() == container
                await asyncio.sleep(1.0)  # ten ticks of a running counter
                await agent.driver.resume(sid)
                after = await read_int(sb.session, "/work/counter")
                assert after - before <= 3, f"the counter moved {after - before} ticks while held"
                assert (await agent.driver.state(sid)).runtime == "running"
                assert not (data_dir / "run" / sid / "held").exists()
            await eventually(lambda: counter_above(sb, after + 3), what="counting after the resume")

    node.run(scenario())


def test_a_restarted_helper_sees_a_held_runtime_paused_and_releases_it(node) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            await start_counter(sb.session)
            async with sb.lock:
                await agent.driver.checkpoint(sid, new_snapshot_id(), keep_running=True, leave_paused=True)
                layout = node.node.layout
                fresh = Runtimes(layout, Runsc(layout.runsc_root), 0, node.node.cgroup_parent)
                assert fresh.status(sid) == "paused" and fresh.held(sid)
                fresh.release(sid)
                assert fresh.status(sid) == "running" and not fresh.held(sid)
                fresh.release(sid)  # nothing held: a no-op, never a second resume
                assert fresh.status(sid) == "running"
            standing = await read_int(sb.session, "/work/counter")
            await eventually(lambda: counter_above(sb, standing + 3), what="counting after the release")

    node.run(scenario())
