"""Benchmarks through the public API with the SDK (issue: control plane). Run as root: `space bench`.

Starts its own installation (LocalCluster) in a fresh data directory, measures, and purges it. Prints a
table and writes bench/results/api-<time>.json: one object per operation {"p50_ms", "p90_ms", "p99_ms", "n"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import threading
import time
from typing import Any

from bench.stats import print_table, summarize, write_json
from space import Space
from space.controlplane.local import LocalCluster, free_port
from space.node.agent.identity import default_rpc_token_file
from space.node.rpc_client import NodeClient

TARGETS = {
    "create_cold": "p50 <= 350 ms (create to first exec answered)",
    "exec_true": "p50 <= 15 ms",
    "node_rpc_exec_true": "(reference: the node-level call)",
    "api_overhead": "p50 <= 3 ms over the node-level call",
    "file_4k_write_read": "(no target)",
    "concurrent_clients": "20 clients for a minute, no error",
}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def bench_create(sp: Space, n: int) -> dict[str, Any]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        sb = sp.sandboxes.create(template="python")
        result = sb.exec(["true"])
        samples.append(_ms(start))
        assert result.exit_code == 0
        sb.delete()
    return summarize(samples)


def bench_exec(sp: Space, n: int) -> tuple[dict[str, Any], list[float], str]:
    sb = sp.sandboxes.create(template="python")
    sb.exec(["true"])
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        result = sb.exec(["true"])
        samples.append(_ms(start))
        assert result.exit_code == 0
    return summarize(samples), samples, sb.id


def bench_node_exec(cluster: LocalCluster, sandbox_id: str, n: int) -> dict[str, Any]:
    # The node's own RPC token (ADR 0021): the cluster's node.token only enrols nodes.
    token = default_rpc_token_file(cluster.data_dir).read_text().strip()

    async def run() -> list[float]:
        async with NodeClient(f"http://127.0.0.1:{cluster.node_port}", token) as node:
            await node.exec(sandbox_id, ["true"])
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                await node.exec(sandbox_id, ["true"])
                samples.append(_ms(start))
            return samples

    return summarize(asyncio.run(run()))


def bench_files(sp: Space, sandbox_id: str, n: int) -> dict[str, Any]:
    sb = sp.sandboxes.get(sandbox_id)
    payload = b"x" * 4096
    samples = []
    for i in range(n):
        start = time.perf_counter()
        sb.files.write(f"/work/f{i % 4}", payload)
        data = sb.files.read(f"/work/f{i % 4}")
        samples.append(_ms(start))
        assert data == payload
    return summarize(samples)


def bench_concurrent(url: str, api_key: str, clients: int, seconds: float) -> dict[str, Any]:
    errors: list[str] = []
    cycles = [0] * clients
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        sp = Space(url=url, api_key=api_key)
        while time.monotonic() < deadline:
            try:
                sb = sp.sandboxes.create(template="python")
                result = sb.exec(["sh", "-c", f"echo {index}"])
                if result.stdout.strip() != str(index):
                    errors.append(f"client {index}: wrong output {result.stdout!r}")
                sb.files.write("/work/x", b"y" * 1024)
                if sb.files.read("/work/x") != b"y" * 1024:
                    errors.append(f"client {index}: file mismatch")
                sb.delete()
                cycles[index] += 1
            except Exception as exc:
                errors.append(f"client {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "clients": clients,
        "seconds": seconds,
        "cycles": sum(cycles),
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def run(quick: bool) -> dict[str, Any]:
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-apibench-", dir="/var/tmp"))
    cluster = LocalCluster(data_dir, port=free_port())
    cluster.start(progress=lambda line: print(f"  | {line}", flush=True))
    results: dict[str, Any] = {}
    try:
        sp = Space(url=cluster.url, api_key=cluster.api_key)
        results["create_cold"] = bench_create(sp, 3 if quick else 10)
        results["exec_true"], _samples, sandbox_id = bench_exec(sp, 30 if quick else 200)
        results["node_rpc_exec_true"] = bench_node_exec(cluster, sandbox_id, 30 if quick else 200)
        results["api_overhead"] = {
            "p50_ms": round(results["exec_true"]["p50_ms"] - results["node_rpc_exec_true"]["p50_ms"], 2)
        }
        results["file_4k_write_read"] = bench_files(sp, sandbox_id, 30 if quick else 200)
        sp.sandboxes.get(sandbox_id).delete()
        results["concurrent_clients"] = bench_concurrent(
            cluster.url, cluster.api_key, 20, 10.0 if quick else 60.0
        )
    finally:
        cluster.stop(purge=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args(argv)
    results = run(args.quick)
    path = write_json(results, "api")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, TARGETS)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
