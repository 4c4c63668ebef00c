"""The control plane's suspend / restore / crash-recovery / retention logic, in process and fast.

The database (SQLite, migrated), the object store (a local directory), the artifacts (written by
space.objectstore.artifacts, manifests read back) and the key service (LocalKeyService) are real. Only the
nodes are stand-ins: `FakeNodeApi` implements the node RPC contract of issue 4 in memory (suspend writes a
real artifact with the data key it is given, restore verifies every part with the key it is given).

Crash injection: a node call can be made to raise `Killed` (a BaseException, like the SIGKILL of the control
plane) after its side effect happened, so nothing after it in the step ran; the test then runs the
reconciler again (a restarted control plane) and checks that it converges: suspended with a verified
snapshot or running, on exactly one node, no orphans, no stray objects.
The same scenarios run for real (subprocesses, SIGKILL) in tests/integration/test_controlplane_suspend.py.
"""

from __future__ import annotations

import asyncio
import base64
import pathlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from space.controlplane import failpoints
from space.controlplane.keys import OrgDataKeys
from space.controlplane.reconciler.deletion import is_orphan_copy
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.snapshots import SnapshotKeeper, report_lost_node_crashes
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store, open_store
from space.core import errors, retention
from space.core.ids import new_snapshot_id
from space.core.lifecycle import State
from space.crypto.envelope import DataKey
from space.node.agent import rpc_models as rm
from space.objectstore.artifacts import ArtifactWriter, read_entry_bytes, read_manifest, verify
from space.objectstore.backends import open_store as open_objects
from space.objectstore.base import ObjectStore


class Killed(BaseException):
    """The control plane died right after this node call returned (its side effect happened)."""


