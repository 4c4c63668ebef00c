"""Per-sandbox resource limits on real gVisor sandboxes: each test runs an abuser in a limited sandbox next
to a neighbour, and checks that the limit holds, the neighbour keeps answering and the node stays healthy.

What the host kernel enforces (runsc puts the Sentry, its gofer and its stub processes in the cgroup
/space/<sandbox id>, cgroup v1 here; the disk limit is a btrfs simple-quota on the sandbox's subvolume)
is read back from the host, so a limit that is not applied fails the test rather than passing quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.guest import chunked
from space.node.helper import oci
from tests.support.neighbours import NeighbourProbe, node_healthy
from tests.support.sandboxes import new_sandbox

pytestmark = pytest.mark.root

MiB = 1 << 20

CGROUPS = pathlib.Path("/sys/fs/cgroup")


def cgroup_dir(controller: str, sandbox_id: str) -> pathlib.Path | None:
    """The sandbox's current cgroup: /space/<sandbox id>, or /space/<sandbox id>-<generation> when the
    helper names runsc containers per incarnation (the newest one)."""
    base = CGROUPS / controller / "space"
    found = [
        p for p in base.glob(f"{sandbox_id}*") if p.name == sandbox_id or p.name.startswith(sandbox_id + "-")
    ]
    if not found:
        return None
    return max(found, key=lambda p: int(p.name.rsplit("-", 1)[1]) if p.name != sandbox_id else -1)


def read_cgroup(controller: str, sandbox_id: str, name: str) -> str | None:
    group = cgroup_dir(controller, sandbox_id)
    try:
        return (group / name).read_text() if group is not None else None
    except OSError:
        return None


def cgroup_kv(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


async def limited_outcome(agent: NodeAgent, limited: SandboxHandle) -> str:
    """What became of the limited sandbox: 'running' (answers exec) or a description of its death."""
    state = await agent.driver.state(limited.sandbox_id)
    if limited.channel is not None and not limited.channel.closed:
        with contextlib.suppress(errors.SpaceError):
            if (await limited.session.exec("echo ok", timeout=10)).stdout == b"ok\n":
                return "running"
    return (
        f"dead (runtime {state.runtime}, holder {state.channel_open}, exit {state.exit}; "
        f"the agent still records state '{limited.state}')"
    )


FORK_BOMB = """
import os, sys, time
made = 0
try:
    for _ in range(2000):
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        made += 1
except OSError as exc:
    print(f"fork failed after {made}: {exc}", flush=True)
    sys.exit(3)
print(f"forked all {made}", flush=True)
"""


def test_fork_bomb_hits_the_pids_limit(node) -> None:
    agent: NodeAgent = node.agent
    limits = SandboxLimits(pids=96)

    async def scenario() -> None:
        async with new_sandbox(agent, limits=limits) as limited, new_sandbox(agent) as neighbour:
            sid = limited.sandbox_id
            # The host limit carries headroom for the application kernel's own tasks (see oci.resources).
            assert read_cgroup("pids", sid, "pids.max") == f"{oci.host_pids(limits)}\n"
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            peak_events = 0
            oom_kills = 0
            bomb = asyncio.create_task(limited.session.exec(["python3", "-c", FORK_BOMB], timeout=30))
            try:
                while not bomb.done():
                    peak_events = max(
                        peak_events, cgroup_kv(read_cgroup("pids", sid, "pids.events")).get("max", 0)
                    )
                    oom_kills = max(
                        oom_kills,
                        cgroup_kv(read_cgroup("memory", sid, "memory.oom_control")).get("oom_kill", 0),
                    )
                    await asyncio.sleep(0.01)
                try:
                    result = bomb.result()
                    outcome = f"exit {result.exit_code} signal {result.signal}: {result.stdout!r}"
                except errors.ChannelError as exc:
                    result, outcome = None, f"the sandbox's channel closed: {exc}"
                await asyncio.sleep(1.0)
            finally:
                bomb.cancel()
                await probe.stop()
            print(f"fork bomb: {outcome}; host pids.events max={peak_events}; oom kills {oom_kills}")
            assert result is None or b"forked all" not in result.stdout, "2000 forks with pids=96"
            # Contained by the host: the pids limit or the memory limit stopped it (whichever a bomb of
            # Python processes reaches first), or fork failed inside.
            stopped_by_limit = peak_events > 0 or oom_kills > 0
            assert stopped_by_limit or (result is not None and b"fork failed" in result.stdout), outcome
            if result is None:
                # The sandbox died with its runtime: the node noticed and says so.
                assert limited.state == State.CRASHED, limited.state
            probe.check()
            await node_healthy(agent, neighbour)
            print(f"limited sandbox afterwards: {await limited_outcome(agent, limited)}")

    node.run(scenario())


MEMORY_HOG = """
chunks = []
for i in range(2048):
    chunks.append(bytearray(b"x") * (1 << 20))  # written, so every page is really used
    if i % 256 == 0:
        print(f"{i} MiB", flush=True)
