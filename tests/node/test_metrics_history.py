"""The node's metrics history (space.node.agent.metrics) over the fake driver: the ring's bounds and windows,
what a tick samples (running sandboxes only, in one driver call), CPU and memory that a sandbox uses showing
in its samples, and the history dropped with its sandbox. Ticks are driven by hand: no test waits for the
sampler's clock."""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from space.core import errors
from space.core.ids import new_sandbox_id
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent import metrics_store
from space.node.agent.agent import NodeAgent
from space.node.agent.metrics import MAX_CAPACITY, MetricsRing, MetricsSampler
from space.node.agent.metrics_models import MAX_TIMESTAMP, check_window
from space.node.agent.sandbox_handle import SandboxHandle
from space.node.drivers.base import SandboxSpec
from space.node.helper.metrics_verbs import MetricsParams, cgroup_counters
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop
agent = fake_agent.agent

MiB = 1 << 20


def _handle(sandbox_id: str = "sb-0123456789abcdef", cpus: float = 0.5) -> SandboxHandle:
    limits = SandboxLimits(cpus=cpus, memory_mb=256, storage_mb=1024)
    return SandboxHandle(sandbox_id, SandboxSpec(sandbox_id, limits=limits), State.RUNNING, time.time())


def _reading(
    cpu_ns: int, memory: int = 10 * MiB, source: str = "rt-0", disk: int | None = 4096
) -> dict[str, Any]:
    return {"cpu_ns": cpu_ns, "memory_bytes": memory, "memory_cache_bytes": None, "disk_bytes": disk,
            "source": source}  # fmt: skip


# -- the ring ------------------------------------------------------------------------------------------------
def test_the_ring_keeps_its_capacity_and_answers_windows_oldest_first() -> None:
    ring = MetricsRing(_handle(cpus=0.5), capacity=4)
    assert ring.record(1000.0, 0.0, _reading(0)) is False  # the first reading only primes
    for second in range(1, 7):
        # 0.25 s of CPU per second on half a core: 50 % of the limit
        assert ring.record(1000.0 + second, float(second), _reading(second * 250_000_000)) is True
    samples, truncated = ring.window(None, None, 100)
    assert [s.timestamp for s in samples] == [1003.0, 1004.0, 1005.0, 1006.0]  # the oldest were overwritten
    assert truncated is False
    first = samples[0]
    assert first.cpu_used_pct == pytest.approx(50.0)
    assert (first.cpu_count, first.mem_used_bytes, first.mem_total_bytes) == (0.5, 10 * MiB, 256 * MiB)
    assert (first.mem_cache_bytes, first.disk_used_bytes, first.disk_total_bytes) == (None, 4096, 1024 * MiB)
    window, truncated = ring.window(1004.0, 1005.0, 100)
    assert [s.timestamp for s in window] == [1004.0, 1005.0]
    newest, truncated = ring.window(None, None, 2)
    assert [s.timestamp for s in newest] == [1005.0, 1006.0] and truncated is True
    assert ring.window(0.0, 999.0, 100) == ([], False)


def test_no_sample_spans_two_runtimes_or_an_unreadable_counter() -> None:
    ring = MetricsRing(_handle(), capacity=8)
    ring.record(1.0, 1.0, _reading(5_000_000_000))
    assert ring.record(2.0, 2.0, _reading(100, source="rt-1")) is False  # a restore: a new runtime primes
    assert ring.record(3.0, 3.0, _reading(50)) is False  # back on "rt-0"'s name but the counter went down
    assert ring.record(4.0, 4.0, {"cpu_ns": None, "memory_bytes": 1}) is False
    assert ring.previous is None
    assert ring.record(5.0, 5.0, _reading(0)) is False
    assert ring.record(6.0, 6.0, _reading(100_000_000, disk=None)) is True
    (sample,), _ = ring.window(None, None, 10)
    assert sample.disk_used_bytes is None and sample.cpu_used_pct == pytest.approx(20.0)


def test_the_sampler_bounds_its_rings() -> None:
    registry: Any = SimpleNamespace(sandboxes={}, driver=SimpleNamespace(state_file=lambda _name: None))
    assert MetricsSampler(registry, interval_s=5.0, keep_s=3600.0).capacity == 720
    assert MetricsSampler(registry, interval_s=0.1, keep_s=7 * 86400.0).capacity == MAX_CAPACITY
    assert MetricsSampler(registry, interval_s=10.0, keep_s=1.0).capacity == 2


