"""Store.named_snapshots: a name means the project's ready full snapshots of that name, of live sandboxes,
oldest first (the newest is the one a create uses); never another project's, a disk snapshot, one still
being taken or being deleted. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from space.controlplane.store import Store
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
