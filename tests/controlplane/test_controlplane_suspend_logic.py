"""The control plane's suspend / restore / crash-recovery / retention logic, in process and fast.

The database (SQLite, migrated), the object store (a local directory), the artifacts (written by
space.objectstore.artifacts, manifests read back) and the key service (LocalKeyService) are real. Only the
nodes are stand-ins: `FakeNodeApi` implements the node RPC contract of issue 4 in memory (suspend writes a
real artifact with the data key it is given, restore verifies every part with the key it is given).

Crash injection: a node call can be made to raise `Killed` (a BaseException, like the SIGKILL of the control
plane) after its side effect happened, so nothing after it in the step ran; the test then runs the
reconciler again (a restarted control plane) and checks that it converges: suspended with a verified
snapshot or running, on exactly one node, no orphans, no stray objects.
The same scenarios run for real (subprocesses, SIGKILL) in tests/controlplane/test_controlplane_suspend.py.
"""

from __future__ import annotations

import asyncio
import base64
import pathlib
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from space.controlplane import failpoints
from space.controlplane.snapshots import report_lost_node_crashes
from space.controlplane.store.records import SandboxRecord
from space.core import errors, retention
from space.core.ids import new_snapshot_id
from space.core.lifecycle import State
from space.objectstore.artifacts import read_manifest
from tests.support.reconciler_world import Killed, World


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[World]:
    made = World(tmp_path)
    try:
        yield made
    finally:
        made.close()


def suspend(world: World, sb: SandboxRecord) -> None:
    world.store.set_desired(sb.id, State.SUSPENDED)


def assert_suspended_and_verified(world: World, sandbox_id: str) -> SandboxRecord:
    sb = world.store.load_sandbox(sandbox_id)
    assert sb is not None
    assert sb.state == State.SUSPENDED, (sb.state, sb.error)
    assert sb.node_id is None
    assert world.copies(sb.id) == {}, "a suspended sandbox is on no node"
    assert sb.suspended_snapshot_id is not None and sb.suspended_prefix is not None
    snap = world.store.get_snapshot(sb.suspended_snapshot_id)
    assert snap is not None and snap.restorable and snap.prefix == sb.suspended_prefix
    assert snap.data_key_id and snap.data_key_id.startswith("local:") and snap.wrapped_key
    manifest = read_manifest(world.objects, snap.prefix)
    assert manifest.encryption is not None, "what leaves the node is encrypted"
    # Only that artifact is stored for this sandbox (a retried upload did not leave a second one).
    assert {k.split("/")[3] for k in world.objects_of(sb)} == {snap.id}
    return sb


def test_suspend_then_restore_on_any_node(world: World) -> None:
    sb = world.running_sandbox({"a.txt": b"hello", "b.bin": bytes(range(256)) * 100})
    suspend(world, sb)
    assert_suspended_and_verified(world, world.run(sb.id).id)
    # The source node is down: restore goes to the other one.
    assert sb.node_id is not None
    world.pool.nodes.pop(sb.node_id)
    world.store.set_node_status(sb.node_id, "lost")
    world.store.set_desired(sb.id, State.RUNNING)
    restored = world.run(sb.id)
    assert restored.state == State.RUNNING and restored.node_id not in (None, sb.node_id)
    files = world.api[restored.node_id].sandboxes[sb.id]["files"]
    assert files == {"a.txt": b"hello", "b.bin": bytes(range(256)) * 100}
    assert restored.suspended_snapshot_id is None


@pytest.mark.parametrize("point", ["suspend", "delete_sandbox"])
def test_control_plane_killed_during_suspend_converges(world: World, point: str) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    world.api[sb.node_id].kill_after.add(point)  # type: ignore[index]
    with pytest.raises(Killed):
        world.run(sb.id)
    mid = world.store.load_sandbox(sb.id)
    # Killed after the node's copy was asked to go: the record already says suspended (the copy is an
    # orphan now); killed in the node's suspend: still suspending.
    expected = State.SUSPENDED if point == "delete_sandbox" else State.SUSPENDING
    assert mid is not None and mid.state == expected
    assert mid.suspended_snapshot_id is not None, "snapshot id recorded before the node call"
    world.run(sb.id)  # the restarted control plane
    world.collect_orphans()
    assert_suspended_and_verified(world, sb.id)
    assert mid.suspended_snapshot_id == world.store.load_sandbox(sb.id).suspended_snapshot_id  # type: ignore[union-attr]


