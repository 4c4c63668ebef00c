"""`space bench`: SPACE's latencies through the public API, with the naive baseline beside them (issue 12).

    space bench [--quick] [--json]              # the SPACE of SPACE_URL/SPACE_API_KEY (or the config)
    space bench --embedded [--quick] [--json]   # starts its own (LocalCluster in a fresh data directory)

Measures what bench/api_measure.py and bench/plain_runsc.py describe, prints a table with the targets of the
issue (or, with --json, the JSON document alone), and writes bench/results/api-<time>.json (and
api-latest.json) and api-<time>.png, a chart of the latency distributions.

Creation: `create_warm` and `create_warm_c8` (bursts of 8) are paced to `--rate` creations per second (the
issue's keep-up rate, 5/s), so they measure a node whose pool keeps up with that rate, and record where each
sandbox came from; `create_cold` asks for limits no pool serves (POOL_BYPASS_LIMITS), the path without a
pool, on any SPACE. An embedded node has a pool of `--pool-size` (6) and each series starts with it full.

The node-level operations need the node on this machine: `exec_true_node` its RPC (`--node-url` and
`--node-data-dir`, where its RPC token is) and `create_plain_runsc` root and the template's root filesystem
(`--node-data-dir`). `--embedded` knows both. Without them the key is omitted and stderr says why.

Invariants:
- With --json, stdout carries exactly one JSON document: during the run file descriptor 1 is the stderr,
  so nothing (ours, a library's, a child process's) can print on it before the document.
- An embedded installation is purged at the end, also when a measurement fails.
- A configuration or API error is one line on stderr (`error: <code>: <message>`) and the exit codes of
  the CLI (space.cli._common): 2 no server configured, 5 a key the server refuses, 6 unreachable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench import api_measure as m
from bench.api_report import document, meta, print_table, write_chart
from bench.plain_runsc import PlainRunsc, template_rootfs
from bench.stats import RESULTS_DIR, percentile, write_json
from space import Space
from space.cli._common import exit_code_for
from space.core.errors import SpaceError
from space.sdk.config import resolve_config

if TYPE_CHECKING:  # imported where used: a run against a remote SPACE starts without the control plane's code
    from space.controlplane.local import LocalCluster

#: Samples per operation: (full run, --quick). Creation follows the issue (N >= 200 at concurrency 1 and
#: at concurrency 8); the naive baseline copies a whole root filesystem per sample, so 20 of it suffice.
COUNTS = {
    "create_warm": (200, 10), "create_warm_c8": (200, 16), "create_cold": (200, 5),
    "create_plain_runsc": (20, 5), "exec_true": (200, 30), "exec_true_node": (200, 30),
    "file_4k": (200, 30), "pause_resume": (50, 5), "snapshot_disk": (50, 5), "checkpoint_full": (20, 3),
    "fork": (20, 3), "suspend_restore": (10, 2),
}  # fmt: skip
CONCURRENCY = 8
#: The issue's keep-up target (a node's pools keep up with 5 creates per second): creations are paced to it.
DEFAULT_RATE = 5.0
#: An embedded node's pool. Members count against the node's capacity (ADR 0047) and a 2-core node schedules
#: 8 one-CPU sandboxes (CPUs overcommitted 4x): a pool of 8 left no room to restore a suspended sandbox
#: (found by this benchmark), so 6 members leave room for the measured sandbox and a fork child or a restore.
DEFAULT_POOL_SIZE = CONCURRENCY - 2


def log(line: str) -> None:
    print(f"  | {line}", file=sys.stderr, flush=True)


#: Limits no pool serves (a pool serves only creates with exactly its own limits, ADR 0047), so a create with
#: them takes the path without a pool: how `create_cold` is measured, on any SPACE, without reconfiguring it.
#: One pid fewer than the default changes nothing else about the sandbox.
POOL_BYPASS_LIMITS = {"pids": 511}
POOL_FILL_TIMEOUT_S = 300.0


@dataclass
class Target:
    """The SPACE being measured, and its node when that node is on this machine."""

    url: str
    api_key: str | None
    node_url: str | None = None
    node_data_dir: pathlib.Path | None = None
    cluster: LocalCluster | None = None
    pool: tuple[str, int] | None = None  # an embedded node's pool: (template, size)

    def settle(self) -> None:
        """Before a creation series: an embedded node's pool is full again (bounded; a remote SPACE is
        measured as it is)."""
        if self.cluster is None or self.pool is None or self.pool[1] == 0:
            return
        template, size = self.pool
        ready = pool_ready(self.cluster, template)
        deadline = time.monotonic() + POOL_FILL_TIMEOUT_S
        while ready < size and time.monotonic() < deadline:
            time.sleep(0.5)
            ready = pool_ready(self.cluster, template)
        if ready < size:
            log(f"the pool of {template} holds {ready} of {size} after {POOL_FILL_TIMEOUT_S:.0f} s; going on")


def pool_ready(cluster: LocalCluster, template: str) -> int:
    """Ready pooled sandboxes of `template` on an embedded cluster's node, as its last heartbeat said."""
    from space.controlplane.store.engine import sqlite_url
    from space.controlplane.store.store import Store

    store = Store(sqlite_url(cluster.data_dir))
    try:
        return max([(node.pools or {}).get(template, 0) for node in store.list_nodes("ready")] or [0])
    finally:
        store.close()


