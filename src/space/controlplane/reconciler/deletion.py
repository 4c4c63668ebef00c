"""The `deleting` step, and orphan collection: no sandbox runs where the database says it should not.

Invariants:
- A DELETE request moves the sandbox into `deleting` itself (`begin_deletion`: one compare-and-swap that
  also records desired `deleted`), so from its answer on every data and lifecycle route refuses it (409
  `deleting`, the table allows nothing else there) and nothing waits for the teardown, which this step does
  in the background (docs/adr/0073-delete-answers-at-once.md). The row says `deleting` before any side
  effect: a process killed mid-teardown leaves a row the next claim re-runs this step on.
- deleting: the named full snapshots are uploaded first, while the node copy exists (kept_snapshots.py,
  ADR 0060), but from a STOPPED copy: before the first upload the node stops the sandbox (its processes
  killed, so nothing of it runs or sends traffic while the upload takes its time; the upload reads the
  checkpoint's image and disk snapshot, not the running sandbox). Then the node copy is deleted when its
  node is ready (a node that no longer knows it: already gone); a lost node's copy is collected as an
  orphan when the node comes back. The other snapshots are
  marked for deletion (their node copies and objects are removed by SnapshotKeeper.collect), then the
  sandbox's object-storage prefix goes but for the kept snapshots' artifacts, which also takes any
  half-written upload whose row never got written.
- Orphans: a sandbox a ready node runs that the database does not know, knows as deleted, or records on
  another node, is destroyed once it is ORPHAN_GRACE_S old (its record may still be on its way, e.g. a
  fork in flight). A copy of a suspended sandbox, or of one moved to another node, is stale however young
  (is_orphan_copy): never one sandbox running on two nodes.
- A node that does not list its sandboxes within NODE_CALL_TIMEOUT_S is skipped (the lost-node detector
  judges it), so one hung node never stalls the collection.
- Conditional by incarnation (docs/adr/0032-lost-nodes-and-incarnations.md): deleting names the record's
  incarnation; the collector asks the node which incarnation a candidate copy is, then reads the record
  AGAIN and destroys the copy only if (id, that incarnation) is not the current placement, naming it. A
  placement records its incarnation before announcing it to the node, so a sweep that raced a restore
  either sees the new placement (and keeps the copy) or names the old incarnation (and the node refuses).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from space.controlplane.reconciler.context import sandbox_prefix, stale_incarnation
from space.controlplane.reconciler.kept_snapshots import KeptSnapshotSteps
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.lifecycle import Event, State
from space.node.rpc_client import NodeClient

if TYPE_CHECKING:
    from space.objectstore.base import ObjectStore

ORPHAN_GRACE_S = 60.0
SUSPENDED_GRACE_S = 10.0  # see is_orphan_copy
NODE_CALL_TIMEOUT_S = 5.0


def is_orphan_copy(
    record: SandboxRecord,
    node_id: str,
    now: datetime | None = None,
    *,
    suspended_grace_s: float = SUSPENDED_GRACE_S,
) -> bool:
    """A copy of a known sandbox on `node_id` that must go: the sandbox is deleted, recorded on another
    node, or suspended (it lives in object storage only) for longer than `suspended_grace_s`. The grace
    keeps the collector away from the moment a suspend step frees the node itself, and from a restore
    that a user starts right then: the delete goes by sandbox id, so a collector that read `suspended`
    just before a restore onto this node could otherwise delete the restored copy."""
    if record.state == State.DELETED:
        return True
    if record.state == State.SUSPENDED:
        at = now or datetime.now(UTC)
        return (at - record.updated_at).total_seconds() >= suspended_grace_s
    return record.node_id is not None and record.node_id != node_id


def is_current_copy(record: SandboxRecord, node_id: str, incarnation: int | None) -> bool:
    """Whether the copy (record.id, incarnation) on `node_id` is the record's current placement. A side
    without a recorded incarnation (from before incarnations) matches any."""
    if record.state in (State.DELETED, State.SUSPENDED) or record.node_id != node_id:
        return False
    return record.incarnation is None or incarnation is None or record.incarnation == incarnation


def delete_prefix_but(objects: ObjectStore, prefix: str, keep: Iterable[str]) -> int:
    """Delete every object under `prefix` except those under one of the `keep` prefixes (kept snapshots'
    artifacts); returns how many went."""
    kept = tuple(k.rstrip("/") + "/" for k in keep)
    if not kept:
        return objects.delete_prefix(prefix)
    gone = 0
    for key in objects.list(prefix):
        if not key.startswith(kept):
            objects.delete(key)
            gone += 1
    return gone


#: Compare-and-swap attempts of begin_deletion against steps that move the row meanwhile.
_DELETE_RACES = 5


def begin_deletion(store: Store, sb: SandboxRecord) -> SandboxRecord:
    """Move `sb` into `deleting` now, recording desired `deleted` in the same compare-and-swap (blocking:
    call it in a thread). A row already `deleting` only has its wish recorded. A row a step keeps moving
    (each move a lost race) gets the wish alone, and the reconciler's next claim takes the `delete` edge.
    NotFound once the sandbox is deleted."""
    for _ in range(_DELETE_RACES):
        if sb.state == State.DELETED:
            raise errors.NotFound(f"sandbox {sb.id} not found")
        if sb.state == State.DELETING:
            return sb if sb.desired_state == State.DELETED else store.set_desired(sb.id, State.DELETED)
        try:
            return store.transition(sb.id, sb.state, sb.generation, Event.DELETE, desired_state=State.DELETED)
        except errors.Conflict:
            current = store.load_sandbox(sb.id)
            if current is None:
                raise errors.NotFound(f"sandbox {sb.id} not found") from None
            sb = current
    return store.set_desired(sb.id, State.DELETED)


class DeletionSteps(KeptSnapshotSteps):
    _orphans: asyncio.Task[list[str]] | None = None

    async def _delete(self, sb: SandboxRecord) -> SandboxRecord:
        if await self._uploads_to_keep(sb):
            await self._stop_before_keeping(sb)
        kept = await self._keep_named(sb)  # before the node copy (and its checkpoints) goes
        if sb.node_id is not None and await self.node_ready(sb.node_id):
            try:
                await self._node_of(sb).delete_sandbox(sb.id, incarnation=sb.incarnation)
            except errors.NotFound:
                pass  # the node no longer knows it: already gone
            except errors.Conflict as exc:
                if stale_incarnation(exc) is None:
                    raise
                # The node holds another (older) copy, not the one placed: an orphan once this is deleted.
        await asyncio.to_thread(functools.partial(self.store.delete_snapshots_of, sb.id, keep=set(kept)))
        if self.objects is not None:
            await asyncio.to_thread(delete_prefix_but, self.objects, sandbox_prefix(sb), kept.values())
        return await self._transition(sb, Event.DELETED)

    async def _stop_before_keeping(self, sb: SandboxRecord) -> None:
        """Stop the node's copy of `sb` (being deleted) before its named snapshots upload, so it runs and
        sends nothing meanwhile (docs/adr/0078-a-deleting-sandbox-stops-before-its-uploads.md). A copy the
        node no longer holds, or one the node's table cannot stop (already stopped, crashed: nothing runs),
        is fine; a node that does not answer makes the step retry, before any upload."""
        if sb.node_id is None or await self.node_gone(sb.node_id):
            return  # nothing to ask; a lost node is fenced (ADR 0033) and its copy collected as an orphan
        with contextlib.suppress(errors.NotFound, errors.InvalidState):
            await self._node_of(sb).stop(sb.id)

    def collect_orphans_soon(self) -> None:
        """Run an orphan collection now in the background (one at a time)."""
        if self._orphans is None or self._orphans.done():
            self._orphans = asyncio.create_task(self.collect_orphans(), name="collect-orphans")

    async def collect_orphans(self) -> list[str]:
        """Destroy sandboxes that run on a node but are unknown to (or deleted in) the database."""
        removed = []
        for node in await asyncio.to_thread(self.store.list_nodes, "ready"):
            removed += await self._collect_on_node(node)
        return removed

    async def _collect_on_node(self, node: NodeRecord) -> list[str]:
        client = self.nodes.client(node.id)
        try:
            observed = await asyncio.wait_for(client.list_sandboxes(guest=False), NODE_CALL_TIMEOUT_S)
        except (errors.SpaceError, TimeoutError):
            return []  # a hung node is the lost-node detector's business, not a reason to stall here
        removed = []
        for item in observed.sandboxes:
            record = await asyncio.to_thread(self.store.load_sandbox, item.id)
            # Suspended, or moved to another node (restored or recovered there): this copy is stale
            # however young it is (a restore on a node that came back makes a young copy).
            stale = record is not None and is_orphan_copy(record, node.id, self.store.now())
            # Otherwise it must be old enough: its record may still be on its way (e.g. a fork in flight).
            unowned = time.time() - item.created_at >= ORPHAN_GRACE_S and (
                record is None or record.state == State.DELETED or record.node_id not in (None, node.id)
            )
            if (stale or unowned) and await self._destroy_orphan(client, node.id, item.id):
                removed.append(item.id)
        return removed

    async def _destroy_orphan(self, client: NodeClient, node_id: str, sandbox_id: str) -> bool:
        """Destroy the copy of `sandbox_id` on `node_id` unless it turns out to be the current placement: the
        node says which incarnation it holds, the record is read again, the delete names that incarnation."""
        try:
            held = await asyncio.wait_for(client.get_incarnation(sandbox_id), NODE_CALL_TIMEOUT_S)
        except (errors.SpaceError, TimeoutError):
            return False  # gone already, or the node is slow: the next round looks again
        record = await asyncio.to_thread(self.store.load_sandbox, sandbox_id)
        if record is not None and is_current_copy(record, node_id, held):
            return False
        try:
            await client.delete_sandbox(sandbox_id, incarnation=held)
        except errors.SpaceError:
            return False  # refused (a newer copy was placed meanwhile) or failed: the next round decides
        return True
