"""What the metrics history costs a node (ADR 0053): N idle sandboxes of the python template on a real runsc
node, sampled by the agent's own MetricsSampler tick by tick.

Run as root: `.venv/bin/python -m bench.metrics_bench [--sandboxes 20] [--ticks 30] [--json]`.

Per tick: its wall time, the agent's CPU time (process_time inside the tick: the driver call, the rings) and
the root helper's CPU time (utime + stime of the helper process across the ticks: the `sandbox.metrics` verb
reading every sandbox's cgroup files and storage accounting), and for comparison the same readings made one
helper call per sandbox (`sandbox.usage` + `sandbox.storage`, what the node had before). The memory a ring
takes is computed from its capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.stats import summarize, write_json
from space.core.settings import SandboxLimits
from space.node.agent.metrics import MetricsSampler
from space.node.local import LocalNode

TICK_HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_HZ


async def _timed_ticks(sampler: MetricsSampler, helper_pid: int, ticks: int) -> dict[str, Any]:
    walls, agent_cpu = [], []
    helper_before = cpu_seconds(helper_pid)
    for _ in range(ticks):
        cpu, began = time.process_time(), time.perf_counter()
        await sampler.tick()
        walls.append((time.perf_counter() - began) * 1000)
        agent_cpu.append((time.process_time() - cpu) * 1000)
    helper_ms = (cpu_seconds(helper_pid) - helper_before) * 1000 / ticks
    return {
        "wall_ms": summarize(walls),
        "agent_cpu_ms": summarize(agent_cpu),
        "helper_cpu_ms_per_tick": round(helper_ms, 2),
    }


async def _per_sandbox_calls(node_agent: Any, helper_pid: int, ticks: int) -> dict[str, Any]:
    """The same counters read one helper call per sandbox and counter (no batching), for comparison."""
    walls = []
    helper_before = cpu_seconds(helper_pid)
    cpu_before = time.process_time()
    for _ in range(ticks):
        began = time.perf_counter()
        for sandbox_id in list(node_agent.sandboxes):
            await node_agent.driver.usage(sandbox_id)
            await node_agent.driver.storage_usage(sandbox_id, fresh=False)
        walls.append((time.perf_counter() - began) * 1000)
    return {
        "wall_ms": summarize(walls),
        "agent_cpu_ms_per_tick": round((time.process_time() - cpu_before) * 1000 / ticks, 2),
        "helper_cpu_ms_per_tick": round((cpu_seconds(helper_pid) - helper_before) * 1000 / ticks, 2),
    }


async def run(data_dir: pathlib.Path, sandboxes: int, ticks: int) -> dict[str, Any]:
    node = LocalNode(data_dir, cgroup_parent="space-bench-metrics")
    agent = await node.start(progress=lambda line: print(f"  | {line}", file=sys.stderr, flush=True))
    assert node.helper_process is not None
    helper_pid = node.helper_process.pid
    limits = SandboxLimits(cpus=0.5, memory_mb=256)
    try:
        for index in range(sandboxes):
            handle = await agent.create("python", limits=limits)
            await handle.session.exec(["true"])
            print(f"  | sandbox {index + 1}/{sandboxes}", file=sys.stderr, flush=True)
        sampler = MetricsSampler(agent, interval_s=5.0, keep_s=3600.0)
        await sampler.tick()  # primes every ring
        batched = await _timed_ticks(sampler, helper_pid, ticks)
        per_sandbox = await _per_sandbox_calls(agent, helper_pid, ticks)
        ring = next(iter(sampler.rings.values()))
        sample = ring.window(None, None, 1)[0][-1].model_dump()
        return {
            "sandboxes": sandboxes, "ticks": ticks, "batched": batched, "per_sandbox_calls": per_sandbox,
            "ring_bytes": 5 * 8 * ring.capacity, "ring_capacity": ring.capacity, "last_sample": sample,
            "load_average": os.getloadavg(),
        }  # fmt: skip
    finally:
        await agent.delete_all()
        await node.stop(purge=True)
        for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{node.cgroup_parent}"):
            with contextlib.suppress(OSError):
                parent.rmdir()  # the node's own cgroup parent, empty now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args()
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-metrics-", dir="/var/tmp"))
    try:
        results = asyncio.run(run(data_dir, args.sandboxes, args.ticks))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    path = write_json(results, "metrics")
    print(json.dumps(results, indent=2))
    if not args.json:
        print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