def test_killed_after_the_snapshot_row_before_the_node_call(world: World) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    world.api[sb.node_id].fail["suspend"] = errors.Unavailable("node restarting")  # type: ignore[index]
    failed = world.run(sb.id, rounds=1)
    assert failed.state == State.SUSPENDING and failed.error and "node restarting" in failed.error
    snap = world.store.get_snapshot(failed.suspended_snapshot_id)  # type: ignore[arg-type]
    assert snap is not None and not snap.restorable and snap.wrapped_key
    world.run(sb.id)
    after = assert_suspended_and_verified(world, sb.id)
    assert after.suspended_snapshot_id == snap.id
    # The retry used the same data key (recorded before the first call).
    assert world.store.get_snapshot(snap.id).wrapped_key == snap.wrapped_key  # type: ignore[union-attr]


def test_killed_during_restore_converges_and_never_runs_twice(world: World) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    world.run(sb.id)
    world.store.set_desired(sb.id, State.RUNNING)
    for api in world.api.values():
        api.kill_after.add("restore")
    with pytest.raises(Killed):
        world.run(sb.id)
    mid = world.store.load_sandbox(sb.id)
    assert mid is not None and mid.state == State.RESTORING and mid.node_id is not None
    world.run(sb.id)
    done = world.store.load_sandbox(sb.id)
    assert done is not None and done.state == State.RUNNING
    assert world.copies(sb.id) == {done.node_id: "running"}


