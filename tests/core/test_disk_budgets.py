"""Disk bounds (issue 9, item 6; docs/adr/0027-disk-budgets.md), fast: the pure rules (space.core.disk,
the storage_mb limit, snapshot-policy minimums, prune-to-fit), the node agent's budget and reserve checks
over the fake driver, and the scheduler's disk admission over an in-memory store."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

from space.controlplane import scheduler
from space.controlplane.store.records import NodeRecord
from space.core import disk, errors, retention
from space.core.lifecycle import State
from space.core.settings import STORAGE_MB_MAX, DiskReserve, SandboxLimits, parse_limits
from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver
from tests.support import fake_agent, sdk_server
from tests.support.loop import BackgroundLoop
from tests.support.sdk_server import invoke, sandbox_json

loop = fake_agent.loop  # a fresh BackgroundLoop per test (not the session loop)
agent = fake_agent.agent  # a NodeAgent over the fake driver
cli_server = sdk_server.cli_server  # the fake API server behind the `space` command

MiB = 1 << 20
GiB = 1 << 30
T0 = datetime(2026, 12, 1, tzinfo=UTC)


# -- the storage_mb limit ------------------------------------------------------------------------------------
def test_storage_budget_defaults_to_twice_the_disk_and_is_bounded() -> None:
    assert SandboxLimits().storage_mb == 2 * SandboxLimits().disk_mb
    assert parse_limits({"disk_mb": 100}).storage_mb == 200
    assert parse_limits({"disk_mb": 100, "storage_mb": None}).storage_mb == 200
    assert parse_limits({"disk_mb": 1048576}).storage_mb == STORAGE_MB_MAX
    assert parse_limits({"disk_mb": 512, "storage_mb": 64}).storage_mb == 64  # below disk_mb is allowed
    for bad in (63, STORAGE_MB_MAX + 1, "100", True, 1.5):
        with pytest.raises(errors.InvalidArgument) as caught:
            parse_limits({"storage_mb": bad})
        assert "storage_mb" in caught.value.message


# -- the node's reserve and the pure checks ------------------------------------------------------------------
def test_reserve_is_five_percent_or_two_gib_whichever_is_smaller() -> None:
    reserve = DiskReserve()
    assert reserve.bytes_for(10 * GiB) == GiB // 2  # 5 %
    assert reserve.bytes_for(1000 * GiB) == 2 * GiB  # capped
    assert DiskReserve(percent=0.0).bytes_for(10 * GiB) == 0
    with pytest.raises(pydantic.ValidationError):
        DiskReserve(percent=51.0)


def test_budget_check_names_used_and_budget() -> None:
    disk.check_budget("sb-x", used_bytes=50 * MiB, needed_bytes=10 * MiB, budget_bytes=60 * MiB, what="w")
    with pytest.raises(errors.StorageExhausted) as caught:
        disk.check_budget("sb-x", used_bytes=50 * MiB, needed_bytes=11 * MiB, budget_bytes=60 * MiB, what="w")
    err = caught.value
    assert isinstance(err, errors.ResourceExhausted) and err.code == "storage_exhausted"
    assert err.details["reason"] == "storage_budget"
    assert (err.details["used_bytes"], err.details["budget_bytes"]) == (50 * MiB, 60 * MiB)
    assert "storage budget" in err.message and "60.0 MiB" in err.message


def test_reserve_check_names_free_space_and_reserve() -> None:
    reserve = DiskReserve(percent=5.0, mb=2048)
    disk.check_reserve(free_bytes=GiB, total_bytes=10 * GiB, needed_bytes=0, reserve=reserve, what="w")
    with pytest.raises(errors.StorageExhausted) as caught:
        disk.check_reserve(free_bytes=GiB, total_bytes=10 * GiB, needed_bytes=GiB // 2 + 1, reserve=reserve,
                           what="checkpoint")  # fmt: skip
    err = caught.value
    assert err.details["reason"] == "node_reserve"
    assert (err.details["free_bytes"], err.details["reserve_bytes"]) == (GiB, GiB // 2)
    assert "1024.0 MiB free" in err.message and "512.0 MiB in reserve" in err.message


def test_snapshot_count_cap() -> None:
    disk.check_snapshot_count("sb-x", disk.MAX_SNAPSHOTS_PER_SANDBOX - 1)
    with pytest.raises(errors.StorageExhausted):
        disk.check_snapshot_count("sb-x", disk.MAX_SNAPSHOTS_PER_SANDBOX)


def test_storage_exhausted_crosses_the_wire_typed() -> None:
    err = errors.StorageExhausted("full", reason="storage_budget", used_bytes=1, budget_bytes=0)
    back = errors.error_from_dict(err.to_dict())
    assert type(back) is errors.StorageExhausted and back.details["used_bytes"] == 1


def test_storage_exhaustion_is_507_and_rate_limits_stay_429() -> None:
    from space.rest.errors import status_for

    assert status_for(errors.StorageExhausted("full")) == 507
    assert status_for(errors.ResourceExhausted("rate")) == 429  # rate limiting keeps 429


# -- snapshot policy minimums --------------------------------------------------------------------------------
def test_policy_minimum_intervals_are_enforced_with_clear_messages() -> None:
    retention.SnapshotPolicy(disk_every_s=60, full_every_s=300)
    with pytest.raises(pydantic.ValidationError) as caught:
        retention.SnapshotPolicy(disk_every_s=59)
    assert "no more often than every 60 s" in str(caught.value)
    with pytest.raises(pydantic.ValidationError) as caught:
        retention.SnapshotPolicy(full_every_s=1)
    assert "no more often than every 300 s" in str(caught.value)
    for bad in (0, retention.MAX_RETAINED + 1):
        with pytest.raises(pydantic.ValidationError):
            retention.SnapshotPolicy(max_retained=bad)


def test_a_stored_policy_below_the_minimums_runs_at_the_minimums() -> None:
    policy = retention.SnapshotPolicy.from_stored({"disk_every_s": 1, "full_every_s": 2, "upload_full": True})
    assert (policy.disk_every_s, policy.full_every_s, policy.upload_full) == (60, 300, True)


def test_operator_can_lower_the_minimums(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retention, "_minimums", retention.MinimumIntervals())
    retention.set_minimum_intervals(1, 2)
    assert retention.SnapshotPolicy(disk_every_s=1, full_every_s=2).disk_every_s == 1
    with pytest.raises(errors.InvalidArgument):
        retention.set_minimum_intervals(0, 1)


# -- prune to fit --------------------------------------------------------------------------------------------
def sized(name: str, minute: int, mib: int, prunable: bool = True) -> retention.Sized:
    return retention.Sized(name, T0 + timedelta(minutes=minute), mib * MiB, prunable)


def test_prune_to_fit_takes_the_oldest_prunable_first_and_only_what_is_needed() -> None:
    snaps = [sized("user", 0, 500, prunable=False), sized("a", 1, 10), sized("b", 2, 10), sized("c", 3, 10)]
    assert retention.plan_prune_to_fit(snaps, 15 * MiB) == ["a", "b"]
    assert retention.plan_prune_to_fit(snaps, 0) == []
    # Even every prunable one would not free enough: nothing is pruned (history is not lost for nothing).
    assert retention.plan_prune_to_fit(snaps, 31 * MiB) is None


def test_count_cap_drops_the_oldest_prunable() -> None:
    snaps = [sized("user", 0, 1, prunable=False), *(sized(f"p{i}", i + 1, 1) for i in range(5))]
    assert retention.over_count(snaps, 3) == ["p0", "p1"]
    assert retention.over_count(snaps, 10) == []


# -- the node agent over the fake driver ---------------------------------------------------------------------
def snapshot_dirs(tmp_path: pathlib.Path, sandbox_id: str) -> list[str]:
    root = tmp_path / "snapshots" / sandbox_id
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_snapshots_stop_at_the_storage_budget(
    loop: BackgroundLoop, agent: NodeAgent, tmp_path: pathlib.Path
) -> None:
    # The fake keeps whole copies: each snapshot adds the sandbox's 20 MiB again.
    handle = loop.run(agent.create(limits=SandboxLimits(storage_mb=64)))
    loop.run(handle.session.write_file("blob", b"x" * (20 * MiB)))
    loop.run(agent.disk_snapshot(handle.sandbox_id))
    loop.run(agent.disk_snapshot(handle.sandbox_id))  # 60 MiB kept: still within 64
    before = snapshot_dirs(tmp_path, handle.sandbox_id)
    with pytest.raises(errors.StorageExhausted) as caught:
        loop.run(agent.disk_snapshot(handle.sandbox_id))
    details = caught.value.details
    assert details["reason"] == "storage_budget" and details["budget_bytes"] == 64 * MiB
    assert details["used_bytes"] > 64 * MiB
    # The snapshot that went over is gone again, from the node and from the agent's records.
    assert snapshot_dirs(tmp_path, handle.sandbox_id) == before
    assert sorted(handle.snapshots) == before
    assert handle.state == State.RUNNING
    usage = loop.run(agent.storage(handle.sandbox_id))
    assert usage["used_bytes"] <= usage["budget_bytes"]
    # Deleting history makes room again.
    loop.run(agent.delete_snapshot(handle.sandbox_id, before[0]))
    loop.run(agent.disk_snapshot(handle.sandbox_id))


def test_a_sandbox_already_over_its_budget_is_refused_before_anything_is_made(
    loop: BackgroundLoop, agent: NodeAgent, tmp_path: pathlib.Path
) -> None:
    handle = loop.run(agent.create(limits=SandboxLimits(storage_mb=64)))
    loop.run(handle.session.write_file("blob", b"x" * (70 * MiB)))
    for take in (agent.disk_snapshot, agent.checkpoint):
        with pytest.raises(errors.StorageExhausted) as caught:
            loop.run(take(handle.sandbox_id))
        assert caught.value.details["used_bytes"] >= 70 * MiB
    assert snapshot_dirs(tmp_path, handle.sandbox_id) == [] and handle.snapshots == {}
    assert handle.state == State.RUNNING


def test_below_the_reserve_creates_and_checkpoints_are_refused(
    loop: BackgroundLoop, agent: NodeAgent, tmp_path: pathlib.Path
) -> None:
    assert isinstance(agent.driver, FakeDriver)
    handle = loop.run(agent.create(limits=SandboxLimits(memory_mb=64)))
    agent.driver.disk_override = (10 * GiB, GiB // 2 - 1)  # 5 % of 10 GiB is the reserve: 1 byte short
    with pytest.raises(errors.StorageExhausted) as caught:
        loop.run(agent.create())
    assert caught.value.details["reason"] == "node_reserve"
    assert "free" in caught.value.message and "reserve" in caught.value.message
    assert list(agent.sandboxes) == [handle.sandbox_id]
    assert sorted(p.name for p in (tmp_path / "sandboxes").iterdir()) == [handle.sandbox_id]
    for take in (agent.checkpoint, agent.disk_snapshot):
        with pytest.raises(errors.StorageExhausted):
            loop.run(take(handle.sandbox_id))
    with pytest.raises(errors.StorageExhausted):
        loop.run(agent.fork(handle.sandbox_id))
    assert snapshot_dirs(tmp_path, handle.sandbox_id) == [] and handle.state == State.RUNNING
    # A checkpoint's image must fit above the reserve too (estimated from the memory limit at first).
    agent.driver.disk_override = (10 * GiB, GiB // 2 + 32 * MiB)
    with pytest.raises(errors.StorageExhausted) as caught:
        loop.run(agent.checkpoint(handle.sandbox_id))
    assert caught.value.details["needed_bytes"] == 64 * MiB
    agent.driver.disk_override = (10 * GiB, 4 * GiB)
    loop.run(agent.checkpoint(handle.sandbox_id))
    measured = loop.run(agent.disk_space())
    assert measured == {"total_bytes": 10 * GiB, "free_bytes": 4 * GiB, "reserve_bytes": GiB // 2}


# -- scheduler admission -------------------------------------------------------------------------------------
def node(node_id: str, *, disk_mb: int | None, free_mb: int | None = None, reserve_mb: int = 0) -> NodeRecord:
    capacity: dict[str, Any] = {"cpus": 8.0, "memory_mb": 65536, "sandboxes": 1000}
    if disk_mb is not None:
        capacity.update(disk_mb=disk_mb, disk_free_mb=free_mb if free_mb is not None else disk_mb,
                        disk_reserve_mb=reserve_mb)  # fmt: skip
    return NodeRecord(node_id, f"http://{node_id}.test", capacity, {}, ["python"], {}, "ready", T0, T0)


def sandbox(sandbox_id: str, disk_mb: int, state: State = State.RUNNING) -> Any:
    return SimpleNamespace(id=sandbox_id, template="python", state=state, isolation="gvisor",
                           limits=SandboxLimits(cpus=0.1, memory_mb=64, disk_mb=disk_mb))  # fmt: skip


@dataclass
class FakeStore:
    nodes: list[NodeRecord]
    placed: dict[str, list[Any]] = field(default_factory=dict)

    def list_nodes(self, status: str | None) -> list[NodeRecord]:
        return [n for n in self.nodes if status is None or n.status == status]

    def placed_disk_mb(self, node_id: str, *, besides: str | None = None) -> int:
        return sum(sb.limits.disk_mb for sb in self.placed.get(node_id, []) if sb.id != besides)


def test_the_scheduler_counts_placed_disk_and_the_reserve() -> None:
    store = FakeStore([node("n1", disk_mb=10_000, reserve_mb=500)])
    store.placed["n1"] = [sandbox("sb-a", 4000), sandbox("sb-b", 4000)]
    assert scheduler.choose_node(store, sandbox("sb-new", 1500)) == "n1"  # type: ignore[arg-type]
    with pytest.raises(errors.ResourceExhausted):  # 8000 + 1501 + 500 > 10000
        scheduler.choose_node(store, sandbox("sb-new", 1501))  # type: ignore[arg-type]
    # The sandbox being placed again (after a node loss, say) is not counted twice.
    store.placed["n1"].append(sandbox("sb-new", 1500))
    assert scheduler.choose_node(store, sandbox("sb-new", 1500)) == "n1"  # type: ignore[arg-type]


def test_the_scheduler_prefers_a_node_with_room_and_skips_one_below_its_reserve() -> None:
    store = FakeStore([node("full", disk_mb=100_000, free_mb=100, reserve_mb=200), node("ok", disk_mb=5000)])
    assert scheduler.choose_node(store, sandbox("sb-x", 1000)) == "ok"  # type: ignore[arg-type]
    # A node that reports no disk (an older agent) is not judged on disk.
    legacy = FakeStore([node("old", disk_mb=None)])
    assert scheduler.choose_node(legacy, sandbox("sb-x", 1_000_000)) == "old"  # type: ignore[arg-type]


def test_a_disk_no_node_can_hold_is_refused_at_once() -> None:
    store = FakeStore(
        [node("n1", disk_mb=10_000, reserve_mb=500), node("n2", disk_mb=20_000, reserve_mb=1000)]
    )
    scheduler.check_admissible(store, SandboxLimits(disk_mb=19_000))  # type: ignore[arg-type]
    with pytest.raises(errors.StorageExhausted) as caught:
        scheduler.check_admissible(store, SandboxLimits(disk_mb=19_001))  # type: ignore[arg-type]
    assert caught.value.details["largest_node_disk_mb"] == 19_000
    assert "more than any node can hold" in caught.value.message
    scheduler.check_admissible(FakeStore([]), SandboxLimits(disk_mb=1_000_000))  # type: ignore[arg-type]


# -- the CLI -------------------------------------------------------------------------------------------------
def test_cli_passes_the_storage_budget(cli_server: Any) -> None:
    import httpx

    cli_server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-new")))
    result = invoke("sandbox", "create", "--disk-mb", "512", "--storage-mb", "2048", "--json")
    assert result.exit_code == 0, result.output
    assert cli_server.body()["limits"] == {"disk_mb": 512, "storage_mb": 2048}


# -- the helper verbs refuse bad arguments before touching anything ------------------------------------------
def test_storage_verbs_validate_their_arguments(tmp_path: pathlib.Path) -> None:
    import os

    from space.core.ids import new_sandbox_id
    from space.node.helper.context import HelperContext
    from space.node.helper.runsc import Runsc
    from space.node.helper.server import dispatch
    from space.node.layout import NodeLayout

    layout = NodeLayout(tmp_path / "data")
    layout.data_dir.mkdir()
    ctx = HelperContext(layout=layout, runsc=Runsc(root=layout.runsc_root, binary="/nonexistent/runsc"),
                        owner_uid=os.getuid())  # fmt: skip

    def answer(verb: str, args: dict[str, Any]) -> dict[str, Any]:
        result = dispatch(ctx, {"verb": verb, "args": args}, print)
        assert result["ok"] is False, result
        error = result["error"]
        assert isinstance(error, dict)
        return error

    for bad in ("../sb-x", "sb-../../etc", "", 42, None):
        assert answer("sandbox.storage", {"sandbox_id": bad})["code"] == "invalid_argument"
    good = new_sandbox_id()
    assert answer("sandbox.storage", {"sandbox_id": good, "sync": "yes"})["code"] == "invalid_argument"
    assert answer("sandbox.storage", {"sandbox_id": good, "path": "/"})["code"] == "invalid_argument"
    assert answer("node.disk", {"path": "/etc"})["code"] == "invalid_argument"
    # A valid id of a sandbox the node does not hold: a typed not_found, and nothing was created for it.
    assert answer("sandbox.storage", {"sandbox_id": good})["code"] == "not_found"
    assert not (layout.snapshots_root / good).exists()


def test_the_agent_caps_the_number_of_snapshots(
    loop: BackgroundLoop, agent: NodeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "MAX_SNAPSHOTS_PER_SANDBOX", 2)
    handle = loop.run(agent.create())
    loop.run(agent.disk_snapshot(handle.sandbox_id))
    loop.run(agent.checkpoint(handle.sandbox_id))
    with pytest.raises(errors.StorageExhausted) as caught:
        loop.run(agent.disk_snapshot(handle.sandbox_id))
    assert caught.value.details["reason"] == "snapshot_count" and len(handle.snapshots) == 2


def test_imports_are_refused_below_the_reserve_and_suspend_is_not(
    loop: BackgroundLoop, tmp_path: pathlib.Path
) -> None:
    from space.core.ids import new_snapshot_id
    from space.node.drivers.base import SandboxSpec
    from space.objectstore.backends import open_store

    store = open_store((tmp_path / "objects").as_uri())
    a = NodeAgent(FakeDriver(tmp_path / "a"), store=store)
    b = NodeAgent(FakeDriver(tmp_path / "b"), store=store)
    loop.run(a.prepare(templates=()))
    loop.run(b.prepare(templates=()))
    try:
        handle = loop.run(a.create(limits=SandboxLimits(memory_mb=64)))
        sid = handle.sandbox_id
        loop.run(handle.session.write_file("kept.bin", b"x" * 100_000))
        assert isinstance(a.driver, FakeDriver) and isinstance(b.driver, FakeDriver)
        # Suspend is how a full node gets its disk back: never refused for the reserve.
        a.driver.disk_override = (10 * GiB, 0)
        loop.run(a.suspend(sid, store=store, prefix=f"sandboxes/{sid}/s1", snapshot_id=new_snapshot_id(),
                           data_key=None))  # fmt: skip
        b.driver.disk_override = (10 * GiB, GiB // 2)  # just at the reserve: no room for the download
        spec = SandboxSpec(sid, limits=SandboxLimits(memory_mb=64))
        with pytest.raises(errors.StorageExhausted) as caught:
            loop.run(b.restore_from_store(sid, store=store, prefix=f"sandboxes/{sid}/s1", data_key=None,
                                          spec=spec))  # fmt: skip
        assert caught.value.details["reason"] == "node_reserve" and caught.value.details["needed_bytes"] > 0
        assert sid not in b.sandboxes
        staging = tmp_path / "b" / "staging"
        assert not staging.exists() or list(staging.iterdir()) == []
        assert not (tmp_path / "b" / "sandboxes" / sid).exists()
        b.driver.disk_override = None
        prefix = f"sandboxes/{sid}/s1"
        restored = loop.run(b.restore_from_store(sid, store=store, prefix=prefix, data_key=None, spec=spec))
        assert loop.run(restored.session.read_file("kept.bin")) == b"x" * 100_000
    finally:
        for node in (a, b):
            loop.run(node.delete_all())
            loop.run(node.close())


def test_the_node_agent_takes_its_reserve_from_the_command_line(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from space.node.agent import launch

    seen: dict[str, Any] = {}

    async def fake_serve(*_args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(launch, "serve", fake_serve)
    launch.main(["--data-dir", str(tmp_path), "--driver", "fake", "--disk-reserve", "1,100"])
    assert seen["disk_reserve"] == DiskReserve(percent=1.0, mb=100)
    for bad in ("60,1", "5", "x,1", "5,-1"):
        with pytest.raises(SystemExit) as caught:
            launch.main(["--data-dir", str(tmp_path), "--disk-reserve", bad])
        assert caught.value.code == 2
