"""The node's metrics history (docs/adr/0053-sandbox-metrics-history.md): every `interval_s` one pass over
the running sandboxes reads their CPU, memory and disk counters through the driver (on a runsc node one
helper call per MAX_PER_CALL sandboxes), and a bounded ring per sandbox keeps the last `keep_s` of samples.

Invariants:
- Only sandboxes in state `running` are read: paused, stopped, suspended ones and those in a lifecycle step
  cost nothing and get no samples (their history is kept while they stay on this node).
- Work per tick is bounded: one driver call per MAX_PER_CALL running sandboxes; memory per sandbox is
  bounded: a ring of `capacity` samples (at most MAX_CAPACITY) in five float columns.
- A ring belongs to one handle: when the sandbox leaves this node (deleted, moved, suspended away) or its
  id is registered again by a new handle, its history is dropped (at the next tick, and never served: an
  answer checks the handle), so a history never outlives its sandbox or passes to another.
- CPU use is a delta of the cumulative counter between two readings of the same runtime; the first reading
  after the sandbox (re)started running, or of a new runtime (a restore, a rollback: `source` changed),
  only primes the next one, so no sample ever spans a pause or mixes two runtimes.
- The history survives an agent restart, not a copy change: it is saved to the agent's state directory
  every SAVE_EVERY_S and when the sampler closes (space.node.agent.metrics_store), and read back once at
  start for the sandboxes adopted with the same incarnation. What a SIGKILL cuts off is at most the last
  SAVE_EVERY_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pathlib
import time
from array import array
from collections.abc import Iterator
from typing import Any

from space.core import disk
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent import metrics_store
from space.node.agent.metrics_models import MAX_SAMPLES, MetricSample, MetricsAnswer
from space.node.agent.sandbox_handle import SandboxHandle
from space.node.agent.sandbox_registry import SandboxRegistry

log = logging.getLogger("space.node.agent.metrics")

#: Sandboxes read by one driver call (the helper's own bound, space.node.helper.metrics_verbs).
MAX_PER_CALL = 256
#: The most samples a ring keeps, whatever keep_s / interval_s says (8192 x 5 columns x 8 bytes = 320 KiB).
MAX_CAPACITY = 8192
_COLUMNS = ("timestamp", "cpu_used_pct", "mem_used", "mem_cache", "disk_used")
#: How often the history is saved for the next agent (besides when the sampler closes), seconds.
SAVE_EVERY_S = 60.0
#: The file of the agent's state directory the history is saved in (Driver.state_file).
STATE_FILE = "metrics-history.json"


def _number(value: Any) -> float:
    """A reading as a column value: NaN for unknown."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def _count(value: float) -> int | None:
    return None if math.isnan(value) else int(value)


