"""Node-level benchmarks of the runsc driver (issue: node runtime). Run as root: `make bench`.

Prints a table and writes bench/results/node-<time>.json with one object per measured operation, in the
shape `space bench --json` uses: {"p50_ms", "p90_ms", "p99_ms", "n", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any

from bench.stats import print_table, summarize, write_json
from space.core.ids import new_snapshot_id
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.drivers.base import SandboxSpec
from space.node.local import LocalNode
from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore

TARGETS = {
    "create_cold": "p50 <= 300 ms (create to first exec answered)",
    "exec_true": "p50 <= 12 ms",
    "file_4k_write_read": "p50 <= 3 ms",
    "transfer_100mib": ">= 100 MB/s",
    "pause": "p50 <= 40 ms",
    "resume": "p50 <= 40 ms",
    "checkpoint": "<= 200 ms",
    "restore": "<= 350 ms to first answer",
    "idle_memory": "<= 25 MB per idle sandbox",
    "concurrent_sandboxes": "50 running at once",
    # issue 4: snapshots, fork, suspend/restore across nodes (python template, a few MB of files)
    "disk_snapshot": "p50 <= 30 ms",
    "full_checkpoint": "p50 <= 250 ms (sandbox runs on)",
    "fork_first_answer": "p50 <= 400 ms (checkpoint + child restore + first exec)",
    "fork_from_checkpoint": "child restore + first exec, from an existing full checkpoint",
    "suspend_local_store": "<= 1.5 s (pause, checkpoint, export, upload, manifest)",
    "restore_other_node": "<= 1.5 s to first answer (download, verify, receive, restore)",
    "snapshot_exclusive_10mb": "<= 11 MB exclusive after writing 10 MB",
}
MiB = 1 << 20
FEW_MB_OF_FILES = {f"/work/files/f{i}.bin": (i + 1) * 256 * 1024 for i in range(6)}  # 5.25 MiB


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def pss_kib(pid: int) -> int:
    try:
        for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def sandbox_pids(data_dir: pathlib.Path, sandbox_id: str) -> set[int]:
    """The host processes one sandbox costs: its holder, runsc's own process, and its cgroup's members."""
    pids: set[int] = set()
    holder = data_dir / "run" / sandbox_id / "holder.json"
    if holder.exists():
        info = json.loads(holder.read_text())
        pids.update({int(info["holder_pid"]), int(info["runtime_pid"])})
    container = (data_dir / "run" / sandbox_id / "container").read_text().strip()
    procs = pathlib.Path("/sys/fs/cgroup/memory/space") / container / "cgroup.procs"
    if procs.exists():
        pids.update(int(p) for p in procs.read_text().split())
    return pids


async def bench_create(agent: NodeAgent, n: int) -> tuple[dict[str, Any], list[SandboxHandle]]:
    samples = []
    handles = []
    for _ in range(n):
        start = time.perf_counter()
        handle = await agent.create("python")
        result = await handle.session.exec(["true"])
        samples.append(_ms(start))
        assert result.exit_code == 0
        handles.append(handle)
    return summarize(samples), handles


async def bench_exec(sandbox: SandboxHandle, n: int) -> dict[str, Any]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        result = await sandbox.session.exec(["true"])
        samples.append(_ms(start))
        assert result.exit_code == 0
    return summarize(samples)


async def bench_small_files(sandbox: SandboxHandle, n: int) -> dict[str, Any]:
    payload = os.urandom(4096)
    samples = []
    for i in range(n):
        start = time.perf_counter()
        await sandbox.session.write_file(f"/work/small-{i % 8}", payload)
        data = await sandbox.session.read_file(f"/work/small-{i % 8}")
        samples.append(_ms(start))
        assert data == payload
    return summarize(samples)


async def bench_transfer(sandbox: SandboxHandle, mib: int) -> dict[str, Any]:
    chunk = os.urandom(1 << 20)

    async def source() -> Any:
        for _ in range(mib):
            yield chunk

    start = time.perf_counter()
    await sandbox.session.write_file("/work/big.bin", source())
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    total = 0
    async for part in sandbox.session.read_file_stream("/work/big.bin"):
        total += len(part)
    read_s = time.perf_counter() - start
    await sandbox.session.remove("/work/big.bin")
    assert total == mib << 20
    return {
        "write_MBps": round(mib * 1.048576 / write_s, 1),
        "read_MBps": round(mib * 1.048576 / read_s, 1),
        "MiB": mib,
    }


async def bench_pause_resume(agent: NodeAgent, sandbox: SandboxHandle, n: int) -> tuple[dict[str, Any], ...]:
    pauses, resumes = [], []
    for _ in range(n):
        start = time.perf_counter()
        await agent.pause(sandbox.sandbox_id)
        pauses.append(_ms(start))
        start = time.perf_counter()
        await agent.resume(sandbox.sandbox_id)
        await sandbox.session.ping()
        resumes.append(_ms(start))
    return summarize(pauses), summarize(resumes)


async def bench_checkpoint_restore(
    agent: NodeAgent, sandbox: SandboxHandle, n: int
) -> tuple[dict[str, Any], ...]:
    checkpoints, restores, images, saves = [], [], [], []
    for _ in range(n):
        start = time.perf_counter()
        record = await agent.checkpoint(sandbox.sandbox_id)
        await sandbox.session.ping()
        checkpoints.append(_ms(start))
        images.append(record.image_bytes)
        saves.append(record.timings.get("checkpoint_ms", 0.0))
        start = time.perf_counter()
        await agent.rollback(sandbox.sandbox_id, record.snapshot_id)
        await sandbox.session.ping()
        restores.append(_ms(start))
        await agent.delete_snapshot(sandbox.sandbox_id, record.snapshot_id)
    image_mb = round(sum(images) / len(images) / 1e6, 2)
    saves.sort()
    return (
        summarize(checkpoints, image_MB=image_mb, runsc_save_p50_ms=round(saves[len(saves) // 2], 1)),
        summarize(restores),
    )


async def bench_idle_memory(
    agent: NodeAgent, data_dir: pathlib.Path, handles: list[SandboxHandle]
) -> dict[str, Any]:
    await asyncio.sleep(2.0)  # let start-up garbage settle
    per_sandbox = []
    for handle in handles:
        per_sandbox.append(sum(pss_kib(pid) for pid in sandbox_pids(data_dir, handle.sandbox_id)) / 1024)
    per_sandbox.sort()
    return {
        "pss_MB_p50": round(per_sandbox[len(per_sandbox) // 2], 1),
        "pss_MB_max": round(per_sandbox[-1], 1),
        "sandboxes": len(per_sandbox),
    }


async def bench_concurrent(agent: NodeAgent, count: int) -> dict[str, Any]:
    start = time.perf_counter()
    sem = asyncio.Semaphore(4)

    async def one() -> SandboxHandle:
        async with sem:
            return await agent.create("python")

    handles = await asyncio.gather(*(one() for _ in range(count)))
    created_s = time.perf_counter() - start
    answers = await asyncio.gather(*(h.session.exec(["true"]) for h in handles))
    ok = sum(1 for a in answers if a.exit_code == 0)
    meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
    mem_available = int(next(line for line in meminfo if line.startswith("MemAvailable")).split()[1])
    for handle in handles:
        await agent.delete(handle.sandbox_id)
    return {
        "running": count,
        "answered": ok,
        "create_all_s": round(created_s, 2),
        "mem_available_GB_at_peak": round(mem_available / 1e6, 2),
    }


async def _with_files(agent: NodeAgent) -> SandboxHandle:
    handle = await agent.create("python")
    for path, size in FEW_MB_OF_FILES.items():
        await handle.session.write_file(path, os.urandom(size))
    return handle


async def bench_disk_snapshot(agent: NodeAgent, sandbox: SandboxHandle, n: int) -> dict[str, Any]:
    samples = []
    for i in range(n):
        await sandbox.session.write_file(f"/work/snap-{i}", os.urandom(64 * 1024))
        start = time.perf_counter()
        record = await agent.disk_snapshot(sandbox.sandbox_id)
        samples.append(_ms(start))
        await agent.delete_snapshot(sandbox.sandbox_id, record.snapshot_id)
    return summarize(samples)


async def bench_full_checkpoint(agent: NodeAgent, sandbox: SandboxHandle, n: int) -> dict[str, Any]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        record = await agent.checkpoint(sandbox.sandbox_id)
        samples.append(_ms(start))
        await sandbox.session.ping()
        await agent.delete_snapshot(sandbox.sandbox_id, record.snapshot_id)
    return summarize(samples)


async def bench_fork(
    agent: NodeAgent, sandbox: SandboxHandle, n: int, snapshot_id: str | None = None
) -> dict[str, Any]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        (child,) = await agent.fork(sandbox.sandbox_id, snapshot_id=snapshot_id)
        result = await child.session.exec(["true"])
        samples.append(_ms(start))
        assert result.exit_code == 0
        await agent.delete(child.sandbox_id)
    return summarize(samples)


async def bench_exclusive(agent: NodeAgent, n: int) -> dict[str, Any]:
    sizes = []
    for _ in range(n):
        handle = await agent.create("python")
        await handle.session.write_file("/work/ten", os.urandom(10 * MiB))
        record = await agent.disk_snapshot(handle.sandbox_id)
        usage = await agent.snapshot_usage(handle.sandbox_id, record.snapshot_id)
        sizes.append(int(usage["exclusive_bytes"]) / 1e6)
        await agent.delete(handle.sandbox_id)
    sizes.sort()
    return {"exclusive_MB_p50": round(sizes[len(sizes) // 2], 2), "exclusive_MB_max": round(sizes[-1], 2),
            "written_MB": round(10 * MiB / 1e6, 2), "n": len(sizes)}  # fmt: skip


async def bench_suspend_restore(
    a: NodeAgent, b: NodeAgent, store: ObjectStore, n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Suspend on node A to the local-directory store, restore on node B to the first answer."""
    suspends, restores, stored = [], [], []
    for i in range(n):
        source = await _with_files(a)
        sid = source.sandbox_id
        prefix = f"bench/{sid}/{i}"
        start = time.perf_counter()
        result = await a.suspend(
            sid, store=store, prefix=prefix, snapshot_id=new_snapshot_id(), data_key=None
        )
        suspends.append(_ms(start))
        stored.append(result["stored_bytes"] / 1e6)
        start = time.perf_counter()
        spec = SandboxSpec(sid, source.spec.template, source.spec.limits, dict(source.spec.env))
        restored = await b.restore_from_store(sid, store=store, prefix=prefix, data_key=None, spec=spec)
        answer = await restored.session.exec(["true"])
        restores.append(_ms(start))
        assert answer.exit_code == 0
        await a.delete(sid)
        await b.delete(sid)
    stored.sort()
    return summarize(suspends, stored_MB=round(stored[len(stored) // 2], 2)), summarize(restores)


async def run_snapshots(quick: bool, data_dir: pathlib.Path, platform: str) -> dict[str, Any]:
    """Issue 4's operations on two nodes of this machine sharing a local-directory object store."""
    store_dir = data_dir / "objects"
    store_url = store_dir.as_uri()
    node_a = LocalNode(data_dir / "a", platform=platform, store_url=store_url, cgroup_parent="space-bench-a")
    node_b = LocalNode(data_dir / "b", platform=platform, store_url=store_url, cgroup_parent="space-bench-b")
    results: dict[str, Any] = {}
    started: list[LocalNode] = []
    try:
        for node in (node_a, node_b):
            started.append(node)
            await node.start(progress=lambda line: print(f"  | {line}", flush=True))
        a, b = node_a.agent, node_b.agent
        assert a is not None and b is not None
        n = 5 if quick else 20
        main = await _with_files(a)
        results["disk_snapshot"] = await bench_disk_snapshot(a, main, n * 2)
        results["full_checkpoint"] = await bench_full_checkpoint(a, main, n)
        results["fork_first_answer"] = await bench_fork(a, main, n)
        checkpoint = await a.checkpoint(main.sandbox_id)
        results["fork_from_checkpoint"] = await bench_fork(a, main, n, checkpoint.snapshot_id)
        await a.delete(main.sandbox_id)
        results["snapshot_exclusive_10mb"] = await bench_exclusive(a, 3 if quick else 5)
        store = open_store(store_url)
        results["suspend_local_store"], results["restore_other_node"] = await bench_suspend_restore(
            a, b, store, 3 if quick else 10
        )
    finally:
        for node in started:
            if node.agent is not None:
                await node.agent.delete_all()
            await node.stop(purge=True)
            for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{node.cgroup_parent}"):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # the node's own cgroup parent, empty now
        shutil.rmtree(store_dir, ignore_errors=True)
    return results


async def run(quick: bool, data_dir: pathlib.Path, platform: str) -> dict[str, Any]:
    node = LocalNode(data_dir, platform=platform)
    agent = await node.start(progress=lambda line: print(f"  | {line}", flush=True))
    results: dict[str, Any] = {}
    try:
        n = 5 if quick else 20
        results["create_cold"], handles = await bench_create(agent, n)
        main = handles[0]
        await main.session.exec(["true"])  # warm the exec path once
        results["exec_true"] = await bench_exec(main, 50 if quick else 300)
        results["file_4k_write_read"] = await bench_small_files(main, 50 if quick else 300)
        results["transfer_100mib"] = await bench_transfer(main, 20 if quick else 100)
        results["pause"], results["resume"] = await bench_pause_resume(agent, main, 5 if quick else 20)
        results["checkpoint"], results["restore"] = await bench_checkpoint_restore(
            agent, main, 3 if quick else 10
        )
        results["idle_memory"] = await bench_idle_memory(agent, data_dir, handles)
        for handle in handles:
            await agent.delete(handle.sandbox_id)
        results["concurrent_sandboxes"] = await bench_concurrent(agent, 10 if quick else 50)
    finally:
        await agent.delete_all()
        await node.stop(purge=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    parser.add_argument("--platform", default="ptrace", choices=["systrap", "ptrace"])
    parser.add_argument(
        "--group", choices=["all", "runtime", "snapshots"], default="all",
        help="runtime: create/exec/files/pause/checkpoint/...; snapshots: issue 4 (two nodes, object store)",
    )  # fmt: skip
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if args.group in {"all", "runtime"}:
        data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-", dir="/var/tmp"))
        results.update(asyncio.run(run(args.quick, data_dir, args.platform)))
    if args.group in {"all", "snapshots"}:
        data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-", dir="/var/tmp"))
        try:
            results.update(asyncio.run(run_snapshots(args.quick, data_dir, args.platform)))
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
    results["platform"] = {"name": args.platform}
    path = write_json(results, "node")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, TARGETS)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
