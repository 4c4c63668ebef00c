"""The lifecycle operations of issue 17 near their floor, measured through the SDK on an embedded SPACE.

    .venv/bin/python -m bench.floors_bench [--n 20] [--ops delete,pause_resume,snapshot_disk,rollback_disk]

Each operation is timed from the SDK call to its answer (ms): `delete` (the answer, not the teardown, which
`delete_teardown` times until the record is `deleted`), `exec` (`true`), `file_4k` (a 4 KiB write and its read
back), `pause`/`resume` (each until settled), `snapshot_disk`, `rollback_disk` (to a disk snapshot taken
before), `checkpoint_full` (a full snapshot of a running sandbox; `checkpoint_then_exec`: until an exec right
after it answered too), `rollback_full` (to a full checkpoint taken before), `fork` (one child: the request to
the child's first exec answered, as `space bench` measures it), `fork_checkpoint` (a sandbox started from the
newest full checkpoint, `from_snapshot`, without taking a new one: until its first exec answered) and `fork_n`
(FORK_N children in one request, until each answered an exec: compared with FORK_N times `fork`); `layers`:
pause/resume and a disk snapshot one layer down at a time (`node_*`: the node agent's RPC, `helper_*`: the
root helper's verb, `runsc_*`: runsc itself; `node_rollback_disk` and the helper verbs of a disk rollback:
stop, reset_rootfs, start), on a sandbox of their own. Prints p50/p90 per operation, then the median span
breakdown of those measured through the API with traces (bench.api_spans, as `space bench` prints it); the
numbers of ADRs 0073-0075, 0077 come from here (machine shared with other work: "loaded machine").

Invariants:
- The embedded installation (space.controlplane.local.LocalCluster, no pool) is purged at the end, also
  when a measurement fails; every sandbox made here is deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from bench import api_measure, api_spans
from space.core.errors import SpaceError
from space.sdk import Sandbox, Space

OPS = (
    "delete", "exec", "file_4k", "pause_resume", "snapshot_disk", "rollback_disk", "checkpoint_full",
    "rollback_full", "fork", "fork_checkpoint", "fork_n", "layers",
)  # fmt: skip
#: Children of one `fork_n` request.
FORK_N = 4


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@contextlib.contextmanager
def embedded() -> Iterator[tuple[Space, pathlib.Path, str]]:
    from space.controlplane.local import LocalCluster, free_port

    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-floors-", dir="/var/tmp"))
    cluster = LocalCluster(data_dir, port=free_port(), cgroup_parent="space-floors")
    try:
        cluster.start(progress=lambda line: print(line, flush=True))
        with Space(url=cluster.url, api_key=cluster.api_key) as sp:
            yield sp, data_dir, f"http://127.0.0.1:{cluster.node_port}"
    finally:
        cluster.stop(purge=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def wait_gone(sp: Space, sandbox_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if sp.sandboxes.get(sandbox_id).state == "deleted":
                return
        except Exception:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{sandbox_id} not deleted in {timeout_s:.0f} s")


def measure_delete(sp: Space, n: int, out: dict[str, list[float]]) -> None:
    for _ in range(n):
        sb = sp.sandboxes.create(template="python")
        sb.exec("true")
        start = time.perf_counter()
        sb.delete()
        out.setdefault("delete", []).append(_ms(start))
        wait_gone(sp, sb.id)
        out.setdefault("delete_teardown", []).append(_ms(start))


def measure_on_one(sp: Space, ops: set[str], n: int, out: dict[str, list[float]],
                   spans: dict[str, dict[str, float]]) -> None:  # fmt: skip
    """exec, file_4k, pause/resume, snapshot_disk and rollback_disk on one running sandbox, each series'
    span breakdown read from the sandbox's traces after it (never timed)."""
    sb: Sandbox = sp.sandboxes.create(template="python")
    try:
        sb.exec("true")
        series: dict[str, api_measure.Series] = {}
        if "exec" in ops:
            series["exec"] = api_measure.exec_series(sb, n)
        if "file_4k" in ops:
            series["file_4k"] = api_measure.file_series(sb, n)
        if "pause_resume" in ops:
            series["pause"], series["resume"] = api_measure.pause_resume_series(sb, n)
        if "snapshot_disk" in ops:
            series["snapshot_disk"] = api_measure.snapshot_series(sb, n, full=False)
        if "rollback_disk" in ops:
            series["rollback_disk"] = rollback_series(sb, n, full=False)
        _keep(series, out, spans)
    finally:
        sb.delete()