class MetricsRing:
    """The last `capacity` samples of one sandbox (one handle), oldest overwritten first."""

    def __init__(self, handle: SandboxHandle, capacity: int) -> None:
        self.handle = handle
        self.capacity = capacity
        self._columns = [array("d", bytes(8 * capacity)) for _ in _COLUMNS]
        self._next = 0
        self.count = 0
        #: (monotonic time, cumulative CPU ns, runtime source) of the previous reading; None: prime next.
        self.previous: tuple[float, int, str] | None = None

    def record(self, now: float, monotonic: float, reading: dict[str, Any]) -> bool:
        """Take one driver reading; True when it made a sample (not the first of a run, not unreadable)."""
        cpu_ns, memory = reading.get("cpu_ns"), reading.get("memory_bytes")
        if not isinstance(cpu_ns, int) or not isinstance(memory, int):
            self.previous = None
            return False
        source = str(reading.get("source") or "")
        previous, self.previous = self.previous, (monotonic, cpu_ns, source)
        if previous is None or previous[2] != source or cpu_ns < previous[1] or monotonic <= previous[0]:
            return False
        cores = self.handle.spec.limits.cpus
        percent = (cpu_ns - previous[1]) / ((monotonic - previous[0]) * 1e9 * cores) * 100.0
        row = (now, percent, memory, reading.get("memory_cache_bytes"), reading.get("disk_bytes"))
        self._append(tuple(_number(value) for value in row))
        return True

    def _append(self, row: tuple[float, ...]) -> None:
        for column, value in zip(self._columns, row, strict=True):
            column[self._next] = value
        self._next = (self._next + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def extend(self, rows: list[tuple[float, ...]]) -> None:
        """Take back saved rows (space.node.agent.metrics_store), oldest first; the newest `capacity` stay."""
        for row in rows[-self.capacity :]:
            self._append(row)

    def rows(self) -> Iterator[tuple[float, ...]]:
        """Every kept sample as a row of column values, oldest first."""
        first = (self._next - self.count) % self.capacity
        for offset in range(self.count):
            index = (first + offset) % self.capacity
            yield tuple(column[index] for column in self._columns)

    @staticmethod
    def _sample(row: tuple[float, ...], limits: SandboxLimits) -> MetricSample:
        return MetricSample(
            timestamp=row[0], cpu_count=limits.cpus, cpu_used_pct=round(row[1], 3),
            mem_used_bytes=int(row[2]), mem_total_bytes=limits.memory_mb * disk.MiB,
            mem_cache_bytes=_count(row[3]), disk_used_bytes=_count(row[4]),
            disk_total_bytes=limits.storage_mb * disk.MiB,
        )  # fmt: skip

    def window(self, start: float | None, end: float | None, limit: int) -> tuple[list[MetricSample], bool]:
        """The newest `limit` samples with start <= timestamp <= end (oldest first), and whether the window
        held more."""
        lower = -math.inf if start is None else start
        upper = math.inf if end is None else end
        rows = [row for row in self.rows() if lower <= row[0] <= upper]
        limits = self.handle.spec.limits
        samples = [self._sample(row, limits) for row in rows[-limit:]]
        return samples, len(rows) > limit


class MetricsSampler:
    """Samples `agent`'s running sandboxes every `interval_s` into rings of `keep_s` (see the module)."""

    @property
    def state_file(self) -> pathlib.Path | None:
        """Asked of the agent's driver at each use, never at construction (an app may be built before its
        agent has a driver, and the egress wiring wraps the driver after start-up)."""
        return self.agent.driver.state_file(STATE_FILE)

    def __init__(self, agent: SandboxRegistry, *, interval_s: float = 5.0, keep_s: float = 3600.0) -> None:
        self.agent = agent
        self.interval_s = interval_s
        self.capacity = max(2, min(MAX_CAPACITY, math.ceil(keep_s / interval_s)))
        self.rings: dict[str, MetricsRing] = {}
        self._task: asyncio.Task[None] | None = None
        self._saved_at = time.monotonic()
        #: What sampling cost this process: ticks run and their CPU time (process_time), for the ADR.
        self.ticks = 0
        self.tick_cpu_s = 0.0

    # -- the loop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Take back what the previous agent saved, then sample every interval_s."""
        if self._task is None:
            self.restore()
            self._task = asyncio.create_task(self._run(), name="metrics-sampler")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.save()

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self.tick()
            except Exception:  # a failed tick must not end the history; the next one tries again
                log.exception("metrics tick failed")
            if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
                self.save()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - began)))

    async def tick(self) -> int:
        """One pass: forget what left, read every running sandbox; the number of samples made."""
        cpu_before = time.process_time()
        self._forget_gone()
        running: list[SandboxHandle] = []
        for handle in self.agent.sandboxes.values():
            if handle.state == State.RUNNING:
                running.append(handle)
            elif (ring := self.rings.get(handle.sandbox_id)) is not None:
                ring.previous = None  # not running now: the next run starts a new CPU delta
        made = 0
        for first in range(0, len(running), MAX_PER_CALL):
            chunk = running[first : first + MAX_PER_CALL]
            readings = await self.agent.driver.metrics([h.sandbox_id for h in chunk])
            now, monotonic = time.time(), time.monotonic()
            for handle in chunk:
                reading = readings.get(handle.sandbox_id)
                if reading is not None and self.agent.sandboxes.get(handle.sandbox_id) is handle:
                    made += self._ring(handle).record(now, monotonic, reading)
        self.ticks += 1
        self.tick_cpu_s += time.process_time() - cpu_before
        return made

    def _ring(self, handle: SandboxHandle) -> MetricsRing:
        ring = self.rings.get(handle.sandbox_id)
        if ring is None or ring.handle is not handle:
            ring = self.rings[handle.sandbox_id] = MetricsRing(handle, self.capacity)
        return ring

    # -- across agent restarts (space.node.agent.metrics_store) ----------------------------------------------
    def save(self) -> None:
        """Save every current history with its copy's incarnation (a failure is logged: it costs only the
        next agent its history)."""
        self._saved_at = time.monotonic()
        if self.state_file is None:
            return
        self._forget_gone()
        histories = {
            sandbox_id: metrics_store.SavedHistory(self.agent.incarnations.get(sandbox_id), list(ring.rows()))
            for sandbox_id, ring in self.rings.items()
        }
        try:
            metrics_store.save(self.state_file, histories, len(_COLUMNS))
        except OSError as exc:
            log.warning("metrics history not saved to %s: %s", self.state_file, exc)

    def restore(self) -> int:
        """Take back the saved histories of the sandboxes this agent holds, each only by the copy of the
        incarnation it was saved with; the number taken back."""
        if self.state_file is None:
            return 0
        taken = 0
        for sandbox_id, saved in metrics_store.load(self.state_file, len(_COLUMNS)).items():
            handle = self.agent.sandboxes.get(sandbox_id)
            if handle is None or saved.incarnation != self.agent.incarnations.get(sandbox_id):
                continue
            if any(len(row) != len(_COLUMNS) for row in saved.rows):
                continue
            ring = MetricsRing(handle, self.capacity)
            ring.extend(saved.rows)
            self.rings[sandbox_id] = ring
            taken += 1
        return taken

    def _forget_gone(self) -> None:
        for sandbox_id, ring in list(self.rings.items()):
            if self.agent.sandboxes.get(sandbox_id) is not ring.handle:
                del self.rings[sandbox_id]

    # -- answers -------------------------------------------------------------------------------------------
    def answer(
        self, sandbox_id: str, start: float | None = None, end: float | None = None, limit: int = MAX_SAMPLES
    ) -> MetricsAnswer:
        """The kept samples of a sandbox on this node (NotFound for any other), as the module says."""
        handle = self.agent.get(sandbox_id)
        ring = self.rings.get(handle.sandbox_id)
        samples: list[MetricSample] = []
        truncated = False
        if ring is not None and ring.handle is handle:
            samples, truncated = ring.window(start, end, min(limit, MAX_SAMPLES))
        return MetricsAnswer(
            sandbox_id=handle.sandbox_id, interval_s=self.interval_s, samples=samples, truncated=truncated
        )
