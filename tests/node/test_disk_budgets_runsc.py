"""Disk bounds on real gVisor sandboxes and real btrfs (issue 9, item 6; ADR 0027).

- A sandbox that writes and snapshots again and again hits its storage budget with StorageExhausted naming
  used and budget bytes; a refused snapshot leaves no subvolume behind; data pinned by snapshots still
  counts after the files are deleted and after a rollback (a new root filesystem with a fresh qgroup must
  not reset the count); checkpoint images count too.
- A node whose filesystem is nearly full (a small loop image, filled from the host) refuses checkpoints,
  disk snapshots and creates with the reserve error, and nothing half-made is left: no subvolume, no image
  directory, no record, the sandbox keeps running. Once space is freed, the same checkpoint works.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent.agent import NodeAgent
from space.node.local import LocalNode
from space.node.volumes import btrfs, filesystem
from tests.support.loop import BackgroundLoop
from tests.support.realnode import RealNode, assert_no_leaks, make_data_dir, require_root, sandbox_ids_in
from tests.support.sandboxes import eventually, new_sandbox

pytestmark = pytest.mark.root

MiB = 1 << 20


def subvolumes_of(fs: pathlib.Path, sandbox_id: str) -> list[str]:
    out = subprocess.run(["btrfs", "subvolume", "list", str(fs)], capture_output=True, text=True, check=True)
    return sorted(line.split(" path ", 1)[-1] for line in out.stdout.splitlines() if sandbox_id in line)


async def write_random(agent: NodeAgent, sandbox_id: str, name: str, mib: int) -> None:
    result = await agent.get(sandbox_id).session.exec(
        f"head -c {mib * MiB} /dev/urandom > /work/{name}", timeout=120
    )
    assert result.exit_code == 0, result.stderr


def test_writes_and_snapshots_hit_the_storage_budget(node: RealNode) -> None:
    agent = node.agent
    fs = node.node.layout.fs

    async def scenario() -> None:
        limits = SandboxLimits(memory_mb=128, disk_mb=512, storage_mb=100)
        async with new_sandbox(agent, limits=limits) as handle:
            sid = handle.sandbox_id
            taken: list[str] = []
            refusal: errors.StorageExhausted | None = None
            for i in range(6):
                await write_random(agent, sid, f"blob{i}", 30)
                try:
                    taken.append((await agent.disk_snapshot(sid)).snapshot_id)
                except errors.StorageExhausted as exc:
                    refusal = exc
                    break
                usage = await agent.storage(sid)
                assert usage["used_bytes"] <= usage["budget_bytes"] == 100 * MiB, usage
                assert usage["files_bytes"] >= 30 * (i + 1) * MiB, usage  # the template is not charged
            # 30, 60, 90 MiB fit in 100; the fourth 30 MiB does not.
            assert len(taken) == 3 and refusal is not None, (taken, refusal)
            details = refusal.details
            assert details["reason"] == "storage_budget" and details["budget_bytes"] == 100 * MiB
            assert 120 * MiB <= details["used_bytes"] < 130 * MiB, details
            assert "storage budget" in refusal.message
            assert sorted(handle.snapshots) == sorted(taken)
            on_disk = subvolumes_of(fs, sid)
            assert len([p for p in on_disk if p.startswith("snapshots/")]) == 3, on_disk

            # Deleting the files frees only what no snapshot pins: the 90 MiB the snapshots hold still count.
            # (The unlinked file is freed once the runtime lets go of it and btrfs commits: a moment later.)
            result = await handle.session.exec("rm -f /work/blob*")
            assert result.exit_code == 0

            async def only_pinned_left() -> bool:
                usage = await agent.storage(sid)
                assert usage["used_bytes"] >= 90 * MiB, usage
                return bool(usage["used_bytes"] < 100 * MiB)

            await eventually(only_pinned_left, timeout=60, interval=0.5, what="the unpinned file freed")

            # A rollback gives the sandbox a new root filesystem (a fresh qgroup); the old one's data, still
            # pinned by the snapshots, keeps counting: writing 30 MiB more goes over again.
            await agent.rollback(sid, taken[0])
            assert handle.state == State.RUNNING
            usage = await agent.storage(sid)
            assert usage["used_bytes"] >= 90 * MiB, usage
            await write_random(agent, sid, "after-rollback", 30)
            with pytest.raises(errors.StorageExhausted):
                await agent.disk_snapshot(sid)

            # Make room: the snapshots and the files go (the cleaner frees them a moment later), then a full
            # checkpoint's image counts against the budget.
            for snapshot_id in taken:
                await agent.delete_snapshot(sid, snapshot_id)
            # blob0 now lives only in the new root filesystem but stays charged to the old one's qgroup, which
            # no snapshot names any more: the sandbox's lineage still counts it (30 + 30 MiB written).
            usage = await agent.storage(sid)
            assert usage["used_bytes"] >= 60 * MiB, usage
            assert (await handle.session.exec("rm -f /work/blob0 /work/after-rollback")).exit_code == 0

            async def freed() -> bool:
                return bool((await agent.storage(sid))["used_bytes"] < 10 * MiB)

            await eventually(freed, timeout=60, interval=0.5, what="deleted snapshots freed")
            record = await agent.checkpoint(sid)
            usage = await agent.storage(sid)
            assert usage["images_bytes"] > 0 and record.image_bytes > 0, usage
            assert usage["used_bytes"] == usage["files_bytes"] + usage["images_bytes"] <= 100 * MiB
            result = await handle.session.exec("echo alive")
            assert result.stdout == b"alive\n"

    node.run(scenario(), timeout=600)


# -- a nearly full node --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_node(loop: BackgroundLoop) -> Iterator[tuple[LocalNode, NodeAgent]]:
    """A node on a 2 GiB loop image (made before the helper starts, which then mounts it as it is)."""
    require_root()
    data_dir = make_data_dir("smalldisk")
    filesystem.ensure_btrfs(data_dir, image_size_gb=2)
    local = LocalNode(data_dir, network="none")
    agent: NodeAgent | None = None
    try:
        agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
        yield local, agent
    finally:
        ids = sandbox_ids_in(data_dir) | (set(agent.sandboxes) if agent is not None else set())
        if agent is not None:
            loop.run(agent.delete_all(), timeout=300)
        loop.run(local.stop(purge=True), timeout=300)
        assert_no_leaks(data_dir, ids)


def fill_until_below_reserve(agent: NodeAgent, loop: BackgroundLoop, fs: pathlib.Path) -> list[pathlib.Path]:
    """Allocate files in the node's filesystem (from the host, as root) until its free space is about half
    its reserve; returns the files."""
    fillers: list[pathlib.Path] = []
    for i in range(8):
        measured = loop.run(agent.disk_space())
        assert measured is not None
        free, reserve = measured["free_bytes"], measured["reserve_bytes"]
        if free < reserve:
            return fillers
        filler = fs / f"filler-{i}"
        size = max(MiB, free - reserve // 2)
        subprocess.run(["fallocate", "-l", str(size), str(filler)], check=False, capture_output=True)
        fillers.append(filler)
        btrfs.sync(fs)
    raise AssertionError(f"could not bring the free space below the reserve: {loop.run(agent.disk_space())}")


def test_a_nearly_full_node_refuses_with_the_reserve_error_and_leaves_nothing(
    small_node: tuple[LocalNode, NodeAgent], loop: BackgroundLoop
) -> None:
    local, agent = small_node
    layout = local.layout
    limits = SandboxLimits(memory_mb=128, disk_mb=256)
    handle = loop.run(agent.create(limits=limits))
    sid = handle.sandbox_id
    fillers: list[pathlib.Path] = []
    try:
        before = subvolumes_of(layout.fs, sid)
        fillers = fill_until_below_reserve(agent, loop, layout.fs)
        with pytest.raises(errors.StorageExhausted) as caught:
            loop.run(agent.checkpoint(sid))
        details = caught.value.details
        assert details["reason"] == "node_reserve", details
        assert details["free_bytes"] < details["reserve_bytes"], details
        assert "free" in caught.value.message and "in reserve" in caught.value.message
        with pytest.raises(errors.StorageExhausted):
            loop.run(agent.disk_snapshot(sid))
        sandboxes_before = sorted(p.name for p in layout.sandboxes.iterdir())
        with pytest.raises(errors.StorageExhausted):
            loop.run(agent.create(limits=limits))
        # Nothing half-made: no subvolume, no image directory, no record, no new sandbox; it keeps running.
        assert subvolumes_of(layout.fs, sid) == before
        images = layout.checkpoints_root / sid
        assert not images.exists() or list(images.iterdir()) == []
        assert handle.snapshots == {} and handle.state == State.RUNNING
        assert sorted(p.name for p in layout.sandboxes.iterdir()) == sandboxes_before
        assert list(agent.sandboxes) == [sid]
        assert loop.run(handle.session.exec("echo alive")).stdout == b"alive\n"
        # Space freed: the same checkpoint works.
        for filler in fillers:
            filler.unlink()
        fillers = []
        btrfs.sync(layout.fs)
        record = loop.run(agent.checkpoint(sid))
        assert record.snapshot_id in handle.snapshots
    finally:
        for filler in fillers:
            with contextlib.suppress(OSError):
                os.unlink(filler)
        loop.run(agent.delete(sid), timeout=120)


def test_a_checkpoint_that_runs_out_of_disk_half_way_leaves_nothing(
    small_node: tuple[LocalNode, NodeAgent], loop: BackgroundLoop
) -> None:
    """Past the agent's checks (the driver is called directly, as a racing writer could make it happen): the
    disk fills up while runsc writes the image; the helper removes the partial checkpoint, and the sandbox
    runs on."""
    local, agent = small_node
    layout = local.layout
    handle = loop.run(agent.create(limits=SandboxLimits(memory_mb=256, disk_mb=256)))
    sid = handle.sandbox_id
    fillers: list[pathlib.Path] = []
    try:
        # Leave (almost) no space at all: even a small image cannot be written.
        before = subvolumes_of(layout.fs, sid)
        for i in range(16):
            measured = loop.run(agent.disk_space())
            assert measured is not None
            if measured["free_bytes"] < 4 * MiB:
                break
            filler = layout.fs / f"full-{i}"
            size = max(MiB, measured["free_bytes"] - MiB) if i < 8 else measured["free_bytes"] // 2
            subprocess.run(["fallocate", "-l", str(size), str(filler)], check=False, capture_output=True)
            fillers.append(filler)
            btrfs.sync(layout.fs)
        else:
            raise AssertionError(f"could not fill the filesystem: {loop.run(agent.disk_space())}")
        snapshot_id = "snap-" + "a" * 26
        with pytest.raises(errors.SpaceError):
            loop.run(agent.driver.checkpoint(sid, snapshot_id, keep_running=True))
        images = layout.checkpoints_root / sid
        assert not images.exists() or list(images.iterdir()) == [], "a partial image was left behind"
        assert subvolumes_of(layout.fs, sid) == before, "a partial disk snapshot was left behind"
        for filler in fillers:
            filler.unlink()
        fillers = []
        btrfs.sync(layout.fs)
        assert loop.run(handle.session.exec("echo alive")).stdout == b"alive\n"
    finally:
        for filler in fillers:
            with contextlib.suppress(OSError):
                os.unlink(filler)
        loop.run(agent.delete(sid), timeout=120)