def measure_checkpoints(sp: Space, ops: set[str], n: int, out: dict[str, list[float]],
                        spans: dict[str, dict[str, float]]) -> None:  # fmt: skip
    """checkpoint_full, rollback_full, fork and fork_n on one running sandbox, each series' span breakdown
    read from the sandbox's traces after it (never timed)."""
    sb: Sandbox = sp.sandboxes.create(template="python")
    try:
        sb.exec("true")
        series: dict[str, api_measure.Series] = {}
        if "checkpoint_full" in ops:
            series["checkpoint_full"], series["checkpoint_then_exec"] = checkpoint_series(sb, n)
        if "rollback_full" in ops:
            series["rollback_full"] = rollback_series(sb, n, full=True)
        if "fork" in ops:
            series["fork"] = api_measure.fork_series(sb, n)
        if "fork_checkpoint" in ops:
            series["fork_checkpoint"] = fork_checkpoint_series(sp, sb, n)
        if "fork_n" in ops:
            series["fork_n"] = fork_n_series(sb, n)
        _keep(series, out, spans)
    finally:
        sb.delete()


def checkpoint_series(sb: Sandbox, n: int) -> tuple[api_measure.Series, api_measure.Series]:
    """Full checkpoints of a running sandbox: each until answered, and until an `exec true` right after it
    answered too (the runtime may still be resuming when the checkpoint answers: ADR 0077)."""
    answered, then_exec = api_measure.Series(), api_measure.Series()
    for _ in range(n):
        with api_spans.window(answered.windows):
            start = time.perf_counter()
            sb.snapshots.create(full=True)
            answered.samples.append(_ms(start))
        sb.exec(["true"])
        then_exec.samples.append(_ms(start))
    return answered.explain(sb), then_exec


def _keep(series: dict[str, api_measure.Series], out: dict[str, list[float]],
          spans: dict[str, dict[str, float]]) -> None:  # fmt: skip
    """Each series' samples into `out`, its span breakdown (if the traces gave one) into `spans`."""
    for name, done in series.items():
        out[name] = done.samples
        if done.spans:
            spans[name] = done.spans


def rollback_series(sb: Sandbox, n: int, *, full: bool) -> api_measure.Series:
    """Rollbacks to one snapshot (a full checkpoint, or the files only), a file written between them (so each
    has something to undo, and must be gone after it)."""
    snap = sb.snapshots.create(full=full)
    series = api_measure.Series()
    for _ in range(n):
        sb.files.write("/work/floors-changed", b"x")
        with api_spans.window(series.windows):
            start = time.perf_counter()
            sb.rollback(snap)
            series.samples.append(_ms(start))
        if sb.exec(["test", "!", "-e", "/work/floors-changed"]).exit_code != 0:
            raise api_measure.BenchFailure(f"{sb.id}: the file written after the snapshot survived")
    return series.explain(sb)


def fork_checkpoint_series(sp: Space, sb: Sandbox, n: int) -> api_measure.Series:
    """Sandboxes started from one full checkpoint of `sb` (`from_snapshot`), each until its first `exec
    true` answered; the breakdown is each child's own trace (its creation)."""
    snap = sb.snapshots.create(full=True)
    series = api_measure.Series()
    breakdowns: list[dict[str, float]] = []
    for _ in range(n):
        window: list[api_spans.Window] = []
        with api_spans.window(window):
            start = time.perf_counter()
            child = sp.sandboxes.create(from_snapshot=snap.id)
            try:
                result = child.exec(["true"])
                series.samples.append(_ms(start))
            except BaseException:
                child.delete()
                raise
        if result.exit_code != 0:
            child.delete()
            raise api_measure.BenchFailure(f"`true` exited {result.exit_code} in {child.id}")
        breakdowns += api_spans.sample_breakdowns(api_spans.traces_of(child), window)
        child.delete()
    series.spans = api_spans.median_breakdown(breakdowns)
    return series


def fork_n_series(sb: Sandbox, n: int) -> api_measure.Series:
    """FORK_N children in one request, until each answered `exec true` (the execs run side by side)."""
    series = api_measure.Series()
    with ThreadPoolExecutor(max_workers=FORK_N) as pool:
        for _ in range(n):
            children: list[Sandbox] = []
            try:
                with api_spans.window(series.windows):
                    start = time.perf_counter()
                    children = sb.fork(FORK_N)
                    codes = list(pool.map(lambda child: child.exec(["true"]).exit_code, children))
                    series.samples.append(_ms(start))
                if any(codes):
                    raise api_measure.BenchFailure(f"a child of {sb.id} answered exit codes {codes}")
            finally:
                for child in children:
                    child.delete()
    return series.explain(sb)


