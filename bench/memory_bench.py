"""Idle host memory per sandbox and full-checkpoint size vs the guest's used memory (issue 12, ADR 0045).

Run as root: `.venv/bin/python -m bench.memory_bench [--sandboxes 10] [--json]`.

- Idle memory: N sandboxes of the python template are created and left idle; every host process that
  belongs to one sandbox (its holder if it has one, `runsc run|restore`, the gofer, the Sentry and its
  stubs: the process tree under the holder plus the sandbox's cgroup) is summed by PSS from
  /proc/PID/smaps_rollup, so pages shared between sandboxes (the runsc binary, libraries) are amortised
  over N. Printed per process kind, p50 and max per sandbox.
- Checkpoint size: a guest writes 100 MB to a file and frees its own memory; a full checkpoint's image
  bytes are compared with the guest's used memory (MemTotal - MemAvailable of the guest's /proc/meminfo,
  read just before the checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import shutil
import sys
import tempfile
from collections import defaultdict
from typing import Any

from bench.node_bench import pss_kib
from bench.stats import write_json
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.local import LocalNode

MiB = 1 << 20


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> set[int]:
    seen: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(_children(current))
    return seen


#: A host process's kind by the words of its command line (first match wins).
KINDS = [("gofer", "runsc gofer"), ("boot", "runsc sandbox (Sentry)"), ("run", "runsc run|restore"),
         ("restore", "runsc run|restore")]  # fmt: skip


def kind_of(pid: int) -> str:
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [word.decode(errors="replace") for word in argv if word]
    if not words:
        return "runsc stub (guest address space)"  # ptrace stubs have an empty command line
    if "python" in pathlib.Path(words[0]).name:
        return "holder (python)"
    return next((kind for word, kind in KINDS if word in words), f"other ({pathlib.Path(words[0]).name})")


def sandbox_pids(data_dir: pathlib.Path, sandbox_id: str) -> set[int]:
    """Every host process of one sandbox: the tree under its holder (or its runtime process, when the
    holder left) and the members of its cgroups."""
    pids: set[int] = set()
    run_dir = data_dir / "run" / sandbox_id
    holder = run_dir / "holder.json"
    if holder.exists():
        info = json.loads(holder.read_text())
        for key in ("holder_pid", "runtime_pid"):
            if isinstance(info.get(key), int) and pathlib.Path(f"/proc/{info[key]}").exists():
                pids |= descendants(int(info[key]))
    container = (run_dir / "container").read_text().strip()
    for procs in pathlib.Path("/sys/fs/cgroup").glob(f"*/*/{container}/cgroup.procs"):
        for pid in procs.read_text().split():
            pids |= descendants(int(pid))
    return pids


def idle_memory(data_dir: pathlib.Path, handles: list[SandboxHandle]) -> dict[str, Any]:
    per_sandbox: list[float] = []
    per_kind: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    for handle in handles:
        kinds: dict[str, float] = defaultdict(float)
        number: dict[str, int] = defaultdict(int)
        for pid in sandbox_pids(data_dir, handle.sandbox_id):
            kind = kind_of(pid)
            kinds[kind] += pss_kib(pid) / 1024
            number[kind] += 1
        per_sandbox.append(sum(kinds.values()))
        for kind, value in kinds.items():
            per_kind[kind].append(value)
            counts[kind].append(number[kind])
    per_sandbox.sort()
    return {
        "pss_MB_p50": round(per_sandbox[len(per_sandbox) // 2], 1),
        "pss_MB_max": round(per_sandbox[-1], 1),
        "sandboxes": len(per_sandbox),
        "by_kind_MB_mean": {
            kind: {"pss_MB": round(sum(v) / len(v), 2), "processes": max(counts[kind])}
            for kind, v in sorted(per_kind.items())
        },
    }


async def guest_used_bytes(handle: SandboxHandle) -> int:
    result = await handle.session.exec(["cat", "/proc/meminfo"])
    fields = {}
    for line in result.stdout.decode().splitlines():
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


async def checkpoint_size(agent: NodeAgent, write_mb: int) -> dict[str, Any]:
    handle = await agent.create("python")
    try:
        baseline = await agent.checkpoint(handle.sandbox_id)
        wrote = await handle.session.exec(
            ["sh", "-c", f"dd if=/dev/urandom of=/work/big.bin bs=1M count={write_mb} 2>/dev/null && sync"]
        )
        assert wrote.exit_code == 0, wrote
        used = await guest_used_bytes(handle)
        record = await agent.checkpoint(handle.sandbox_id)
        after = await guest_used_bytes(handle)
        answer = await handle.session.exec(["sh", "-c", "wc -c < /work/big.bin"])
        assert int(answer.stdout.decode().strip()) == write_mb * MiB
        return {
            "written_MB": write_mb,
            "idle_image_MB": round(baseline.image_bytes / 1e6, 1),
            "image_MB": round(record.image_bytes / 1e6, 1),
            "guest_used_MB_before": round(used / 1e6, 1),
            "guest_used_MB_after": round(after / 1e6, 1),
            "image_vs_guest_used": round(record.image_bytes / max(used, 1), 2),
            "checkpoint_timings_ms": {k: round(v, 1) for k, v in record.timings.items()},
        }
    finally:
        await agent.delete(handle.sandbox_id)


async def run(data_dir: pathlib.Path, sandboxes: int, write_mb: int, platform: str) -> dict[str, Any]:
    node = LocalNode(data_dir, platform=platform, cgroup_parent="space-bench-mem")
    agent = await node.start(progress=lambda line: print(f"  | {line}", file=sys.stderr, flush=True))
    results: dict[str, Any] = {}
    try:
        handles = [await agent.create("python") for _ in range(sandboxes)]
        for handle in handles:
            await handle.session.exec(["true"])
        await asyncio.sleep(3.0)  # let start-up garbage settle
        results["idle_memory"] = idle_memory(data_dir, handles)
        for handle in handles:
            await agent.delete(handle.sandbox_id)
        results["checkpoint_size"] = await checkpoint_size(agent, write_mb)
    finally:
        await agent.delete_all()
        await node.stop(purge=True)
        for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{node.cgroup_parent}"):
            with contextlib.suppress(OSError):
                parent.rmdir()  # the node's own cgroup parent, empty now
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sandboxes", type=int, default=10)
    parser.add_argument("--write-mb", type=int, default=100)
    parser.add_argument("--platform", default="ptrace", choices=["systrap", "ptrace"])
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args()
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-mem-", dir="/var/tmp"))
    try:
        results = asyncio.run(run(data_dir, args.sandboxes, args.write_mb, args.platform))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    results["platform"] = {"name": args.platform}
    path = write_json(results, "memory")
    print(json.dumps(results, indent=2))
    if not args.json:
        print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
