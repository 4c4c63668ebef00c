"""Load through the public API (issue 11): N clients create, use and delete sandboxes for a while, with the
SDK, against a real installation (LocalCluster: root helper, runsc node agent, control plane, SQLite).

Run as root: `python -m bench.load_bench [--clients 8] [--seconds 120]`. Each client loops: create (waits
until running) -> exec `echo` -> write and read 1 KiB -> delete. The run has three phases: a warm-up (fills
connection pools and import caches), phase A and phase B of equal length; after each, every sandbox is
deleted and the installation settles. It reports ops/s, errors, p50/p99 per operation, and per component
(control plane, node agent, root helper) RSS and open fds, plus the processes under the data directory
and the database (bytes and rows per table) after each phase.

Why two measured phases: memory after a burst of work rises to the allocator's high-water mark and stays
there without being a leak; a leak grows again in the second phase. So "no growth" means phase B ends where
phase A ended (within the bounds of tests/load/test_load.py), and no process, fd or live row is left.

Writes bench/results/load-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sqlite3
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.stats import summarize, write_json
from space import Space
from space.controlplane.local import LocalCluster, free_port
from space.controlplane.store.engine import SQLITE_FILENAME

OPERATIONS = ("create", "exec", "file_rw", "delete")
PAYLOAD = b"l" * 1024


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass
class LoadResult:
    clients: int
    seconds: float
    cycles: int = 0
    samples: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPERATIONS})
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ops = sum(len(v) for v in self.samples.values())
        return {
            "clients": self.clients,
            "seconds": round(self.seconds, 1),
            "cycles": self.cycles,
            "ops": ops,
            "ops_per_s": round(ops / self.seconds, 2) if self.seconds else 0.0,
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "latency": {op: summarize(v) for op, v in self.samples.items() if v},
        }


def _cycle(sp: Space, index: int, result: LoadResult, lock: threading.Lock) -> None:
    """One create -> exec -> file write/read -> delete; each operation timed; a wrong answer is an error."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    sb = sp.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
    times["create"] = _ms(start)
    try:
        start = time.perf_counter()
        answer = sb.exec(["echo", str(index)])
        times["exec"] = _ms(start)
        if answer.exit_code != 0 or answer.stdout.strip() != str(index):
            raise AssertionError(f"exec answered {answer.exit_code} {answer.stdout!r}")
        start = time.perf_counter()
        sb.files.write("/work/load.bin", PAYLOAD)
        if sb.files.read("/work/load.bin") != PAYLOAD:
            raise AssertionError("file read back differs")
        times["file_rw"] = _ms(start)
    finally:
        start = time.perf_counter()
        sb.delete()
        times["delete"] = _ms(start)
    with lock:
        for op, ms in times.items():
            result.samples[op].append(ms)
        result.cycles += 1


def run_load(
    url: str, api_key: str, *, clients: int, seconds: float | None = None, cycles: int | None = None
) -> LoadResult:
    """`clients` threads, each with its own SDK client, cycling until `seconds` have passed or each has
    made `cycles` cycles (a failed cycle counts)."""
    result = LoadResult(clients, seconds or 0.0)
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + seconds if seconds is not None else float("inf")

    def client(index: int) -> None:
        with Space(url=url, api_key=api_key, transport=httpx.HTTPTransport(verify=False)) as sp:
            made = 0
            while time.monotonic() < deadline and (cycles is None or made < cycles):
                made += 1
                try:
                    _cycle(sp, index, result, lock)
                except Exception as exc:  # every failure counts; the run goes on
                    with lock:
                        result.errors.append(f"client {index}: {type(exc).__name__}: {exc}"[:500])

    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    return result


# -- what the installation holds -----------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def processes_under(data_dir: pathlib.Path) -> list[int]:
    """Pids whose command line or working directory names `data_dir` (helper, agent, control plane,
    holders, runsc, gofers...): a process left behind by a deleted sandbox shows up here."""
    prefix = str(data_dir)
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline, cwd = (proc / "cmdline").read_bytes(), os.readlink(proc / "cwd")
            if prefix.encode() in cmdline or cwd.startswith(prefix):
                found.append(int(proc.name))
    return sorted(found)


