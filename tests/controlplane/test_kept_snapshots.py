"""Named snapshots outlive their sandbox (ADR 0060), in the reconciler, in process: a sandbox's deletion
uploads its named full snapshots before its node copy goes and keeps their rows and artifacts (nothing
else); a sandbox created from one is restored from object storage on a node; deleting it removes its
artifact and row; the object-store sweep leaves kept artifacts alone. Crash injection: a control plane
killed after each node call of the deletion, or of the restore, converges when it runs again.

The database, object store, artifacts and keys are real; the nodes are tests.support.reconciler_world's
in-memory stand-ins (the real runsc path is tests/e2b/test_gaps_real.py)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator

import pytest

from space.controlplane.reconciler.kept_snapshots import KEEP_ATTEMPTS
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors
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


def _snapshot(
    world: World, sb: SandboxRecord, *, full: bool = True, name: str | None = None
) -> SnapshotRecord:
    """What the API's take_snapshot does: the node's checkpoint, then its row (origin user)."""
    assert sb.node_id is not None
    info = asyncio.run(world.api[sb.node_id].create_snapshot(sb.id, full=full))
    snap = world.store.create_snapshot(
        sb.id, "full" if full else "disk", sb.node_id, snapshot_id=info.snapshot_id, origin="user", name=name
    )
    return world.store.mark_snapshot_ready(snap.id, size_bytes=info.image_bytes)


def _delete(world: World, sb: SandboxRecord) -> SandboxRecord:
    world.store.set_desired(sb.id, State.DELETED)
    return world.run(sb.id)


def _child(world: World, source: SandboxRecord, snap: SnapshotRecord) -> SandboxRecord:
    """A sandbox from `snap`, as api/snapshot_sandboxes.create_from_snapshot records it."""
    return world.store.create_sandbox(
        world.project, source.template, dict(source.env), source.limits, forked_from=source.id,
        fork_snapshot_id=snap.id,
    )  # fmt: skip


def _collect(world: World) -> None:
    asyncio.run(world.keeper.collect())


def test_a_named_snapshot_outlives_its_sandbox_and_is_restored_from_storage(world: World) -> None:
    sb = world.running_sandbox({"kept.txt": b"before the snapshot"})
    named = _snapshot(world, sb, name="golden")
    plain = _snapshot(world, sb)
    disk = _snapshot(world, sb, full=False)
    assert _delete(world, sb).state == State.DELETED
    assert world.copies(sb.id) == {}
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.state == "ready" and kept.node_id is None and kept.restorable
    assert kept.prefix is not None and read_manifest(world.objects, kept.prefix).encryption is not None
    assert {world.store.get_snapshot(i.id).state for i in (plain, disk)} == {"deleting"}  # type: ignore[union-attr]
    _collect(world)
    assert world.store.get_snapshot(plain.id) is None and world.store.get_snapshot(disk.id) is None
    # Only the kept artifact is left of the sandbox, and the sweep of unaccounted artifacts keeps it.
    assert {k.split("/")[3] for k in world.objects_of(sb)} == {named.id}
    assert asyncio.run(world.keeper.sweep_objects()) == []
    assert {k.split("/")[3] for k in world.objects_of(sb)} == {named.id}

    child = world.run(_child(world, sb, kept).id)
    assert child.state == State.RUNNING and child.node_id is not None, child.error
    assert world.api[child.node_id].sandboxes[child.id]["files"] == {"kept.txt": b"before the snapshot"}
    again = world.run(_child(world, sb, kept).id)  # a snapshot is used any number of times
    assert again.state == State.RUNNING

    world.store.delete_snapshot(named.id)
    _collect(world)
    assert world.store.get_snapshot(named.id) is None and world.objects_of(sb) == []
    late = world.run(_child(world, sb, kept).id)  # recorded before the delete: fails, never retries forever
    assert late.state == State.FAILED and late.error_permanent and world.copies(late.id) == {}


@pytest.mark.parametrize("killed_after", ["upload_snapshot", "delete_sandbox"])
def test_a_deletion_killed_midway_converges(world: World, killed_after: str) -> None:
    sb = world.running_sandbox({"a.txt": b"A"})
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    world.api[sb.node_id].kill_after.add(killed_after)
    world.store.set_desired(sb.id, State.DELETED)
    with pytest.raises(Killed):
        world.run(sb.id)
    assert world.run(sb.id).state == State.DELETED  # the restarted control plane
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.state == "ready" and kept.restorable and kept.node_id is None
    assert {k.split("/")[3] for k in world.objects_of(sb)} == {named.id}  # one artifact, not two
    # Re-run after a verified upload: not uploaded again; after an unverified one: again, to the same place.
    assert world.api[sb.node_id].calls.count("upload_snapshot") == (
        2 if killed_after == "upload_snapshot" else 1
    )


def test_a_deleting_sandbox_is_stopped_before_its_named_snapshots_upload(world: World) -> None:
    """ADR 0078: the upload takes its time; the sandbox must not run (nor send anything) meanwhile."""
    sb = world.running_sandbox({"a.txt": b"A"})
    _snapshot(world, sb, name="golden")
    _snapshot(world, sb, name="silver")
    assert sb.node_id is not None
    api = world.api[sb.node_id]
    assert _delete(world, sb).state == State.DELETED
    assert api.uploaded_from == ["stopped", "stopped"]
    assert api.calls.index("stop") < api.calls.index("upload_snapshot")


def test_a_deletion_killed_after_the_stop_uploads_and_converges(world: World) -> None:
    sb = world.running_sandbox({"a.txt": b"A"})
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    api = world.api[sb.node_id]
    api.kill_after.add("stop")
    world.store.set_desired(sb.id, State.DELETED)
    with pytest.raises(Killed):
        world.run(sb.id)
    assert "upload_snapshot" not in api.calls
    assert world.run(sb.id).state == State.DELETED  # the restarted control plane stops again, then uploads
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.restorable and api.uploaded_from == ["stopped"]


def test_a_node_that_cannot_stop_the_sandbox_makes_the_deletion_retry_before_any_upload(world: World) -> None:
    sb = world.running_sandbox()
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    api = world.api[sb.node_id]
    api.fail["stop"] = errors.Unavailable("the node does not answer")
    world.store.set_desired(sb.id, State.DELETED)
    waiting = world.run(sb.id, rounds=1)
    assert waiting.state == State.DELETING and "upload_snapshot" not in api.calls
    assert world.run(sb.id).state == State.DELETED
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.restorable and api.uploaded_from == ["stopped"]


def test_a_deletion_with_nothing_to_keep_does_not_stop_first(world: World) -> None:
    sb = world.running_sandbox()
    _snapshot(world, sb)  # unnamed: goes with its sandbox, nothing is uploaded
    assert sb.node_id is not None
    assert _delete(world, sb).state == State.DELETED
    assert "stop" not in world.api[sb.node_id].calls and "delete_sandbox" in world.api[sb.node_id].calls


def test_a_restore_killed_midway_converges_on_one_node(world: World) -> None:
    sb = world.running_sandbox({"a.txt": b"A"})
    named = _snapshot(world, sb, name="golden")
    _delete(world, sb)
    for api in world.api.values():
        api.kill_after.add("restore")
    child = _child(world, sb, named)
    with pytest.raises(Killed):
        world.run(child.id)
    done = world.run(child.id)
    assert done.state == State.RUNNING and list(world.copies(child.id)) == [done.node_id]


def test_a_snapshot_whose_node_is_gone_goes_with_its_sandbox(world: World) -> None:
    sb = world.running_sandbox()
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    world.pool.nodes.pop(sb.node_id)
    world.store.set_node_status(sb.node_id, "lost")
    assert _delete(world, sb).state == State.DELETED
    gone = world.store.get_snapshot(named.id)
    assert gone is not None and gone.state == "deleting"
    _collect(world)
    assert world.store.get_snapshot(named.id) is None and world.objects_of(sb) == []


def test_a_failed_upload_makes_the_deletion_retry_not_drop(world: World) -> None:
    sb = world.running_sandbox()
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    world.store.set_node_status(sb.node_id, "draining")  # not gone: still asked
    world.api[sb.node_id].fail["upload_snapshot"] = errors.Unavailable("the node does not answer")
    world.store.set_desired(sb.id, State.DELETED)
    waiting = world.run(sb.id, rounds=1)
    assert waiting.state == State.DELETING and not waiting.error_permanent
    assert world.store.get_snapshot(named.id).state == "ready"  # type: ignore[union-attr]
    assert sb.id in world.api[sb.node_id].sandboxes  # the node copy waits for the upload
    assert world.run(sb.id).state == State.DELETED
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.restorable and kept.node_id is None


def test_a_child_of_a_snapshot_whose_sandbox_is_being_deleted_waits_for_it(world: World) -> None:
    sb = world.running_sandbox({"a.txt": b"A"})
    named = _snapshot(world, sb, name="golden")
    world.store.set_desired(sb.id, State.DELETED)  # the deletion has not run yet
    child = world.run(_child(world, sb, named).id, rounds=2)
    assert child.state == State.CREATING and not child.error_permanent
    assert "being kept" in (child.error or "")
    world.run(sb.id)
    done = world.run(child.id)
    assert done.state == State.RUNNING and done.node_id is not None
    assert world.api[done.node_id].sandboxes[done.id]["files"] == {"a.txt": b"A"}


def test_a_snapshot_of_a_live_sandbox_still_forks_on_its_node(world: World) -> None:
    """Unchanged: a snapshot of a live sandbox starts its child on the source's node, nothing uploaded."""
    sb = world.running_sandbox({"a.txt": b"A"})
    snap = _snapshot(world, sb, name="golden")
    child = world.run(_child(world, sb, snap).id)
    assert child.state == State.RUNNING and child.node_id == sb.node_id
    assert sb.node_id is not None and "upload_snapshot" not in world.api[sb.node_id].calls
    with pytest.raises(errors.NotFound):
        read_manifest(world.objects, f"sandboxes/{sb.project_id}/{sb.id}/{snap.id}")