@contextlib.contextmanager
def embedded_target(template: str, pool_size: int) -> Iterator[Target]:
    """A whole installation of our own in a fresh data directory, with a pool of `pool_size` sandboxes of
    `template`, purged at the end."""
    from space.controlplane.local import LocalCluster, free_port

    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-", dir="/var/tmp"))
    cluster = LocalCluster(
        data_dir, port=free_port(), cgroup_parent="space-bench", pools=f"{template}={pool_size}"
    )
    try:
        cluster.start(progress=log)
        node_url = f"http://127.0.0.1:{cluster.node_port}"
        yield Target(cluster.url, cluster.api_key, node_url, data_dir, cluster, (template, pool_size))
    except BaseException:
        keep_logs(data_dir)
        raise
    finally:
        log("purging the embedded installation")
        cluster.stop(purge=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def keep_logs(data_dir: pathlib.Path) -> None:
    """Copy the logs of a failed embedded run out of the data directory the purge removes (root only,
    like the data directory: logs name sandboxes and paths, never secrets)."""
    kept = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-failed-", dir="/var/tmp"))
    for path in data_dir.glob("*.log"):
        shutil.copy2(path, kept / path.name)
    log(f"the embedded installation's logs are kept in {kept}")


class Run:
    """One benchmark run: the samples of each operation (ms) and their extras (e.g. `from`)."""

    def __init__(self, target: Target, args: argparse.Namespace) -> None:
        self.target = target
        self.template: str = args.template
        self.quick: bool = args.quick
        self.override: int | None = args.samples
        self.rate: float | None = args.rate or None
        self.samples: dict[str, list[float]] = {}
        self.extras: dict[str, dict[str, Any]] = {}

    def n(self, name: str) -> int:
        return self.override if self.override is not None else COUNTS[name][1 if self.quick else 0]

    def keep(self, name: str, series: m.Series) -> None:
        self.samples[name] = series.samples
        if series.extra():
            self.extras[name] = series.extra()
        if series.samples:
            log(f"{name}: n={len(series.samples)} p50={percentile(series.samples, 50):.1f} ms")

    def create(self, name: str, concurrency: int, limits: dict[str, Any] | None = None) -> None:
        t = self.target
        t.settle()
        creation = m.Creation(t.url, t.api_key, self.template, limits, self.rate)
        self.keep(name, creation.run(self.n(name), concurrency, log, name))

    def measure(self, sp: Space) -> None:
        self.create("create_warm", 1)
        self.create("create_warm_c8", CONCURRENCY)
        self.create("create_cold", 1, POOL_BYPASS_LIMITS)
        if "pool" in self.extras.get("create_cold", {}).get("from", {}):
            log(f"warning: a pool served creates with limits {POOL_BYPASS_LIMITS}: create_cold is not cold")
        self.plain_runsc()
        with m.subject(sp, self.template) as sb:
            self.keep("exec_true", m.exec_series(sb, self.n("exec_true")))
            self.node_exec(sb.id)
            self.keep("file_4k", m.file_series(sb, self.n("file_4k")))
            paused, resumed = m.pause_resume_series(sb, self.n("pause_resume"))
            self.keep("pause", paused)
            self.keep("resume", resumed)
            self.keep("snapshot_disk", m.snapshot_series(sb, self.n("snapshot_disk"), full=False))
            self.keep("checkpoint_full", m.snapshot_series(sb, self.n("checkpoint_full"), full=True))
            self.keep("fork", m.fork_series(sb, self.n("fork")))
            suspended, restored = m.suspend_restore_series(sb, self.n("suspend_restore"))
            self.keep("suspend", suspended)
            self.keep("restore", restored)

    def node_exec(self, sandbox_id: str) -> None:
        t = self.target
        if t.node_url is None or t.node_data_dir is None:
            log("exec_true_node omitted: the node's RPC is reachable only on its host (--node-url and "
                "--node-data-dir, or --embedded)")  # fmt: skip
            return
        from space.node.agent.identity import default_rpc_token_file

        try:
            token = default_rpc_token_file(t.node_data_dir).read_text().strip()
        except OSError as exc:
            log(f"exec_true_node omitted: cannot read the node's RPC token: {exc}")
            return
        series = m.node_exec_series(t.node_url, token, sandbox_id, self.n("exec_true_node"))
        self.keep("exec_true_node", series)

    def plain_runsc(self) -> None:
        t = self.target
        if t.node_data_dir is None or os.geteuid() != 0:
            log("create_plain_runsc omitted: it needs root and the template's root filesystem on this "
                "machine (--node-data-dir, or --embedded)")  # fmt: skip
            return
        baseline = PlainRunsc(template_rootfs(t.node_data_dir, self.template))
        try:
            baseline.measure(self.n("create_plain_runsc"), log)
        except FileNotFoundError as exc:
            log(f"create_plain_runsc omitted: {exc}")
            return
        self.keep("create_plain_runsc", m.Series(samples=baseline.samples))
        self.extras["create_plain_runsc"] = {"copy_p50_ms": round(percentile(baseline.copies, 50), 2)}


@contextlib.contextmanager
def stdout_is_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the block (children inherit it), then restore it."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="space bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few samples (under a minute)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    parser.add_argument("--embedded", action="store_true", help="start an installation of its own")
    parser.add_argument("--template", default="python")
    parser.add_argument("--node-url", help="the node agent's RPC URL (for exec_true_node)")
    parser.add_argument("--node-data-dir", type=pathlib.Path, help="the node's data directory on this host")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    parser.add_argument(
        "--rate", type=float, default=DEFAULT_RATE,
        help="creations per second at most (bursts of 8 at concurrency 8; 0: back to back)",
    )  # fmt: skip
    parser.add_argument(
        "--pool-size", type=int, default=DEFAULT_POOL_SIZE, help="--embedded: the pool's size"
    )
    parser.add_argument("--samples", type=int, default=None, help=argparse.SUPPRESS)  # tests: N of each
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.rate < 0 or not 0 <= args.pool_size <= 256:
        parser.error("--rate must not be negative and --pool-size is 0 to 256")
    return args


def measure(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    load_at_start = round(os.getloadavg()[0], 2)
    with Space(url=target.url, api_key=target.api_key) as sp:
        sp.sandboxes.list()  # a key the server refuses fails here, before anything is measured
        run = Run(target, args)
        run.measure(sp)
    run_meta = meta(
        target=target.url, embedded=args.embedded, quick=args.quick, samples=args.samples,
        load_at_start=load_at_start,
    )  # fmt: skip
    return {"doc": document(run.samples, run.extras, run_meta), "samples": run.samples}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.embedded:
        if os.geteuid() != 0:
            raise PermissionError("--embedded starts a node's root helper: run it as root")
        with embedded_target(args.template, args.pool_size) as target:
            return measure(args, target)
    config = resolve_config()
    target = Target(config.url, config.api_key, args.node_url, args.node_data_dir)
    return measure(args, target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        with stdout_is_stderr():
            result = run(args)
    except SpaceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (PermissionError, m.BenchFailure) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, PermissionError) else 1
    doc = result["doc"]
    path = write_json(doc, "api", args.results_dir)
    chart = write_chart(result["samples"], path.with_suffix(".png"), f"space bench ({doc['meta']['time']})")
    print(f"written to {path}" + (f" and {chart}" if chart else ""), file=sys.stderr)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=2))
        print_table(doc, sys.stderr)
    else:
        print_table(doc, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
