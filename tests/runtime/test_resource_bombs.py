"""A fork bomb inside a real runsc sandbox fails INSIDE that sandbox (ADR 0036): every guest process
carries RLIMIT_NPROC = `pids`, which gVisor's kernel enforces, and the host cgroup's task limit sits above
what that many guest tasks cost on the host, so the bomb's forks fail with EAGAIN in the guest while the
host limit is never reached, no process is killed by the host, the sandbox still answers exec afterwards,
and a neighbour and the node stay healthy. (A memory hog cannot be held inside: the host kills the
sandbox's runtime, and the control plane recovers it: tests/runtime/test_resource_bombs_recovery.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from space.core import errors
from space.core.settings import SandboxLimits
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.helper import oci
from tests.support.cgroups import cgroup_kv, read_cgroup
from tests.support.neighbours import NeighbourProbe, node_healthy
from tests.support.sandboxes import new_sandbox

pytestmark = pytest.mark.root

FORK_BOMB = """
import os, sys, time
made = 0
try:
    for _ in range(5000):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        made += 1
except OSError as exc:
    print(f"fork failed after {made}: {exc.errno} {exc.strerror}", flush=True)
    sys.exit(3)
print(f"forked all {made}", flush=True)
"""


# Until only the init (spaced) and this python are left in the guest.
WAIT_FOR_CHILDREN = """
import os, time
while len([p for p in os.listdir("/proc") if p.isdigit()]) > 2:
    time.sleep(0.2)
"""


async def answers_again(
    sandbox: SandboxHandle,
    command: str | list[str] = "echo ok",
    expect: bytes = b"ok\n",
    within_s: float = 30.0,
) -> float:
    """Seconds until `command` runs in `sandbox` again and prints `expect`: while the bomb's children still
    hold the task budget, the guest's daemon cannot start the thread an exec needs (a GuestError)."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(errors.GuestError):
            if (await sandbox.session.exec(command, timeout=30)).stdout == expect:
                return time.monotonic() - started
        assert time.monotonic() - started < within_s, "the sandbox never answered again"
        await asyncio.sleep(0.2)


def test_a_fork_bomb_fails_inside_the_sandbox(node) -> None:
    agent: NodeAgent = node.agent
    limits = SandboxLimits(pids=96)

    async def scenario() -> None:
        # A cold boot: the init gets this sandbox's own budget (a warm start carries the template's).
        async with new_sandbox(agent, limits=limits, warm=False) as bombed, new_sandbox(agent) as neighbour:
            sid = bombed.sandbox_id
            assert read_cgroup("pids", sid, "pids.max") == f"{oci.host_pids(limits)}\n"
            rlimits = (await bombed.session.exec("cat /proc/self/limits", timeout=10)).stdout.decode()
            assert any(line.startswith("Max processes") and line.split()[2:4] == ["96", "96"]
                       for line in rlimits.splitlines()), rlimits  # fmt: skip
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            host_max_events = oom_kills = peak_tasks = 0
            bomb = asyncio.create_task(bombed.session.exec(["python3", "-c", FORK_BOMB], timeout=60))
            try:
                while not bomb.done():
                    host_max_events = max(
                        host_max_events, cgroup_kv(read_cgroup("pids", sid, "pids.events")).get("max", 0)
                    )
                    oom_kills = max(
                        oom_kills,
                        cgroup_kv(read_cgroup("memory", sid, "memory.oom_control")).get("oom_kill", 0),
                    )
                    peak_tasks = max(peak_tasks, int(read_cgroup("pids", sid, "pids.current") or 0))
                    await asyncio.sleep(0.01)
                result = bomb.result()
                recovered_in = await answers_again(bombed)
            finally:
                bomb.cancel()
                await probe.stop()
            print(f"fork bomb: {result.stdout!r}; host tasks peak {peak_tasks} of {oci.host_pids(limits)}; "
                  f"answers again after {recovered_in:.1f}s")  # fmt: skip
            # Stopped inside: fork failed in the guest with EAGAIN (11) before 96 tasks ...
            assert result.exit_code == 3 and b"fork failed after" in result.stdout, result
            assert b": 11 " in result.stdout, result.stdout
            made = int(result.stdout.split(b"after ")[1].split(b":")[0])
            assert 40 <= made < 96, made
            # ... and nothing on the host had to step in.
            assert host_max_events == 0, "the host's task limit was reached"
            assert oom_kills == 0, "the host killed a process of the sandbox"
            assert peak_tasks < oci.host_pids(limits)
            probe.check()
            await node_healthy(agent, neighbour)
            # The bomb's children (asleep 2 s) end on their own before the sandbox is deleted.
            # One answer above does not mean the budget is free: this exec may also meet a full one.
            await answers_again(bombed, ["python3", "-c", WAIT_FOR_CHILDREN], expect=b"")

    node.run(scenario())
