"""The operations `space bench` measures through the public API (the SDK), each a list of latencies in ms.

What each sample is:
- create (warm, cold, c8): `POST /v1/sandboxes` to the first `exec true` answered (the seed's definition of
  creation; issue 12). The sandbox's `created_from` ('pool', 'warm', 'cold'; read after the clock stopped)
  is counted per sample, 'unknown' when the server does not say.
- exec_true: `exec ["true"]` on a running sandbox; exec_true_node: the same call on the node's own RPC.
- file_4k: write 4 KiB, then read it back. pause / resume: each call until the sandbox settled.
- snapshot_disk / checkpoint_full: one snapshot each (disk only / processes and memory too).
- fork: the fork request to the child's first exec answered. suspend: until suspended; restore: the
  restore request to the first exec answered.

Invariants:
- Every sandbox made here is deleted before its function returns, also when a step fails.
- Nothing is printed: progress goes to the `log` callable (stderr), so `--json` keeps stdout clean.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench import api_spans
from space import Space
from space.sdk import Sandbox

Log = Callable[[str], None]
FILE_4K = b"x" * 4096


class BenchFailure(RuntimeError):
    """A measured operation answered wrongly (not a slow answer: a wrong one)."""


@dataclass
class Series:
    """The samples of one operation, and where created sandboxes came from (creation only)."""

    samples: list[float] = field(default_factory=list)
    origins: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Each sample's wall-clock window, and the median span breakdown read after the series (ADR 0072).
    windows: list[api_spans.Window] = field(default_factory=list)
    spans: dict[str, float] = field(default_factory=dict)

    def extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"from": dict(sorted(self.origins.items()))} if self.origins else {}
        if self.spans:
            extra["spans"] = self.spans
        return extra

    def explain(self, sb: Sandbox) -> Series:
        """Read the span breakdown of this series' samples on `sb` (after the series: never timed)."""
        self.spans = api_spans.breakdown(sb, self.windows)
        return self


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _check_exec(sb: Sandbox) -> None:
    result = sb.exec(["true"])
    if result.exit_code != 0:
        raise BenchFailure(f"`true` exited {result.exit_code} in {sb.id}")


def create_once(
    sp: Space, template: str, limits: Mapping[str, Any] | None = None
) -> tuple[float, str, list[dict[str, float]]]:
    """One creation: ms from the request to the first exec answered, the sandbox's `created_from`, and its
    span breakdown (read once the clock stopped; empty when the control plane keeps no traces)."""
    started_ns = time.time_ns()
    start = time.perf_counter()
    sb = sp.sandboxes.create(template=template, limits=limits)
    try:
        _check_exec(sb)
        elapsed = _ms(start)
        window = (started_ns, time.time_ns())
        origin = sb.data.get("created_from") or sb.refresh().data.get("created_from")
        spans = api_spans.sample_breakdowns(api_spans.traces_of(sb, limit=10), [window])
    finally:
        sb.delete()
    return elapsed, str(origin or "unknown"), spans


