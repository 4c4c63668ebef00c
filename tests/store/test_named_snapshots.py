"""Store.named_snapshots: a name means the project's ready full snapshots of that name, of live sandboxes
or kept after their sandbox was deleted (ADR 0060), oldest first (the newest is the one a create uses);
never another project's, a disk snapshot, one still being taken or being deleted. On SQLite and
PostgreSQL."""

from __future__ import annotations

import pytest

from space.controlplane.store import Store
from space.core.lifecycle import Event
from tests.support.clock import FakeClock


def _ready(store: Store, sandbox_id: str, name: str | None, kind: str = "full") -> str:
    snap = store.create_snapshot(sandbox_id, kind, name=name)  # type: ignore[arg-type]
    return store.mark_snapshot_ready(snap.id, size_bytes=1).id


def test_named_snapshots_of_one_project(store: Store, clock: FakeClock) -> None:
    org = store.create_org("acme")
    mine, theirs = store.create_project(org.id, "mine"), store.create_project(org.id, "theirs")
    sb = store.create_sandbox(mine.id, "python").id
    other = store.create_sandbox(theirs.id, "python").id
    older = _ready(store, sb, "golden")
    clock.advance(1)
    newer = _ready(store, sb, "golden")
    clock.advance(1)
    _ready(store, sb, "golden", kind="disk")  # a disk snapshot is no template
    _ready(store, sb, "other-name")
    _ready(store, other, "golden")  # their name is theirs
    store.create_snapshot(sb, "full", name="golden")  # still being taken
    gone = _ready(store, sb, "golden")
    store.delete_snapshot(gone)
    assert [s.id for s in store.named_snapshots(mine.id, "golden")] == [older, newer]
    assert store.named_snapshots(mine.id, "golden")[-1].name == "golden"
    assert store.named_snapshots(mine.id, "nothing") == []
    assert [s.sandbox_id for s in store.named_snapshots(theirs.id, "golden")] == [other]
    renamed = store.update_snapshot(older, name="silver")  # a name is settable (SNAPSHOT_FIELDS)
    assert renamed.name == "silver" and [s.id for s in store.named_snapshots(mine.id, "golden")] == [newer]
    with pytest.raises(TypeError):
        store.update_snapshot(newer, kind="disk")  # the kind never is


def test_a_kept_snapshot_outlives_its_sandbox(store: Store, clock: FakeClock) -> None:
    """delete_snapshots_of(keep=): the named full snapshot with a verified object-storage copy stays ready
    on no node and is still listed and found by name in its project once its sandbox is a tombstone (ADR
    0060); one without a verified copy, and every other snapshot, goes `deleting`."""
    org = store.create_org("acme")
    mine, theirs = store.create_project(org.id, "mine"), store.create_project(org.id, "theirs")
    node = store.register_node("http://node0", "tok", capacity={"cpus": 4, "memory_mb": 4096, "sandboxes": 8})
    sb = store.create_sandbox(mine.id, "python")
    named = store.create_snapshot(sb.id, "full", node.id, name="golden").id
    store.mark_snapshot_ready(named, size_bytes=1)
    store.update_snapshot(named, prefix=f"sandboxes/{mine.id}/{sb.id}/{named}", restorable=True)
    unverified = _ready(store, sb.id, "golden")  # named, but never uploaded: not keepable
    plain = _ready(store, sb.id, None)
    clock.advance(1)
    assert store.delete_snapshots_of(sb.id, keep={named, unverified}) == 2
    sb = store.transition(sb.id, sb.state, sb.generation, Event.DELETE)
    store.transition(sb.id, sb.state, sb.generation, Event.DELETED)
    kept = store.get_snapshot(named, project_id=mine.id)
    assert kept is not None and kept.state == "ready" and kept.node_id is None and kept.restorable
    assert {store.get_snapshot(i).state for i in (unverified, plain)} == {"deleting"}  # type: ignore[union-attr]
    assert [s.id for s in store.named_snapshots(mine.id, "golden")] == [named]
    assert [s.id for s in store.page_project_snapshots(mine.id)] == [named]
    # Still its project's only: another project neither finds nor lists it.
    assert store.named_snapshots(theirs.id, "golden") == [] and store.page_project_snapshots(theirs.id) == []
    assert store.get_snapshot(named, project_id=theirs.id) is None
    store.delete_snapshot(named)
    assert store.named_snapshots(mine.id, "golden") == [] and store.page_project_snapshots(mine.id) == []
