"""Suspend / restore / scheduled snapshots through the public API (issue 4). Run as root:
`python -m bench.suspend_bench [--quick] [--json]`.

Starts its own installation (LocalCluster: control plane + one runsc node + a local-directory object store)
in a fresh data directory, measures, and purges it. Python template, an idle sandbox with a few MB of files:
- suspend: the API call until the record says `suspended` (pause, full checkpoint, export, encrypted
  upload with the manifest read back, node freed);
- restore_first_answer: restore until the first `exec true` answered (download, verify, import, restore),
  once the node has freed the suspended copy; restore_right_after: the same right after the suspend;
- disk_snapshot / full_checkpoint: the API calls of user snapshots of a running sandbox.
Prints a table and writes bench/results/suspend-<time>.json (one object per operation: p50/p90/p99/n).
The two-node figure (restore on ANOTHER node) is printed by tests/e2e/test_suspend_restore_two_nodes.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time
from typing import Any

from bench.stats import print_table, summarize, write_json
from space import Space
from space.controlplane.local import LocalCluster, free_port

TARGETS = {
    "suspend": "<= 1.5 s (to the local object store)",
    "restore_first_answer": "<= 1.5 s (same node here; see the two-node e2e test for another node)",
    "restore_right_after": "(same node, right after suspend: waits for the node to free the old copy)",
    "disk_snapshot": "p50 <= 30 ms at the node (API adds its hop)",
    "full_checkpoint": "p50 <= 250 ms at the node (API adds its hop)",
}


SETTLE_S = 3.0


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def bench_suspend_restore(sp: Space, n: int) -> dict[str, dict[str, Any]]:
    """Suspend, then restore to the first answer twice per round: once after the node freed the suspended
    copy (SETTLE_S later: the restore alone) and once right after the suspend returned (on one node, the
    restore then waits for that delete first)."""
    sb = sp.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
    try:
        for i in range(4):
            sb.files.write(f"/work/data-{i}.bin", os.urandom(1 << 20))
        names = ("suspend", "restore_first_answer", "restore_right_after")
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(n):
            for restore_key, settle in (("restore_first_answer", SETTLE_S), ("restore_right_after", 0.0)):
                start = time.perf_counter()
                assert sb.suspend().state == "suspended"
                samples["suspend"].append(_ms(start))
                time.sleep(settle)  # outside the measurement
                start = time.perf_counter()
                sb.restore()
                assert sb.exec(["true"]).exit_code == 0
                samples[restore_key].append(_ms(start))
        return {name: summarize(values) for name, values in samples.items()}
    finally:
        sb.delete()


def bench_snapshots(sp: Space, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    sb = sp.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
    try:
        sb.files.write("/work/data.bin", os.urandom(4 << 20))
        disk, full = [], []
        for _ in range(n):
            start = time.perf_counter()
            sb.snapshots.create()
            disk.append(_ms(start))
            start = time.perf_counter()
            sb.snapshots.create(full=True)
            full.append(_ms(start))
        return summarize(disk), summarize(full)
    finally:
        sb.delete()


def run(quick: bool) -> dict[str, Any]:
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-suspendbench-", dir="/var/tmp"))
    cluster = LocalCluster(data_dir, port=free_port())
    cluster.start(progress=lambda line: print(f"  | {line}", flush=True))
    results: dict[str, Any] = {}
    try:
        with Space(url=cluster.url, api_key=cluster.api_key) as sp:
            results.update(bench_suspend_restore(sp, 3 if quick else 10))
            results["disk_snapshot"], results["full_checkpoint"] = bench_snapshots(sp, 5 if quick else 20)
    finally:
        cluster.stop(purge=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args(argv)
    results = run(args.quick)
    path = write_json(results, "suspend")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, TARGETS)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