@dataclass
class Creation:
    """A series of creations: `n` in bursts of `concurrency` (threads, one client each), a burst starting
    no sooner than `concurrency / rate` s after the one before (rate None: back to back)."""

    url: str
    api_key: str | None
    template: str
    limits: Mapping[str, Any] | None = None
    rate: float | None = None

    def run(self, n: int, concurrency: int, log: Log, label: str) -> Series:
        series = Series()
        span_samples: list[dict[str, float]] = []
        clients = [Space(url=self.url, api_key=self.api_key) for _ in range(concurrency)]
        try:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                for first in range(0, n, concurrency):
                    started = time.monotonic()
                    size = min(concurrency, n - first)
                    calls = [
                        pool.submit(create_once, sp, self.template, self.limits) for sp in clients[:size]
                    ]
                    for call in calls:
                        elapsed, origin, spans = call.result()
                        series.samples.append(elapsed)
                        series.origins[origin] += 1
                        span_samples.extend(spans)
                    if (first // concurrency) % max(1, n // concurrency // 10) == 0 or first + size == n:
                        log(f"{label}: {first + size}/{n} {dict(series.origins)}")
                    if self.rate:
                        time.sleep(max(0.0, started + size / self.rate - time.monotonic()))
        finally:
            for sp in clients:
                sp.close()
        series.spans = api_spans.median_breakdown(span_samples)
        return series


@contextlib.contextmanager
def subject(sp: Space, template: str) -> Iterator[Sandbox]:
    """A running sandbox for the per-sandbox operations, deleted at the end."""
    sb = sp.sandboxes.create(template=template)
    try:
        _check_exec(sb)
        yield sb
    finally:
        sb.delete()


def exec_series(sb: Sandbox, n: int) -> Series:
    series = Series()
    for _ in range(n):
        with api_spans.window(series.windows):
            start = time.perf_counter()
            _check_exec(sb)
            series.samples.append(_ms(start))
    return series.explain(sb)


def node_exec_series(node_url: str, rpc_token: str, sandbox_id: str, n: int) -> Series:
    """`exec true` on the node's RPC directly (the reference the API's hop is compared with)."""
    from space.node.rpc_client import NodeClient  # only on the node's host: not every run loads it

    async def run() -> list[float]:
        async with NodeClient(node_url, rpc_token) as node:
            await node.exec(sandbox_id, ["true"])
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                await node.exec(sandbox_id, ["true"])
                samples.append(_ms(start))
            return samples

    return Series(samples=asyncio.run(run()))


def file_series(sb: Sandbox, n: int) -> Series:
    series = Series()
    for i in range(n):
        path = f"/work/bench-{i % 4}"
        with api_spans.window(series.windows):
            start = time.perf_counter()
            sb.files.write(path, FILE_4K)
            data = sb.files.read(path)
            series.samples.append(_ms(start))
        if data != FILE_4K:
            raise BenchFailure(f"read back {len(data)} bytes of {path}, not the 4096 written")
    return series.explain(sb)


def pause_resume_series(sb: Sandbox, n: int) -> tuple[Series, Series]:
    paused, resumed = Series(), Series()
    for _ in range(n):
        with api_spans.window(paused.windows):
            start = time.perf_counter()
            sb.pause()
            paused.samples.append(_ms(start))
        with api_spans.window(resumed.windows):
            start = time.perf_counter()
            sb.resume()
            resumed.samples.append(_ms(start))
    if sb.state != "running":
        raise BenchFailure(f"{sb.id} is {sb.state} after resume")
    _check_exec(sb)
    return paused.explain(sb), resumed.explain(sb)


def snapshot_series(sb: Sandbox, n: int, *, full: bool) -> Series:
    series = Series()
    for _ in range(n):
        with api_spans.window(series.windows):
            start = time.perf_counter()
            sb.snapshots.create(full=full)
            series.samples.append(_ms(start))
    return series.explain(sb)


def fork_series(sb: Sandbox, n: int) -> Series:
    series = Series()
    for _ in range(n):
        with api_spans.window(
            series.windows
        ):  # the fork request's trace (the parent's); the child's are its own
            start = time.perf_counter()
            child = sb.fork()
            try:
                _check_exec(child)
                series.samples.append(_ms(start))
            finally:
                child.delete()
    return series.explain(sb)


def suspend_restore_series(sb: Sandbox, n: int) -> tuple[Series, Series]:
    suspended, restored = Series(), Series()
    for _ in range(n):
        with api_spans.window(suspended.windows):
            start = time.perf_counter()
            sb.suspend()
            suspended.samples.append(_ms(start))
        if sb.state != "suspended":
            raise BenchFailure(f"{sb.id} is {sb.state} after suspend")
        with api_spans.window(restored.windows):
            start = time.perf_counter()
            sb.restore()
            _check_exec(sb)
            restored.samples.append(_ms(start))
    return suspended.explain(sb), restored.explain(sb)
