"""A pause freezes the runtime's cgroup instead of running `runsc pause` (ADR 0082), on real runsc.

- Paused: the kernel's freezer reports the container's cgroup FROZEN, its processes use no CPU (a busy
  counter's cgroup CPU time stands still), runsc's own state still says running (runsc was not asked), and
  the node reports the sandbox paused. Resumed: the cgroup is thawed and the counter counts on.
- A frozen sandbox, and one a checkpoint left held (ADR 0084), is deleted like any other: its sandbox,
  gofer and holder processes are gone when the delete answers (frozen tasks act on SIGKILL only once
  thawed, a held sandbox only once resumed), its container and cgroup soon after.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from space.core.ids import new_snapshot_id
from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from tests.support.runsc_state import (
    alive,
    cgroup_left,
    controller_file,
    runsc_knows,
    runsc_state,
    runtime_processes,
)
from tests.support.sandboxes import counter_above, eventually, new_sandbox, read_int, start_counter

pytestmark = pytest.mark.root


def test_a_pause_freezes_the_runtime_and_a_resume_thaws_it(node) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent
    data_dir: pathlib.Path = node.data_dir

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            await sb.session.exec(["sh", "-c", "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &"])
            await start_counter(sb.session)
            container, _ = runtime_processes(data_dir, sid)
            state = controller_file(container, "freezer", "freezer.state")
            cpu = controller_file(container, "cpuacct", "cpuacct.usage")

            await agent.pause(sid)
            assert sb.state == State.PAUSED
            assert state.read_text().strip() == "FROZEN"
            assert runsc_state(data_dir, container)["status"] == "running"  # runsc was not asked
            assert (await agent.driver.state(sid)).runtime == "paused"
            used = int(cpu.read_text())
            await asyncio.sleep(0.5)
            assert int(cpu.read_text()) == used, "a frozen sandbox used CPU"

            await agent.resume(sid)
            assert sb.state == State.RUNNING
            assert state.read_text().strip() == "THAWED"
            assert (await agent.driver.state(sid)).runtime == "running"
            standing = await read_int(sb.session, "/work/counter")
            await eventually(lambda: counter_above(sb, standing + 3), what="counting after the resume")
            assert int(cpu.read_text()) > used

    node.run(scenario())


@pytest.mark.parametrize("stopped_by", ["freeze", "hold"])
def test_a_stopped_sandbox_is_deleted_and_leaves_nothing(node, stopped_by: str) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent
    data_dir: pathlib.Path = node.data_dir

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            sid = sb.sandbox_id
            await start_counter(sb.session)
            container, pids = runtime_processes(data_dir, sid)
            if stopped_by == "freeze":
                await agent.pause(sid)
                assert controller_file(container, "freezer", "freezer.state").read_text().strip() == "FROZEN"
            else:  # a suspend's checkpoint leaves it so
                async with sb.lock:
                    await agent.driver.checkpoint(
                        sid, new_snapshot_id(), keep_running=True, leave_paused=True
                    )
                assert (data_dir / "run" / sid / "held").read_text() == container
            await agent.delete(sid)
            assert not [role for role, pid in pids.items() if alive(pid)]

            async def retired() -> bool:
                return not runsc_knows(data_dir, container) and not cgroup_left(container)

            await eventually(retired, timeout=30, what=f"container {container} retired")

    node.run(scenario())