def test_a_suspend_keeps_named_snapshots_too(world: World) -> None:
    """A suspend frees the node (and the checkpoints there): its named snapshots are uploaded first, and a
    sandbox from one is then restored from object storage (the source's node no longer has it)."""
    sb = world.running_sandbox({"a.txt": b"A"})
    named = _snapshot(world, sb, name="golden")
    plain = _snapshot(world, sb)
    world.store.set_desired(sb.id, State.SUSPENDED)
    assert world.run(sb.id).state == State.SUSPENDED
    kept = world.store.get_snapshot(named.id)
    assert kept is not None and kept.state == "ready" and kept.restorable and kept.node_id is None
    assert world.store.get_snapshot(plain.id).state == "deleting"  # type: ignore[union-attr]
    child = world.run(_child(world, sb, kept).id)
    assert child.state == State.RUNNING and child.node_id is not None
    assert world.api[child.node_id].sandboxes[child.id]["files"] == {"a.txt": b"A"}


def test_an_upload_that_keeps_failing_is_given_up_and_the_deletion_finishes(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = world.running_sandbox()
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None

    async def refused(*_args: object, **_kw: object) -> None:
        raise errors.StorageExhausted("no room to stage the export")

    monkeypatch.setattr(world.api[sb.node_id], "upload_snapshot", refused)
    world.store.set_desired(sb.id, State.DELETED)
    assert world.run(sb.id, rounds=KEEP_ATTEMPTS // 2).state == State.DELETING  # still trying
    assert world.run(sb.id, rounds=KEEP_ATTEMPTS).state == State.DELETED
    assert world.store.get_snapshot(named.id).state == "deleting"  # type: ignore[union-attr]


def test_an_upload_refused_for_good_never_fails_the_deletion(world: World) -> None:
    sb = world.running_sandbox()
    named = _snapshot(world, sb, name="golden")
    assert sb.node_id is not None
    world.api[sb.node_id].fail["upload_snapshot"] = errors.InvalidArgument("refused")
    world.store.set_desired(sb.id, State.DELETED)
    done = world.run(sb.id)
    assert done.state == State.DELETED and not done.error_permanent
    assert world.store.get_snapshot(named.id).state == "deleting"  # type: ignore[union-attr]