def test_corrupt_artifact_fails_back_to_suspended_with_the_error(world: World) -> None:
    sb = world.running_sandbox({"a.txt": b"x" * 5000})
    suspend(world, sb)
    sb = world.run(sb.id)
    part = next(k for k in world.objects_of(sb) if "/parts/" in k)
    data = bytearray(world.objects.get(part))
    data[len(data) // 2] ^= 0x01
    world.objects.put(part, bytes(data))
    world.store.set_desired(sb.id, State.RUNNING)
    failed = world.run(sb.id)
    assert failed.state == State.SUSPENDED and failed.node_id is None
    assert failed.error_permanent and failed.error and failed.error.startswith("artifact_corrupt")
    assert world.copies(sb.id) == {}, "nothing booted from a corrupt artifact"


def test_revoked_key_fails_restore_with_its_message(world: World) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    sb = world.run(sb.id)
    service, key_id = world.keys.org_key(world.org_id)
    world.keys.services[service].revoke_key(key_id)
    world.store.set_desired(sb.id, State.RUNNING)
    failed = world.run(sb.id)
    assert failed.state == State.SUSPENDED and failed.error and failed.error.startswith("key_revoked")


def test_deleting_a_suspended_sandbox_removes_its_objects(world: World) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    sb = world.run(sb.id)
    assert world.objects_of(sb)
    world.store.set_desired(sb.id, State.DELETED)
    world.run(sb.id)
    asyncio.run(world.keeper.collect())
    assert world.objects_of(sb) == []
    assert world.store.list_snapshots(sb.id, include_deleting=True) == []


def test_crash_recovers_from_the_local_checkpoint(world: World) -> None:
    sb = world.running_sandbox({"f": b"v1"})
    snap = asyncio.run(world.keeper.take(sb, full=True, origin="user"))
    world.api[sb.node_id].sandboxes[sb.id]["files"] = {"f": b"v2 (lost with the crash)"}  # type: ignore[index]
    world.api[sb.node_id].sandboxes[sb.id]["state"] = "crashed"  # type: ignore[index]
    assert world.store.report_crash(sb.id, sb.node_id, notice="runtime died") is not None
    recovered = world.run(sb.id)
    assert recovered.state == State.RUNNING and recovered.node_id == sb.node_id
    assert recovered.recovered_from == snap.id and recovered.recovered_at is not None
    assert recovered.crash_count == 1 and recovered.notice and "same node" in recovered.notice
    assert world.api[sb.node_id].calls[-1] == "recover"  # type: ignore[index]
    assert world.api[sb.node_id].sandboxes[sb.id]["files"] == {"f": b"v1"}  # type: ignore[index]


def test_a_stale_crash_report_does_not_undo_a_recovery(world: World) -> None:
    sb = world.running_sandbox()
    before = world.store.now() - timedelta(seconds=5)
    assert world.store.report_crash(sb.id, sb.node_id, notice="late", observed_at=before) is None
    assert world.store.load_sandbox(sb.id).state == State.RUNNING  # type: ignore[union-attr]


def test_crash_without_checkpoint_restarts_on_the_kept_disk(world: World) -> None:
    sb = world.running_sandbox()
    world.store.report_crash(sb.id, sb.node_id, notice="runtime died")
    after = world.run(sb.id)
    assert after.state == State.RUNNING and after.node_id == sb.node_id
    assert after.notice and "no usable checkpoint" in after.notice


def test_lost_node_sandboxes_with_an_uploaded_checkpoint_move(world: World) -> None:
    moving = world.running_sandbox({"f": b"uploaded state"})
    staying = world.running_sandbox()
    # Both sandboxes land on the node with most free memory; make sure they share one node.
    assert moving.node_id == staying.node_id
    snap = asyncio.run(world.keeper.take(moving, full=True))
    snap = asyncio.run(world.keeper.upload(moving, snap))
    assert snap.restorable and snap.uploaded_at is not None
    lost = moving.node_id
    assert lost is not None
    world.pool.nodes.pop(lost)  # hung: unreachable
    world.store.set_node_status(lost, "lost")
    crashed = asyncio.run(report_lost_node_crashes(world.reconciler))
    assert crashed == [moving.id], "only sandboxes with an uploaded checkpoint are moved"
    moved = world.run(moving.id)
    assert moved.state == State.RUNNING and moved.node_id not in (None, lost)
    assert moved.recovered_from == snap.id and moved.notice and "object storage" in moved.notice
    assert moved.node_id is not None
    assert world.api[moved.node_id].sandboxes[moving.id]["files"] == {"f": b"uploaded state"}
    # The node comes back: its stale copy is collected; the one without a checkpoint stays there.
    world.pool.nodes[lost] = world.api[lost]
    world.store.heartbeat(lost, used={})
    world.collect_orphans()
    assert world.copies(moving.id) == {moved.node_id: "running"}, "never running twice"
    assert world.copies(staying.id) == {lost: "running"}
    assert world.store.load_sandbox(staying.id).state == State.RUNNING  # type: ignore[union-attr]


def test_policy_takes_uploads_and_prunes(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # One disk snapshot a second (the production minimum is 60 s, ADR 0027).
    monkeypatch.setattr(retention, "_minimums", retention.MinimumIntervals(disk_s=1, full_s=1))
    sb = world.running_sandbox()
    policy = {
        "disk_every_s": 1, "full_every_s": 3600, "upload_full": True,
        "tiers": [{"every_s": 3600, "for_s": 7200}],
    }  # fmt: skip
    world.store.update_observed(sb.id, snapshot_policy=policy)
    assert asyncio.run(world.keeper.run_policies()) == 1  # the full checkpoint first (never taken yet)
    snaps = world.store.list_snapshots(sb.id)
    assert [(s.kind, s.restorable, s.origin) for s in snaps] == [("full", True, "policy")]
    user = asyncio.run(world.keeper.take(sb, full=False, origin="user"))
    for _ in range(3):
        # Pretend a second passed (the clock of the store is real): move the last disk snapshot back.
        asyncio.run(world.keeper.run_policies())
        time.sleep(1.05)
    asyncio.run(world.keeper.run_policies())
    asyncio.run(world.keeper.collect())
    snaps = world.store.list_snapshots(sb.id, include_deleting=True)
    policy_disk = [s for s in snaps if s.kind == "disk" and s.origin == "policy"]
    # One-hour buckets: only the newest scheduled disk snapshot survives; the user's and the checkpoint stay.
    assert len(policy_disk) == 1
    assert user.id in {s.id for s in snaps}
    assert any(s.kind == "full" and s.restorable for s in snaps)
    on_node = world.api[sb.node_id].sandboxes[sb.id]["snapshots"]  # type: ignore[index]
    assert set(on_node) == {s.id for s in snaps}, "pruned snapshots are gone from the node too"


def test_suspend_requires_an_object_store(world: World) -> None:
    world.reconciler.objects = None
    world.reconciler.store_url = None
    sb = world.running_sandbox()
    suspend(world, sb)
    after = world.run(sb.id)
    # The step gave up for good (no store will appear by retrying) and left the sandbox paused.
    assert after.state == State.PAUSED and after.error_permanent
    assert after.error and "object store" in after.error


def test_data_key_is_per_org_and_survives_rotation(world: World) -> None:
    sb = world.running_sandbox()
    first = world.keys.for_sandbox(sb)
    second = world.keys.for_sandbox(sb)
    assert first is not None and second is not None
    assert first.key_id == second.key_id and first.plaintext != second.plaintext
    service, key_id = world.keys.org_key(world.org_id)
    world.keys.services[service].rotate_key(key_id)
    assert world.keys.unwrap(sb, first.key_id, first.wrapped) == first.plaintext
    assert base64.b64encode(first.wrapped)


def test_a_key_revoked_after_the_verified_upload_does_not_strand_the_suspend(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)

    def die_after_verification(name: str) -> None:
        if name == "suspend.verified":
            raise Killed(name)

    monkeypatch.setattr(failpoints, "hit", die_after_verification)
    with pytest.raises(Killed):
        world.run(sb.id)
    monkeypatch.undo()
    assert world.store.load_sandbox(sb.id).state == State.SUSPENDING  # type: ignore[union-attr]
    service, key_id = world.keys.org_key(world.org_id)
    world.keys.services[service].revoke_key(key_id)
    world.run(sb.id)  # the upload is verified: finishing needs no key
    assert world.store.load_sandbox(sb.id).state == State.SUSPENDED  # type: ignore[union-attr]
    assert world.copies(sb.id) == {}


def test_a_new_suspend_supersedes_the_previous_artifact(world: World) -> None:
    sb = world.running_sandbox()
    suspend(world, sb)
    first = world.run(sb.id).suspended_snapshot_id
    world.store.set_desired(sb.id, State.RUNNING)
    world.run(sb.id)
    suspend(world, sb)
    second = world.run(sb.id).suspended_snapshot_id
    assert first != second
    asyncio.run(world.keeper.collect())
    assert_suspended_and_verified(world, sb.id)  # exactly one artifact: the newest
    assert world.store.get_snapshot(first or "") is None


def test_sweep_removes_artifacts_nothing_refers_to(world: World) -> None:
    kept = world.running_sandbox()
    suspend(world, kept)
    kept = world.run(kept.id)
    gone = world.running_sandbox()
    suspend(world, gone)
    gone = world.run(gone.id)
    # A late upload: an artifact whose snapshot row no longer exists, next to the kept sandbox's own.
    late = f"sandboxes/{kept.project_id}/{kept.id}/{new_snapshot_id()}"
    world.objects.put(f"{late}/parts/0000/00000000", b"late")
    # A deleted sandbox whose prefix survived (the node wrote after the delete).
    world.store.set_desired(gone.id, State.DELETED)
    world.run(gone.id)
    world.objects.put(
        f"sandboxes/{gone.project_id}/{gone.id}/{gone.suspended_snapshot_id}/manifest.json", b"{}"
    )
    removed = asyncio.run(world.keeper.sweep_objects())
    assert sorted(removed) == sorted(
        [late, f"sandboxes/{gone.project_id}/{gone.id}/{gone.suspended_snapshot_id}"]
    )
    assert_suspended_and_verified(world, kept.id)  # its own artifact untouched
    assert world.objects_of(gone) == []