class FakeNodeApi:
    """One node's RPC surface (the NodeClient methods the control plane calls), in memory."""

    def __init__(self, node_id: str, objects: ObjectStore, store_url: str) -> None:
        self.node_id = node_id
        self.objects = objects
        self.store_url = store_url
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.kill_after: set[str] = set()  # method names: raise Killed after the side effect
        self.fail: dict[str, errors.SpaceError] = {}  # method name -> raised before any side effect
        self.calls: list[str] = []

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail.pop(name)

    def _leave(self, name: str) -> None:
        if name in self.kill_after:
            self.kill_after.discard(name)
            raise Killed(name)

    def _get(self, sandbox_id: str) -> dict[str, Any]:
        if sandbox_id not in self.sandboxes:
            raise errors.NotFound(f"sandbox {sandbox_id} not on {self.node_id}")
        return self.sandboxes[sandbox_id]

    def _observed(self, sandbox_id: str) -> rm.SandboxObserved:
        sb = self._get(sandbox_id)
        return rm.SandboxObserved(
            id=sandbox_id, state=sb["state"], template="python", limits=sb["limits"], created_at=sb["at"]
        )

    async def create_sandbox(self, sandbox_id: str, *, template: str, env: Any, limits: Any) -> Any:
        self._enter("create_sandbox")
        self.sandboxes.setdefault(
            sandbox_id,
            {"state": "running", "files": {}, "snapshots": {}, "limits": limits, "at": time.time()},
        )
        self._leave("create_sandbox")
        return self._observed(sandbox_id), True

    async def get_sandbox(self, sandbox_id: str) -> rm.SandboxObserved:
        return self._observed(sandbox_id)

    async def list_sandboxes(self, *, guest: bool = True) -> rm.SandboxList:
        return rm.SandboxList(sandboxes=[self._observed(i) for i in self.sandboxes])

    async def pause(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "paused"
        return self._observed(sandbox_id)

    async def resume(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "running"
        return self._observed(sandbox_id)

    async def stop(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "stopped"
        return self._observed(sandbox_id)

    async def start(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "running"
        return self._observed(sandbox_id)

    async def delete_sandbox(self, sandbox_id: str) -> rm.DeleteResult:
        self._enter("delete_sandbox")
        existed = self.sandboxes.pop(sandbox_id, None) is not None
        self._leave("delete_sandbox")
        return rm.DeleteResult(id=sandbox_id, existed=existed)

    async def create_snapshot(self, sandbox_id: str, *, full: bool = False) -> rm.SnapshotInfo:
        sb = self._get(sandbox_id)
        snapshot_id = new_snapshot_id()
        sb["snapshots"][snapshot_id] = {"kind": "full" if full else "disk", "files": dict(sb["files"])}
        return rm.SnapshotInfo(
            snapshot_id=snapshot_id, sandbox_id=sandbox_id, kind="full" if full else "disk",
            created_at=time.time(), image_bytes=123,
        )  # fmt: skip

    async def list_snapshots(self, sandbox_id: str) -> list[rm.SnapshotInfo]:
        return []

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        self._get(sandbox_id)["snapshots"].pop(snapshot_id, None)

    def _write(self, prefix: str, files: dict[str, bytes], data_key: DataKey | None) -> dict[str, Any]:
        if self.objects.exists(f"{prefix}/manifest.json"):
            return {"prefix": prefix}  # idempotent repeat
        writer = ArtifactWriter(self.objects, prefix, data_key=data_key, metadata={"files": sorted(files)})
        for name, data in files.items():
            writer.add_bytes(name, data)
        manifest = writer.commit()
        return {"prefix": prefix, "stored_bytes": manifest.total_stored_bytes}

    async def suspend(
        self, sandbox_id: str, *, store_url: str, prefix: str, snapshot_id: str, data_key: DataKey | None
    ) -> dict[str, Any]:
        self._enter("suspend")
        assert store_url == self.store_url
        sb = self._get(sandbox_id)
        sb["state"] = "paused"
        sb["snapshots"][snapshot_id] = {"kind": "full", "files": dict(sb["files"])}
        answer = self._write(prefix, sb["files"] or {"empty": b""}, data_key)
        self._leave("suspend")
        return {"snapshot_id": snapshot_id, **answer}

    async def upload_snapshot(
        self, sandbox_id: str, snapshot_id: str, *, store_url: str, prefix: str, data_key: DataKey | None
    ) -> dict[str, Any]:
        self._enter("upload_snapshot")
        snap = self._get(sandbox_id)["snapshots"][snapshot_id]
        answer = self._write(prefix, snap["files"] or {"empty": b""}, data_key)
        self._leave("upload_snapshot")
        return answer

    async def restore(
        self, sandbox_id: str, *, store_url: str, prefix: str, data_key: bytes | None, template: str,
        limits: Any, env: Any,
    ) -> rm.SandboxObserved:  # fmt: skip
        self._enter("restore")
        assert store_url == self.store_url
        if sandbox_id in self.sandboxes and self.sandboxes[sandbox_id]["state"] == "running":
            return self._observed(sandbox_id)
        manifest = read_manifest(self.objects, prefix)
        verify(self.objects, manifest, data_key=data_key)  # every part, before anything "boots"
        files = {
            name: read_entry_bytes(self.objects, manifest, name, data_key=data_key)
            for name in manifest.entries
        }
        files.pop("empty", None)
        self.sandboxes[sandbox_id] = {
            "state": "running", "files": files, "snapshots": {}, "limits": limits, "at": time.time()
        }  # fmt: skip
        self._leave("restore")
        return self._observed(sandbox_id)

    async def recover(self, sandbox_id: str, *, snapshot_id: str | None = None) -> rm.SandboxObserved:
        self._enter("recover")
        sb = self._get(sandbox_id)
        assert snapshot_id is not None
        sb["files"] = dict(sb["snapshots"][snapshot_id]["files"])
        sb["state"] = "running"
        self._leave("recover")
        return self._observed(sandbox_id)


class FakePool:
    def __init__(self, nodes: dict[str, FakeNodeApi]) -> None:
        self.nodes = nodes

    def client(self, node_id: str) -> FakeNodeApi:
        if node_id not in self.nodes:
            raise errors.Unavailable(f"node {node_id} unreachable")
        return self.nodes[node_id]

    async def aclose(self) -> None:
        pass


class World:
    def __init__(self, root: pathlib.Path) -> None:
        self.store: Store = open_store(sqlite_url(root / "db"))
        (root / "objects").mkdir()
        self.store_url = f"file://{root / 'objects'}"
        self.objects = open_objects(self.store_url)
        self.keys = OrgDataKeys.local(self.store, root / "keys")
        org = self.store.create_org("acme")
        self.org_id = org.id
        self.project = self.store.create_project(org.id, "p").id
        self.node_ids = []
        self.api: dict[str, FakeNodeApi] = {}
        for i in range(2):
            node = self.store.register_node(
                f"http://node{i}", "tok", capacity={"cpus": 4, "memory_mb": 4096, "sandboxes": 64}
            )
            self.node_ids.append(node.id)
            self.api[node.id] = FakeNodeApi(node.id, self.objects, self.store_url)
        self.pool = FakePool(dict(self.api))
        self.reconciler = Reconciler(
            self.store,
            self.pool,  # type: ignore[arg-type]  # the NodeClient surface, in memory
            objects=self.objects,
            store_url=self.store_url,
            data_keys=self.keys,
        )
        self.keeper = SnapshotKeeper(self.reconciler)
        # Background tasks a step started (freeing a suspended sandbox's node copy) that already ended and
        # so left the reconciler's `_freeing` map: their Killed must still reach the test.
        self.finished: list[asyncio.Task[None]] = []
        forget_task = self.reconciler._freed

        def keep_finished(sandbox_id: str, task: asyncio.Task[None]) -> None:
            self.finished.append(task)
            forget_task(sandbox_id, task)

        self.reconciler._freed = keep_finished  # type: ignore[method-assign]

    def run(self, sandbox_id: str, *, rounds: int = 6) -> SandboxRecord:
        """Reconcile until settled (a few rounds, as the claim loop would); Killed propagates."""

        async def go() -> None:
            for _ in range(rounds):
                sb = self.store.load_sandbox(sandbox_id)
                assert sb is not None
                if sb.state == sb.desired_state and not sb.state.endswith("ing"):
                    return
                if sb.error_permanent:
                    return
                self.store.update_observed(sandbox_id, next_attempt_at=self.store.now())
                try:
                    await self.reconciler.reconcile(sb)
                finally:
                    # Background work the steps started (freeing a suspended sandbox's node copy) ends
                    # before this "process" does, as it would in a long-running control plane.
                    running = [task for _node, task in self.reconciler._freeing.values()]
                    try:
                        await asyncio.gather(*running, *self.finished)
                    finally:
                        self.finished = []  # all done now, and their loop ends with this "process"

        asyncio.run(go())
        sb = self.store.load_sandbox(sandbox_id)
        assert sb is not None
        return sb

    def running_sandbox(self, files: dict[str, bytes] | None = None) -> SandboxRecord:
        sb = self.store.create_sandbox(self.project, "python")
        sb = self.run(sb.id)
        assert sb.state == State.RUNNING and sb.node_id is not None
        self.api[sb.node_id].sandboxes[sb.id]["files"] = dict(files or {"a.txt": b"hello"})
        return sb

    def copies(self, sandbox_id: str) -> dict[str, str]:
        """node id -> state of the copies of this sandbox the nodes hold."""
        return {
            node_id: api.sandboxes[sandbox_id]["state"]
            for node_id, api in self.api.items()
            if sandbox_id in api.sandboxes
        }

    def objects_of(self, sb: SandboxRecord) -> list[str]:
        return self.objects.list(f"sandboxes/{sb.project_id}/{sb.id}/")

    def collect_orphans(self) -> None:
        """What Reconciler.collect_orphans does, over the fake nodes."""
        for node_id, api in self.api.items():
            for sandbox_id in list(api.sandboxes):
                record = self.store.load_sandbox(sandbox_id)
                if record is None or is_orphan_copy(record, node_id, suspended_grace_s=0):
                    del api.sandboxes[sandbox_id]

    def close(self) -> None:
        self.store.close()


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
