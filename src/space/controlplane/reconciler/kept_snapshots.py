"""Named snapshots that outlive their sandbox (docs/adr/0060-snapshots-outlive-their-sandbox.md): kept in
object storage when their sandbox is deleted, and restored from there into a sandbox created from them.

Invariants:
- Kept are the sandbox's READY, NAMED, FULL snapshots, and only when this control plane has an object
  store; every other snapshot goes with its sandbox (as before). A kept snapshot has a verified copy in
  object storage (`restorable`, its manifest read back) before the node's copy of the sandbox is deleted:
  the deleting step uploads the ones that have none (prefix and wrapped data key recorded on the row
  BEFORE the node call, so a re-run after a crash uploads to the same place with the same key; the node's
  upload is idempotent by prefix). Then the row lives on with no node (Store.delete_snapshots_of(keep=)).
- A suspend keeps them the same way: its node copy (and the checkpoints it holds) goes too, so the named
  snapshots are uploaded after the suspend's own artifact is verified and before the sandbox is marked
  suspended (Store.forget_node_snapshots then keeps every verified one).
- A snapshot that cannot be uploaded because its node is gone (lost, offline) or no longer holds it, that
  the user deleted meanwhile, or whose upload fails for good (plan.PERMANENT: a revoked key, a refusal),
  is not kept (it goes with its sandbox; a deletion never fails for it); a node that does not answer
  (yet) or an upload that failed otherwise makes the step retry with back-off: a named snapshot is never
  dropped because of a hiccup. After KEEP_ATTEMPTS failed attempts of the step (several minutes of
  back-off) it is given up (logged, and it goes with its sandbox): a deletion is never blocked for good.
- A sandbox from a snapshot whose only copy is in object storage (its sandbox deleted, or suspended) is
  restored on a node the scheduler chooses among those whose runtime can restore it (restore_targets),
  like a suspended sandbox: node and incarnation recorded before the call, the incarnation announced,
  the restore idempotent by sandbox id. A snapshot deleted meanwhile (row gone or `deleting`, artifact
  missing) is a permanent failure of the create (InvalidState): never a retry loop.
"""

from __future__ import annotations

import asyncio

from space.controlplane.reconciler.context import log
from space.controlplane.reconciler.plan import PERMANENT
from space.controlplane.reconciler.suspension import SuspensionSteps
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors
from space.core.lifecycle import Event

#: Failed attempts of a deleting or suspending step after which a named snapshot that could not be uploaded
#: is given up (the back-off grows to plan.MAX_BACKOFF_S: about 7 minutes in all).
KEEP_ATTEMPTS = 20
#: Upload failures that retrying cannot mend: the snapshot is not kept.
_NOT_KEPT: tuple[type[errors.SpaceError], ...] = (errors.NotFound, errors.Conflict, *PERMANENT)


def keepable(snap: SnapshotRecord) -> bool:
    """Whether `snap` outlives its sandbox (when an object store is configured)."""
    return snap.state == "ready" and snap.kind == "full" and snap.name is not None


def kept(snap: SnapshotRecord) -> bool:
    """Whether `snap` lives in object storage only, verified (its sandbox deleted or moved away)."""
    return snap.state == "ready" and snap.node_id is None and snap.restorable and snap.prefix is not None


class KeptSnapshotSteps(SuspensionSteps):
    async def _keep_named(self, sb: SandboxRecord) -> dict[str, str]:
        """Upload the named full snapshots of `sb` (being deleted or suspended) that have no verified
        object-storage copy, while its node copy still exists; returns {snapshot id: prefix} of those kept."""
        if self.objects is None or self.store_url is None:
            return {}
        kept_ones: dict[str, str] = {}
        for snap in await asyncio.to_thread(self.store.list_snapshots, sb.id):
            if not keepable(snap):
                continue
            done = snap if snap.restorable and snap.prefix else await self._upload_to_keep(sb, snap)
            if done is not None and done.prefix is not None:
                kept_ones[done.id] = done.prefix
        return kept_ones

    async def _uploads_to_keep(self, sb: SandboxRecord) -> bool:
        """Whether `_keep_named(sb)` would upload anything (a named full snapshot with no verified copy)."""
        if self.objects is None or self.store_url is None:
            return False
        snaps = await asyncio.to_thread(self.store.list_snapshots, sb.id)
        return any(keepable(snap) and not (snap.restorable and snap.prefix) for snap in snaps)

    async def _mark_suspended(self, sb: SandboxRecord, snapshot_id: str) -> SandboxRecord:
        """A suspend's node copy goes: its named snapshots are kept in object storage first."""
        await self._keep_named(sb)
        return await super()._mark_suspended(sb, snapshot_id)

    async def _upload_to_keep(self, sb: SandboxRecord, snap: SnapshotRecord) -> SnapshotRecord | None:
        """The snapshot uploaded and verified, or None when it cannot be kept (see the invariants)."""
        node_id = snap.node_id or sb.node_id
        if node_id is None or await self.node_gone(node_id):
            log.warning("sandbox %s: named snapshot %s is not kept: its node is gone", sb.id, snap.id)
            return None
        # A node that is not gone (ready, or draining) is asked; one that does not answer makes the step
        # retry until it answers or the lost-node detector says it is gone.
        try:
            return await self.upload_full_snapshot(sb, snap, node_id)
        except _NOT_KEPT as exc:
            # The node no longer holds it (a crash after the node copy went), the user deleted the snapshot
            # meanwhile (Conflict from marking a `deleting` row ready), or retrying cannot help (a revoked
            # key, a refusal): it goes with the sandbox, whose deletion must not fail for it.
            log.warning("sandbox %s: named snapshot %s is not kept: %s", sb.id, snap.id, exc.message)
            return None
        except errors.SpaceError as exc:
            if sb.attempts < KEEP_ATTEMPTS:
                raise
            log.warning(
                "sandbox %s: named snapshot %s is not kept after %d attempts: %s",
                sb.id, snap.id, sb.attempts, exc.message,
            )  # fmt: skip
            return None

    async def _child_from_store(self, sb: SandboxRecord, snap: SnapshotRecord) -> SandboxRecord:
        """Restore the new sandbox `sb` (creating) from the kept snapshot `snap` on a chosen node."""
        sb = await self._place(sb)
        try:
            await self._restore_on_node(sb, snap)
        except errors.NotFound as exc:  # the artifact went (the snapshot deleted meanwhile): never retried
            raise errors.InvalidState(f"snapshot {snap.id} is gone: {exc.message}", state="deleted") from exc
        log.info("sandbox %s: started on %s from kept snapshot %s", sb.id, sb.node_id, snap.id)
        return await self._transition(sb, Event.CREATED)