@pytest.mark.parametrize(
    ("start", "end", "field"),
    [(-1.0, None, "start"), (None, MAX_TIMESTAMP + 1, "end"), (math.nan, None, "start"),
     (None, math.inf, "end"), (10.0, 5.0, "start")],
)  # fmt: skip
def test_a_window_that_is_not_one_is_refused(start: float | None, end: float | None, field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        check_window(start, end)
    assert caught.value.details.get("field") == field
    check_window(0.0, MAX_TIMESTAMP)  # the widest window is fine


# -- the sampler over the fake driver ------------------------------------------------------------------------
class _Counting:
    """Wraps the driver's metrics call: which ids each tick asked for."""

    def __init__(self, agent: NodeAgent) -> None:
        self.calls: list[list[str]] = []
        self._inner = agent.driver.metrics

        async def metrics(sandbox_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
            self.calls.append(list(sandbox_ids))
            return await self._inner(sandbox_ids)

        agent.driver.metrics = metrics  # type: ignore[method-assign]


def test_a_tick_reads_running_sandboxes_only_in_one_call(loop: BackgroundLoop, agent: NodeAgent) -> None:
    sampler = MetricsSampler(agent, interval_s=5.0)
    counting = _Counting(agent)
    running, paused, stopped = (loop.run(agent.create()) for _ in range(3))
    loop.run(agent.pause(paused.sandbox_id))
    loop.run(agent.stop(stopped.sandbox_id))
    assert loop.run(sampler.tick()) == 0  # primes
    assert loop.run(sampler.tick()) == 1
    assert counting.calls == [[running.sandbox_id], [running.sandbox_id]]
    assert sampler.answer(paused.sandbox_id).samples == []
    assert sampler.answer(stopped.sandbox_id).samples == []
    assert len(sampler.answer(running.sandbox_id).samples) == 1
    loop.run(agent.pause(running.sandbox_id))
    loop.run(sampler.tick())
    assert len(counting.calls) == 2  # nothing running: no driver call at all
    kept = sampler.answer(running.sandbox_id)
    assert len(kept.samples) == 1, "a paused sandbox keeps what was sampled"
    loop.run(agent.resume(running.sandbox_id))
    assert loop.run(sampler.tick()) == 0, "the first reading after a pause only primes"


def test_cpu_and_memory_a_sandbox_uses_show_in_its_samples(loop: BackgroundLoop, agent: NodeAgent) -> None:
    sampler = MetricsSampler(agent, interval_s=1.0)
    idle = loop.run(agent.create(limits=SandboxLimits(cpus=1.0)))
    busy = loop.run(agent.create(limits=SandboxLimits(cpus=1.0)))
    burn = "x = b'x' * (200 << 20)\nwhile True: pass"  # 200 MiB touched, then a spinning loop
    started = loop.run(busy.session.start_background(["python3", "-c", burn], timeout=60))
    time.sleep(1.0)  # the allocation is made before the window the samples measure
    loop.run(sampler.tick())
    time.sleep(2.0)
    loop.run(sampler.tick())
    (hot,) = sampler.answer(busy.sandbox_id).samples
    (cold,) = sampler.answer(idle.sandbox_id).samples
    # A spinning loop on a one-core limit beside an idle daemon (the share it gets depends on the load of
    # this shared machine, so it is compared with the idle one, not with 100 %).
    assert hot.cpu_used_pct > max(10.0, 5 * cold.cpu_used_pct), (hot, cold)
    assert hot.mem_used_bytes > cold.mem_used_bytes + 150 * MiB
    assert hot.disk_used_bytes is not None and hot.disk_total_bytes == busy.spec.limits.storage_mb * MiB
    loop.run(busy.session.signal(str(started["process_id"]), "SIGKILL"))


def test_the_history_goes_with_its_sandbox(loop: BackgroundLoop, agent: NodeAgent) -> None:
    sampler = MetricsSampler(agent, interval_s=5.0)
    handle = loop.run(agent.create())
    loop.run(sampler.tick())
    loop.run(sampler.tick())
    assert len(sampler.answer(handle.sandbox_id).samples) == 1
    loop.run(agent.delete(handle.sandbox_id))
    with pytest.raises(errors.NotFound):
        sampler.answer(handle.sandbox_id)
    loop.run(sampler.tick())
    assert handle.sandbox_id not in sampler.rings
    # A new copy under the same id (a restore here, a fork child) starts a history of its own.
    again = loop.run(agent.create(sandbox_id=handle.sandbox_id))
    sampler.rings[handle.sandbox_id] = MetricsRing(handle, 4)  # a ring left from the old handle
    assert sampler.answer(again.sandbox_id).samples == []
    loop.run(sampler.tick())
    assert sampler.rings[again.sandbox_id].handle is again


def test_the_sampler_runs_on_its_own_and_stops(loop: BackgroundLoop, agent: NodeAgent) -> None:
    sampler = MetricsSampler(agent, interval_s=0.2)
    handle = loop.run(agent.create())

    async def started() -> None:
        sampler.start()

    loop.run(started())
    deadline = time.monotonic() + 30
    while not sampler.answer(handle.sandbox_id).samples:
        assert time.monotonic() < deadline, "no sample within 30 s at a 0.2 s interval"
        time.sleep(0.1)
    loop.run(sampler.close())
    ticks = sampler.ticks
    time.sleep(0.5)
    assert sampler.ticks == ticks and sampler.tick_cpu_s > 0


# -- the helper verb's input and its cgroup reading --------------------------------------------------------
SB = new_sandbox_id()


@pytest.mark.parametrize(
    "args",
    [{"sandbox_ids": []}, {"sandbox_ids": ["sb-../../etc"]}, {"sandbox_ids": ["/sys/fs/cgroup"]},
     {"sandbox_ids": [SB] * 257}, {"sandbox_ids": SB}, {"sandbox_ids": [SB], "cgroup": "space/x"},
     {"sandbox_ids": [SB + "\n"]}, {"sandbox_ids": [SB + "/.."]}],
)  # fmt: skip
def test_the_metrics_verb_takes_only_a_bounded_list_of_sandbox_ids(args: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        MetricsParams.model_validate(args)
    assert MetricsParams.model_validate({"sandbox_ids": [SB] * 256})


def test_cgroup_counters_of_v1_and_v2_trees(tmp_path: pathlib.Path) -> None:
    v1 = tmp_path / "v1"
    (v1 / "memory/space/c-1").mkdir(parents=True)
    (v1 / "cpuacct/space/c-1").mkdir(parents=True)
    (v1 / "cpuacct/space/c-1/cpuacct.usage").write_text("123456789\n")
    (v1 / "memory/space/c-1/memory.usage_in_bytes").write_text("4096\n")
    (v1 / "memory/space/c-1/memory.stat").write_text("cache 100\nrss 5\ntotal_cache 300\n")
    assert cgroup_counters("space/c-1", v1) == {
        "cpu_ns": 123456789,
        "memory_bytes": 4096,
        "memory_cache_bytes": 300,
    }
    v2 = tmp_path / "v2"
    (v2 / "space/c-1").mkdir(parents=True)
    (v2 / "space/c-1/cpu.stat").write_text("usage_usec 42\nuser_usec 40\n")
    (v2 / "space/c-1/memory.current").write_text("8192\n")
    (v2 / "space/c-1/memory.stat").write_text("anon 1\nfile 77\n")
    assert cgroup_counters("space/c-1", v2) == {
        "cpu_ns": 42000,
        "memory_bytes": 8192,
        "memory_cache_bytes": 77,
    }
    # a cgroup gone between two reads: unknown, not an error
    assert cgroup_counters("space/gone", v2) == {
        "cpu_ns": None,
        "memory_bytes": None,
        "memory_cache_bytes": None,
    }


# -- across agent restarts -----------------------------------------------------------------------------------
def test_the_history_survives_the_sampler_of_a_restarted_agent(
    loop: BackgroundLoop, agent: NodeAgent
) -> None:
    first = MetricsSampler(agent, interval_s=5.0)
    kept, moved = loop.run(agent.create()), loop.run(agent.create())
    agent.incarnations.place(moved.sandbox_id, 3, has_copy=True)
    for _ in range(3):
        loop.run(first.tick())
    before = first.answer(kept.sandbox_id).samples
    assert len(before) == 2 and len(first.answer(moved.sandbox_id).samples) == 2

    async def restart() -> None:
        first.start()
        await first.close()  # saves, as the agent does when it stops

    loop.run(restart())
    assert first.state_file is not None and first.state_file.stat().st_mode & 0o777 == 0o600
    # Meanwhile `moved` was restored elsewhere and placed here again: its history is not this copy's.
    agent.incarnations.forget(moved.sandbox_id)
    agent.incarnations.place(moved.sandbox_id, 4, has_copy=False)
    second = MetricsSampler(agent, interval_s=5.0)
    assert second.restore() == 1
    assert second.answer(kept.sandbox_id).samples == before  # bit for bit
    assert second.answer(moved.sandbox_id).samples == []
    assert loop.run(second.tick()) == 0, "the first reading of the new agent only primes"
    assert loop.run(second.tick()) == 2
    assert len(second.answer(kept.sandbox_id).samples) == 3


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[]", b'{"format": 99, "columns": 5, "sandboxes": {}}',
     b'{"format": 1, "columns": 4, "sandboxes": {}}',
     b'{"format": 1, "columns": 5, "sandboxes": {"SB": {"incarnation": null, "samples": "!!"}}}',
     b'{"format": 1, "columns": 5, "sandboxes": {"SB": {"incarnation": "1", "samples": ""}}}',
     b'{"format": 1, "columns": 5, "sandboxes": {"SB": {"incarnation": null, "samples": "AAAA"}}}'],
)  # fmt: skip
def test_a_history_file_that_is_not_one_is_ignored(tmp_path: pathlib.Path, body: bytes) -> None:
    path = tmp_path / "metrics-history.json"
    path.write_bytes(body)
    assert metrics_store.load(path, 5) == {}
    assert metrics_store.load(tmp_path / "absent.json", 5) == {}
    good = {"SB": metrics_store.SavedHistory(None, [(1.0, 2.0, 3.0, math.nan, 5.0)])}
    metrics_store.save(path, good, 5)
    loaded = metrics_store.load(path, 5)
    assert loaded["SB"].rows[0][:3] == (1.0, 2.0, 3.0) and math.isnan(loaded["SB"].rows[0][3])