def database_state(data_dir: pathlib.Path) -> dict[str, Any]:
    """Bytes of the SQLite database (main file and WAL) and rows per table, read-only."""
    path = data_dir / SQLITE_FILENAME
    sizes = {suffix or "db": (path.with_name(path.name + suffix)).stat().st_size for suffix in ("", "-wal")
             if path.with_name(path.name + suffix).exists()}  # fmt: skip
    rows: dict[str, int] = {}
    live = 0
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            rows[table] = int(conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
        live = int(conn.execute("SELECT count(*) FROM sandboxes WHERE state != 'deleted'").fetchone()[0])
    return {"bytes": sizes, "rows": rows, "live_sandboxes": live}


def measure(processes: Mapping[str, int], data_dir: pathlib.Path) -> dict[str, Any]:
    """RSS and fds of each named component, the processes under the data directory, the database."""
    components = {name: {"rss_kib": rss_kib(pid), "fds": fd_count(pid)} for name, pid in processes.items()}
    return {
        "components": components,
        "processes": len(processes_under(data_dir)),
        "database": database_state(data_dir),
    }


def component_pids(cluster: LocalCluster) -> dict[str, int]:
    """The long-lived processes of an installation (control plane, node agent, root helper...)."""
    return {name: proc.pid for name, proc in cluster.processes.items() if proc.poll() is None}


def settle(
    url: str, api_key: str, data_dir: pathlib.Path, *, baseline_processes: int, timeout: float = 120.0
) -> float:
    """Wait until no sandbox is live (every delete done) and the processes under the data directory are
    back to `baseline_processes` (holders and runtimes gone); seconds it took. TimeoutError otherwise."""
    started = time.monotonic()
    with Space(url=url, api_key=api_key, transport=httpx.HTTPTransport(verify=False)) as sp:
        while True:
            live = [sb.id for sb in sp.sandboxes.list() if sb.state != "deleted"]
            count = len(processes_under(data_dir))
            if not live and count <= baseline_processes:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"not settled after {timeout}s: live {live}, {count} processes")
            time.sleep(0.2)


@dataclass
class Phases:
    """The result of warm-up, phase A and phase B, with measurements after each (once settled)."""

    results: dict[str, LoadResult] = field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    settle_s: dict[str, float] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {
            "phases": {name: r.summary() for name, r in self.results.items()},
            "measured": self.measured,
            "settle_s": {k: round(v, 2) for k, v in self.settle_s.items()},
        }


def run_phases(
    cluster: LocalCluster, *, clients: int, seconds: float, warmup_s: float, settle_timeout: float = 120.0
) -> Phases:
    """Warm-up, then phase A and phase B of `seconds` each; measured after the warm-up and each phase."""
    phases = Phases()
    pids = component_pids(cluster)
    baseline = len(processes_under(cluster.data_dir))
    for name, length in (("warmup", warmup_s), ("a", seconds), ("b", seconds)):
        phases.results[name] = run_load(cluster.url, cluster.api_key, clients=clients, seconds=length)
        phases.settle_s[name] = settle(
            cluster.url, cluster.api_key, cluster.data_dir, baseline_processes=baseline,
            timeout=settle_timeout,
        )  # fmt: skip
        time.sleep(1.0)  # let closed connections' fds and finished requests' buffers go
        phases.measured[name] = measure(pids, cluster.data_dir)
    return phases


def print_report(report: Mapping[str, Any]) -> None:
    print(f"{'phase':<8} {'clients':>7} {'s':>6} {'cycles':>6} {'ops/s':>7} {'errors':>6}   "
          "p50 / p99 ms per op")  # fmt: skip
    for name, row in report["phases"].items():
        lat = "  ".join(f"{op} {v['p50_ms']:.0f}/{v['p99_ms']:.0f}" for op, v in row["latency"].items())
        print(f"{name:<8} {row['clients']:>7} {row['seconds']:>6} {row['cycles']:>6} {row['ops_per_s']:>7} "
              f"{row['errors']:>6}   {lat}")  # fmt: skip
        for error in row["first_errors"]:
            print(f"         error: {error}")
    names = report["measured"]["warmup"]["components"]
    print(f"\n{'after':<8} " + " ".join(f"{c + ' rss MiB/fds':>24}" for c in names))
    for name, m in report["measured"].items():
        cells = " ".join(f"{v['rss_kib'] / 1024:>17.1f} / {v['fds']:>4}" for v in m["components"].values())
        db = m["database"]
        print(f"{name:<8} {cells}   processes {m['processes']}, db {db['bytes']}, "
              f"live {db['live_sandboxes']}, rows {sum(db['rows'].values())}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=120.0, help="length of phase A and of phase B")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args(argv)
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-loadbench-", dir="/var/tmp"))
    cluster = LocalCluster(data_dir, port=free_port())
    cluster.start(progress=lambda line: print(f"  | {line}", flush=True))
    try:
        phases = run_phases(cluster, clients=args.clients, seconds=args.seconds, warmup_s=args.warmup)
    finally:
        cluster.stop(purge=True)
    report = {"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}, **phases.report()}
    path = write_json(report, "load")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