print("allocated 2 GiB", flush=True)
"""


def test_memory_hog_is_stopped_by_the_memory_limit(node) -> None:
    agent: NodeAgent = node.agent
    limits = SandboxLimits(memory_mb=256)

    async def scenario() -> None:
        async with new_sandbox(agent, limits=limits) as limited, new_sandbox(agent) as neighbour:
            sid = limited.sandbox_id
            assert read_cgroup("memory", sid, "memory.limit_in_bytes") == f"{256 * MiB}\n"
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            try:
                try:
                    result = await limited.session.exec(["python3", "-c", MEMORY_HOG], timeout=60)
                    outcome = (
                        f"exit {result.exit_code} signal {result.signal} stderr {result.stderr[-200:]!r}"
                    )
                except errors.ChannelError as exc:
                    result, outcome = None, f"the sandbox's channel closed: {exc}"
                oom = cgroup_kv(read_cgroup("memory", sid, "memory.oom_control"))
                peak = int(read_cgroup("memory", sid, "memory.max_usage_in_bytes") or 0)
                await asyncio.sleep(1.0)
            finally:
                await probe.stop()
            print(f"memory hog: {outcome}; host oom_kill={oom.get('oom_kill')} peak={peak / MiB:.0f} MiB")
            assert result is None or (b"allocated 2 GiB" not in result.stdout and not result.ok), outcome
            assert peak <= 256 * MiB + MiB, f"the sandbox's cgroup peaked at {peak / MiB:.0f} MiB"
            probe.check()
            await node_healthy(agent, neighbour)
            print(f"limited sandbox afterwards: {await limited_outcome(agent, limited)}")

    node.run(scenario())


def test_disk_filler_gets_a_quota_error(node) -> None:
    agent: NodeAgent = node.agent
    limits = SandboxLimits(disk_mb=128)

    async def scenario() -> None:
        async with new_sandbox(agent, limits=limits) as limited, new_sandbox(agent) as neighbour:
            s = limited.session
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            try:
                r = await s.exec("dd if=/dev/zero of=/work/fill bs=1M count=400", timeout=120)
                # through the channel too: the guest's error is typed
                with pytest.raises(errors.ResourceExhausted):
                    await s.write_file("/work/fill2", chunked(b"\0" * (64 * MiB)))
                await asyncio.sleep(1.0)
            finally:
                await probe.stop()
            print(f"disk filler: exit {r.exit_code}, {r.stderr.decode().splitlines()[:1]}")
            assert r.exit_code != 0
            assert b"Disk quota exceeded" in r.stderr or b"No space left" in r.stderr, r.stderr
            size = (await s.stat("/work/fill"))["size"]
            assert size <= 136 * MiB, f"wrote {size / MiB:.0f} MiB with disk_mb=128"
            probe.check()
            await node_healthy(agent, neighbour)
            # the limited sandbox is fine once it frees space, and its neighbour was never affected
            await s.remove("/work/fill")
            await s.exec("sync")
            assert (await s.exec("echo ok > /work/small && cat /work/small")).stdout == b"ok\n"
            r = await neighbour.session.exec(
                "dd if=/dev/zero of=/work/n bs=1M count=200 && sync", timeout=120
            )
            assert r.exit_code == 0, r.stderr
            assert await limited_outcome(agent, limited) == "running"

    node.run(scenario())


def test_cpu_limit_caps_cpu_time(node) -> None:
    agent: NodeAgent = node.agent
    limits = SandboxLimits(cpus=0.5)

    async def scenario() -> None:
        async with new_sandbox(agent, limits=limits) as limited:
            sid = limited.sandbox_id
            assert read_cgroup("cpu", sid, "cpu.cfs_quota_us") == "50000\n"
            before = int(read_cgroup("cpuacct", sid, "cpuacct.usage") or 0)
            started = time.monotonic()
            burn = "timeout 3 sh -c 'while :; do :; done' & timeout 3 sh -c 'while :; do :; done'; wait"
            await limited.session.exec(burn, timeout=30)
            wall = time.monotonic() - started
            used = (int(read_cgroup("cpuacct", sid, "cpuacct.usage") or 0) - before) / 1e9
            print(f"cpu: {used:.2f}s of CPU in {wall:.2f}s with cpus=0.5")
            assert used <= 0.5 * wall * 1.3 + 0.2, f"{used:.2f}s of CPU in {wall:.2f}s with cpus=0.5"

    node.run(scenario())