def measure_layers(
    sp: Space, data_dir: pathlib.Path, node_url: str, n: int, out: dict[str, list[float]]
) -> None:
    """The same operations below the API, on a sandbox the control plane is told nothing about meanwhile
    (each pause is followed by its resume, so the record's `running` stays true)."""
    import asyncio

    from space.node.agent.helper_client import HelperClient
    from space.node.agent.identity import default_rpc_token_file
    from space.node.rpc_client import NodeClient

    sb = sp.sandboxes.create(template="python")
    try:
        sb.exec("true")
        token = default_rpc_token_file(data_dir).read_text().strip()

        async def run() -> None:
            async with NodeClient(node_url, token) as node:
                for _ in range(n):
                    start = time.perf_counter()
                    await node.pause(sb.id)
                    out.setdefault("node_pause", []).append(_ms(start))
                    start = time.perf_counter()
                    await node.resume(sb.id)
                    out.setdefault("node_resume", []).append(_ms(start))
                for _ in range(n):
                    start = time.perf_counter()
                    snap = await node.create_snapshot(sb.id, full=False)
                    out.setdefault("node_snapshot_disk", []).append(_ms(start))
                for _ in range(n):
                    start = time.perf_counter()
                    await node.rollback(sb.id, snap.snapshot_id)
                    out.setdefault("node_rollback_disk", []).append(_ms(start))
            helper = HelperClient(str(data_dir / "helper.sock"))
            try:
                for _ in range(n):
                    start = time.perf_counter()
                    await helper.call("sandbox.pause", {"sandbox_id": sb.id})
                    out.setdefault("helper_pause", []).append(_ms(start))
                    start = time.perf_counter()
                    await helper.call("sandbox.resume", {"sandbox_id": sb.id})
                    out.setdefault("helper_resume", []).append(_ms(start))
                container = (data_dir / "run" / sb.id / "container").read_text().strip()
                runsc = ["runsc", "--root", str(data_dir / "runsc")]
                for _ in range(n):
                    for verb in ("pause", "resume"):
                        start = time.perf_counter()
                        subprocess.run([*runsc, verb, container], check=True, capture_output=True)
                        out.setdefault(f"runsc_{verb}", []).append(_ms(start))
                # A disk rollback's three helper verbs, each on its own (the node's handle is left behind:
                # the sandbox is deleted after). The control plane sees the runtime go and may start it
                # again between two verbs (it converges to the record's "running"): such a round is
                # counted as lost, not measured.
                for _ in range(n):
                    try:
                        for verb, params in (
                            ("sandbox.stop", {"sandbox_id": sb.id}),
                            ("sandbox.reset_rootfs", {"sandbox_id": sb.id, "snapshot_id": snap.snapshot_id}),
                            ("sandbox.start", {"sandbox_id": sb.id}),
                        ):
                            start = time.perf_counter()
                            await helper.call(verb, params)
                            out.setdefault(f"helper_{verb.split('.')[1]}", []).append(_ms(start))
                    except SpaceError as exc:
                        print(f"layers: a disk-rollback round lost to the control plane: {exc}", flush=True)
            finally:
                await helper.close()

        asyncio.run(run())
    finally:
        sb.delete()


def report(out: dict[str, list[float]], spans: dict[str, dict[str, float]]) -> None:
    for name, samples in out.items():
        print(f"{name:16s} n={len(samples):3d} p50={_p(samples, 50):8.1f} ms  p90={_p(samples, 90):8.1f} ms")
    if "fork" in out and "fork_n" in out:
        ratio = _p(out["fork_n"], 50) / (FORK_N * _p(out["fork"], 50))
        print(f"fork_n p50 / ({FORK_N} x fork p50) = {ratio:.2f}")
    if spans:
        print("where the milliseconds go (median span breakdown, ms; spans nest: read top-down)")
        for name, breakdown in spans.items():
            print(f"{name:16s} {api_spans.format_breakdown(breakdown, width=12)}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args()
    ops = set(args.ops.split(","))
    out: dict[str, list[float]] = {}
    spans: dict[str, dict[str, float]] = {}
    with embedded() as (sp, data_dir, node_url):
        sp.sandboxes.create(template="python").delete()  # warm: the template is prepared
        if "delete" in ops:
            measure_delete(sp, args.n, out)
        measure_on_one(sp, ops, args.n, out, spans)
        if ops & {"checkpoint_full", "rollback_full", "fork", "fork_checkpoint", "fork_n"}:
            measure_checkpoints(sp, ops, args.n, out, spans)
        try:
            if "layers" in ops:
                measure_layers(sp, data_dir, node_url, args.n, out)
        finally:
            report(out, spans)  # before the purge: a teardown that fails on a loaded machine loses nothing


if __name__ == "__main__":
    main()
