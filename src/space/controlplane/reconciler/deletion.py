"""The `deleting` step, and orphan collection: no sandbox runs where the database says it should not.

Invariants:
- deleting: the node copy is deleted when its node is ready (a node that no longer knows it: already
  gone); a lost node's copy is collected as an orphan when the node comes back. The snapshots are marked
  for deletion (their node copies and objects are removed by SnapshotKeeper.collect), then the sandbox's
  whole object-storage prefix goes, which also takes any half-written upload whose row never got written.
- Orphans: a sandbox a ready node runs that the database does not know, knows as deleted, or records on
  another node, is destroyed once it is ORPHAN_GRACE_S old (its record may still be on its way, e.g. a
  fork in flight). A copy of a suspended sandbox, or of one moved to another node, is stale however young
  (is_orphan_copy): never one sandbox running on two nodes.
- A node that does not list its sandboxes within NODE_CALL_TIMEOUT_S is skipped (the lost-node detector
  judges it), so one hung node never stalls the collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

from space.controlplane.reconciler.context import StepContext, sandbox_prefix
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.core import errors
from space.core.lifecycle import Event, State

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


class DeletionSteps(StepContext):
    _orphans: asyncio.Task[list[str]] | None = None

    async def _delete(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.node_id is not None and await self.node_ready(sb.node_id):
            with contextlib.suppress(errors.NotFound):  # the node no longer knows it: already gone
                await self._node_of(sb).delete_sandbox(sb.id)
        await asyncio.to_thread(self.store.delete_snapshots_of, sb.id)
        if self.objects is not None:
            await asyncio.to_thread(self.objects.delete_prefix, sandbox_prefix(sb))
        return await self._transition(sb, Event.DELETED)

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
            if stale or unowned:
                with contextlib.suppress(errors.SpaceError):
                    await client.delete_sandbox(item.id)
                    removed.append(item.id)
        return removed
