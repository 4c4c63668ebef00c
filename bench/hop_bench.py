"""The gateway -> node hop (issue 12, ADR 0044): the same operations through the public API and straight at
the node, interleaved so that a loaded machine slows both alike. Run as root: `python -m bench.hop_bench`.

Starts its own installation (LocalCluster) in a fresh data directory, measures, and purges it. Prints a
table and writes bench/results/hop-<time>.json: one object per operation {"p50_ms", "p90_ms", "p99_ms", "n"}
and `hop_*` rows, each the API's p50 minus the node's p50 for that operation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bench.stats import print_table, summarize, write_json
from space.controlplane.local import LocalCluster, free_port
from space.node.agent.identity import default_rpc_token_file
from space.node.rpc_client import NodeClient
from space.sdk import AsyncSpace

TARGETS = {
    "hop_exec_true": "p50 <= 2 ms over the node-level call",
    "hop_file_4k": "p50 <= 2 ms over the node-level call",
    "api_exec_true": "p50 <= 13 ms",
}
PAYLOAD = b"x" * 4096

Op = Callable[[], Awaitable[None]]


async def _ops(
    cluster: LocalCluster, sp: AsyncSpace, node: NodeClient, raw: httpx.AsyncClient
) -> dict[str, Op]:
    sb = await sp.sandboxes.create(template="python")
    sandbox_id = sb.id

    async def api_exec_true() -> None:
        assert (await sb.exec(["true"])).exit_code == 0

    async def node_exec_true() -> None:
        assert (await node.exec(sandbox_id, ["true"])).exit_code == 0

    async def api_file_4k() -> None:
        await sb.files.write("/work/hop", PAYLOAD)
        assert await sb.files.read("/work/hop") == PAYLOAD

    async def node_file_4k() -> None:
        await node.write_file(sandbox_id, "/work/hop", PAYLOAD)
        assert await node.read_file(sandbox_id, "/work/hop") == PAYLOAD

    async def api_healthz() -> None:
        (await raw.get(f"{cluster.url}/healthz")).raise_for_status()

    async def node_info() -> None:
        answer = await raw.get(
            f"http://127.0.0.1:{cluster.node_port}/node/v1/info",
            headers={"Authorization": f"Bearer {node._token}"},
        )
        answer.raise_for_status()

    return {
        "api_exec_true": api_exec_true,
        "node_exec_true": node_exec_true,
        "api_file_4k": api_file_4k,
        "node_file_4k": node_file_4k,
        "api_healthz": api_healthz,
        "node_info": node_info,
    }


async def measure(cluster: LocalCluster, n: int) -> dict[str, Any]:
    token = default_rpc_token_file(cluster.data_dir).read_text().strip()
    async with (
        AsyncSpace(url=cluster.url, api_key=cluster.api_key) as sp,
        NodeClient(f"http://127.0.0.1:{cluster.node_port}", token) as node,
        httpx.AsyncClient() as raw,
    ):
        ops = await _ops(cluster, sp, node, raw)
        samples: dict[str, list[float]] = {name: [] for name in ops}
        names = list(ops)
        for i in range(n + 10):
            # Interleaved, the order rotating: load from elsewhere falls on every operation alike.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                await ops[name]()
                if i >= 10:  # the first rounds warm connections and caches
                    samples[name].append((time.perf_counter() - start) * 1000)
        cpu = {op: await _cpu_per_call(cluster, ops[op], n) for op in ("api_exec_true", "node_exec_true")}
    results: dict[str, Any] = {name: summarize(values) for name, values in samples.items()}
    # CPU time per call of each process: unlike wall time, hardly moved by what else the machine runs.
    results["cpu_ms_per_call"] = cpu
    for op in ("exec_true", "file_4k"):
        api, node_row = results[f"api_{op}"], results[f"node_{op}"]
        results[f"hop_{op}"] = {"p50_ms": round(api["p50_ms"] - node_row["p50_ms"], 2)}
    return results


def _cpu_ms(pid: int) -> float:
    """User + system CPU time of a process so far, in ms."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


async def _cpu_per_call(cluster: LocalCluster, op: Op, n: int) -> dict[str, float]:
    pids = {name: cluster.processes[name].pid for name in ("controlplane", "agent")}
    # The agent runs as the `space` user under setpriv, which execs: the pid is the agent's.
    before = {name: _cpu_ms(pid) for name, pid in pids.items()}
    for _ in range(n):
        await op()
    return {name: round((_cpu_ms(pid) - before[name]) / n, 3) for name, pid in pids.items()}


def run(n: int, report: Callable[[dict[str, Any]], None]) -> None:
    """Measure on a fresh installation and `report` the results before it is purged (a failed purge then
    loses no measurement)."""
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-hopbench-", dir="/var/tmp"))
    cluster = LocalCluster(data_dir, port=free_port())
    cluster.start(progress=lambda line: print(f"  | {line}", file=sys.stderr, flush=True))
    try:
        report(asyncio.run(measure(cluster, n)))
    finally:
        cluster.stop(purge=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=200, help="samples per operation")
    parser.add_argument("--json", action="store_true", help="print only the JSON (progress goes to stderr)")
    args = parser.parse_args(argv)

    def report(results: dict[str, Any]) -> None:
        path = write_json(results, "hop")
        if args.json:
            print(json.dumps(results, indent=2), flush=True)
        else:
            print_table(results, TARGETS)
            print(f"written to {path}", flush=True)

    run(args.n, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
