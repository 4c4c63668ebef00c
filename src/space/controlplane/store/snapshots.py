"""Snapshot records: where a sandbox's snapshots are, and their lifecycle creating -> ready -> deleting.

Invariants:
- A snapshot record is written in state `creating` BEFORE its side effect starts, so a crash leaves a
  record to finish or clean up, never data nobody knows about.
- `deleting` is final: a snapshot being deleted never becomes ready again (Conflict); the reconciler
  removes its data, then `purge_snapshot` removes the record (snapshots are the one sandbox-related row
  that is hard-deleted).
- Callers set only SNAPSHOT_FIELDS; kind, sandbox, created_at and state are fixed or owned by the state
  methods.
- A snapshot counts as restorable only once its uploaded copy is known complete (`restorable`); restore
  and recovery use nothing else.
- A snapshot may carry a user's `name` (not unique: a name used again names one more snapshot, and the
  newest ready one of the project is the one the name means); names are looked up per project only.
- A full checkpoint's row records the runtime it needs (`runtime`, ADR 0035): given by the caller, else the
  runtime its node reported, copied in the transaction that writes the row.
- A kept snapshot (ADR 0060: a named full snapshot whose sandbox was deleted) stays `ready` with a verified
  object-storage copy and no node (`node_id` NULL, `restorable`); it is listed and found by name like a
  live sandbox's, in its sandbox's project (the tombstone's `project_id`). Every other snapshot of a deleted
  sandbox is `deleting` (`delete_snapshots_of`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final, get_args

from sqlalchemy import and_, delete, or_, select, true, update

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import node_record, snapshot_record
from space.controlplane.store.models import Node, Sandbox, Snapshot
from space.controlplane.store.records import SnapshotKind, SnapshotRecord
from space.controlplane.store.values import aware, rowcount, settable
from space.core import ids
from space.core.errors import Conflict, InvalidArgument, NotFound

# Snapshot columns Store.update_snapshot may set (kind, sandbox, created_at and state are fixed or owned by
# the state methods).
SNAPSHOT_FIELDS: Final = frozenset(
    {
        "node_id",
        "size_bytes",
        "prefix",
        "uploaded_at",
        "exclusive_bytes",
        "restorable",
        "data_key_id",
        "wrapped_key",
        "error",
        "origin",
        "runtime",
        "name",
    }
)
#: The most snapshots one name lists (E2B re-uses a name: each use is one more snapshot of it).
MAX_NAMED = 1000
_SNAPSHOT_KINDS: Final = frozenset(get_args(SnapshotKind))
#: A snapshot a project lists: its sandbox is not deleted, or it was kept in object storage (ADR 0060).
_LISTED = or_(Sandbox.deleted_at.is_(None), and_(Snapshot.node_id.is_(None), Snapshot.restorable.is_(True)))


class SnapshotRepository(Repository):
    """The snapshots table."""

    def create_snapshot(
        self,
        sandbox_id: str,
        kind: SnapshotKind,
        node_id: str | None = None,
        *,
        snapshot_id: str | None = None,
        ready: bool = False,
        **fields: Any,
    ) -> SnapshotRecord:
        """A snapshot record in state `creating` (written before the side effect starts); `fields` are
        SNAPSHOT_FIELDS (prefix, data key, origin ...). With `ready`, one the node has made already (a
        user's snapshot, recorded after the node answered) is written `ready` at once: one write, not two
        (docs/adr/0074-lifecycle-steps-in-the-request.md)."""
        if kind not in _SNAPSHOT_KINDS:
            raise InvalidArgument(f"invalid snapshot kind {kind!r}", field="kind")
        row = Snapshot(
            id=ids.parse_snapshot_id(snapshot_id) if snapshot_id else ids.new_snapshot_id(),
            sandbox_id=sandbox_id,
            kind=kind,
            state="ready" if ready else "creating",
            node_id=node_id,
            size_bytes=None,
            created_at=self.now(),
            restorable=False,
        )
        for name, value in settable(fields, SNAPSHOT_FIELDS).items():
            setattr(row, name, value)
        with self._tx(f"creating a snapshot of sandbox {sandbox_id}") as session:
            if kind == "full" and row.runtime is None and node_id is not None:
                node = session.get(Node, node_id)
                row.runtime = node_record(node).runtime if node is not None and node.runtime else None
            session.add(row)
        return snapshot_record(row)

    def get_snapshot(self, snapshot_id: str, *, project_id: str | None = None) -> SnapshotRecord | None:
        """The snapshot; with project_id, None unless its sandbox belongs to that project."""
        with self._tx("reading a snapshot") as session:
            query = select(Snapshot).where(Snapshot.id == snapshot_id)
            if project_id is not None:
                query = query.join(Sandbox, Sandbox.id == Snapshot.sandbox_id).where(
                    Sandbox.project_id == project_id
                )
            row = session.scalars(query).one_or_none()
            return snapshot_record(row) if row else None

    def list_snapshots(self, sandbox_id: str, *, include_deleting: bool = False) -> list[SnapshotRecord]:
        query = select(Snapshot).where(Snapshot.sandbox_id == sandbox_id)
        if not include_deleting:
            query = query.where(Snapshot.state != "deleting")
        with self._tx("listing snapshots") as session:
            rows = session.scalars(query.order_by(Snapshot.created_at, Snapshot.id))
            return [snapshot_record(row) for row in rows]

    def page_project_snapshots(
        self, project_id: str, *, kind: SnapshotKind = "full", after: str | None = None, limit: int = 100
    ) -> list[SnapshotRecord]:
        """Up to `limit` ready snapshots of `kind` of the project's live sandboxes (and its kept ones),
        oldest first, after the snapshot `after` (one of the project's listed snapshots: else nothing), in
        one indexed query each (the E2B front's list)."""
        with self._tx("listing a project's snapshots") as session:
            query = (
                select(Snapshot)
                .join(Sandbox, Sandbox.id == Snapshot.sandbox_id)
                .where(Sandbox.project_id == project_id, _LISTED)
                .where(Snapshot.state == "ready", Snapshot.kind == kind)
            )
            if after is not None:
                mark = session.scalars(query.where(Snapshot.id == after)).one_or_none()
                if mark is None:
                    return []
                query = query.where(
                    or_(
                        Snapshot.created_at > mark.created_at,
                        and_(Snapshot.created_at == mark.created_at, Snapshot.id > mark.id),
                    )
                )
            rows = session.scalars(query.order_by(Snapshot.created_at, Snapshot.id).limit(limit))
            return [snapshot_record(row) for row in rows]

    def named_snapshots(self, project_id: str, name: str) -> list[SnapshotRecord]:
        """The project's ready full snapshots called `name` (of its live sandboxes, and kept ones), oldest
        first: the last is the one the name means. At most MAX_NAMED (the newest)."""
        with self._tx("finding a project's named snapshots") as session:
            query = (
                select(Snapshot)
                .join(Sandbox, Sandbox.id == Snapshot.sandbox_id)
                .where(Sandbox.project_id == project_id, _LISTED)
                .where(Snapshot.name == name, Snapshot.state == "ready", Snapshot.kind == "full")
                .order_by(Snapshot.created_at.desc(), Snapshot.id.desc())
                .limit(MAX_NAMED)
            )
            return [snapshot_record(row) for row in reversed(list(session.scalars(query)))]

    def mark_snapshot_ready(
        self, snapshot_id: str, size_bytes: int | None = None, *, node_id: str | None = None
    ) -> SnapshotRecord:
        """creating -> ready (idempotent when already ready); Conflict if it is being deleted."""
        with self._tx(f"marking snapshot {snapshot_id} ready") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            if row.state == "deleting":
                raise Conflict(f"snapshot {snapshot_id} is being deleted", state=row.state)
            if row.state == "creating":
                row.state = "ready"
                row.size_bytes = size_bytes
                if node_id is not None:
                    row.node_id = node_id
            return snapshot_record(row)

    def update_snapshot(self, snapshot_id: str, **fields: Any) -> SnapshotRecord:
        """Set SNAPSHOT_FIELDS of a snapshot (where its copies are, sizes, errors); NotFound if absent."""
        values = settable(fields, SNAPSHOT_FIELDS)
        if values.get("uploaded_at") is not None:
            values["uploaded_at"] = aware(values["uploaded_at"], "uploaded_at")
        with self._tx(f"updating snapshot {snapshot_id}") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            for name, value in values.items():
                setattr(row, name, value)
            return snapshot_record(row)

    def delete_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """Mark the snapshot `deleting` (idempotent); the reconciler removes its data, then purges it."""
        with self._tx(f"deleting snapshot {snapshot_id}") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            row.state = "deleting"
            return snapshot_record(row)

    def delete_snapshots_of(self, sandbox_id: str, *, keep: Collection[str] = ()) -> int:
        """Mark every snapshot of a sandbox `deleting` (the sandbox is being deleted), but those of `keep`
        that are ready with a verified object-storage copy: they now live there only (node_id cleared; ADR
        0060). Returns how many rows were marked."""
        kept = and_(
            Snapshot.id.in_(list(keep)),
            Snapshot.state == "ready",
            Snapshot.restorable.is_(True),
            Snapshot.prefix.is_not(None),
        )
        base = [Snapshot.sandbox_id == sandbox_id, Snapshot.state != "deleting"]
        with self._tx(f"deleting the snapshots of sandbox {sandbox_id}") as session:
            if keep:
                session.execute(
                    update(Snapshot)
                    .where(*base, kept)
                    .values(node_id=None)
                    .execution_options(synchronize_session=False)
                )
            marked = session.execute(
                update(Snapshot)
                .where(*base, ~kept if keep else true())
                .values(state="deleting")
                .execution_options(synchronize_session=False)
            )
            return rowcount(marked)

    def forget_node_snapshots(self, sandbox_id: str, node_id: str) -> int:
        """The sandbox left `node_id` (suspended, or recovered elsewhere) and its copies there go with it:
        snapshots with a verified object-storage copy now live there only (node_id cleared); the others
        are marked `deleting`. Returns how many rows changed."""
        uploaded = and_(Snapshot.restorable.is_(True), Snapshot.prefix.is_not(None))
        base = [Snapshot.sandbox_id == sandbox_id, Snapshot.node_id == node_id]
        with self._tx(f"forgetting the snapshots of sandbox {sandbox_id} on node {node_id}") as session:
            moved = session.execute(
                update(Snapshot)
                .where(*base, uploaded)
                .values(node_id=None)
                .execution_options(synchronize_session=False)
            )
            dropped = session.execute(
                update(Snapshot)
                .where(*base, ~uploaded, Snapshot.state != "deleting")
                .values(state="deleting")
                .execution_options(synchronize_session=False)
            )
            return rowcount(moved) + rowcount(dropped)

    def list_deleting_snapshots(self, limit: int = 100) -> list[SnapshotRecord]:
        query = (
            select(Snapshot).where(Snapshot.state == "deleting").order_by(Snapshot.created_at).limit(limit)
        )
        with self._tx("listing snapshots to delete") as session:
            return [snapshot_record(row) for row in session.scalars(query)]

    def purge_snapshot(self, snapshot_id: str) -> bool:
        """Remove the record of a `deleting` snapshot whose data is gone (False if nothing to remove)."""
        statement = delete(Snapshot).where(Snapshot.id == snapshot_id, Snapshot.state == "deleting")
        with self._tx(f"purging snapshot {snapshot_id}") as session:
            return rowcount(session.execute(statement)) == 1
