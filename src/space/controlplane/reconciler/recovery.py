"""Crash recovery: a `crashed` sandbox (its runtime died, or its node was lost) back to running.

Invariants:
- The source is the newest usable full checkpoint: a local one on the same (ready) node, else the newest
  uploaded (verified) one, restored on whichever node the scheduler picks; for the same moment a local
  copy beats a download. With none, a sandbox on a ready node is stopped and started again on its kept
  disk; one on a lost node waits (Unavailable, retried) for its node or a checkpoint.
- The checkpoint used and the target node are recorded with the `recover` transition, so a re-run
  repeats the same recovery; a recovery moved to another node forgets the old node's snapshots.
- A recovered sandbox carries a notice naming how, from which checkpoint, taken when, and a
  `sandbox.recovered` event (same transaction) with the checkpoint and the reason it crashed; a sandbox
  restarted on its kept disk (no checkpoint) gets the same event without a checkpoint.
- A recovery on another node is a new copy: its incarnation is recorded with the target node (context.py),
  a local one keeps the copy and its incarnation (docs/adr/0032-lost-nodes-and-incarnations.md).
"""

from __future__ import annotations

import asyncio
import time

from space.controlplane import failpoints
from space.controlplane.reconciler.context import log
from space.controlplane.reconciler.suspension import SuspensionSteps
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.controlplane.store.sandbox_state import Note
from space.core import errors
from space.core.lifecycle import Event


class RecoverySteps(SuspensionSteps):
    """Recovery restores like a suspended sandbox's restore when its checkpoint is not local."""

    async def _recovery_source(self, sb: SandboxRecord) -> tuple[SnapshotRecord, bool] | None:
        """The newest usable full checkpoint and whether it is local to sb's (ready) node."""
        snaps = await asyncio.to_thread(self.store.list_snapshots, sb.id)
        node_ready = sb.node_id is not None and await self.node_ready(sb.node_id)
        best: tuple[SnapshotRecord, bool] | None = None
        for snap in snaps:
            if snap.kind != "full" or snap.state != "ready":
                continue
            local = node_ready and snap.node_id == sb.node_id
            usable = local or (snap.restorable and snap.prefix is not None and self.objects is not None)
            if not usable:
                continue
            # Newest wins; for the same moment a local copy beats a download.
            if best is None or (snap.created_at, local) > (best[0].created_at, best[1]):
                best = (snap, local)
        return best

    async def _begin_recovery(self, sb: SandboxRecord) -> SandboxRecord | None:
        source = await self._recovery_source(sb)
        if source is None:
            if sb.node_id is not None and await self.node_ready(sb.node_id):
                # Nothing to recover from: processes start again on the kept disk (stop, then start).
                notice = "crashed with no usable checkpoint: restarted on the kept disk"
                note = Note(
                    "sandbox.recovered", notice,
                    {"checkpoint": None, "how": "restarted on the kept disk", "node_id": sb.node_id,
                     "reason": sb.notice},
                )  # fmt: skip
                sb = await self._transition(sb, Event.STOP, notice=notice, note=note)
                return await self._run_node_step(sb)
            raise errors.Unavailable(f"sandbox {sb.id} crashed on a lost node and has no uploaded checkpoint")
        snap, local = source
        placed = {} if local else {"node_id": None, "incarnation": None}  # placed anew by _recover
        sb = await self._transition(sb, Event.RECOVER, recovered_from=snap.id, **placed)
        failpoints.hit("recover.begun")
        return await self._recover(sb)

    async def _recover(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.recovered_from is None:
            raise errors.InvalidState(f"sandbox {sb.id} is recovering from nothing", state=sb.state)
        snap = await asyncio.to_thread(self.store.get_snapshot, sb.recovered_from)
        if snap is None or snap.state != "ready":
            raise errors.NotFound(f"checkpoint {sb.recovered_from} of sandbox {sb.id} is gone")
        started = time.monotonic()
        local = sb.node_id is not None and snap.node_id == sb.node_id and await self.node_ready(sb.node_id)
        old_node = sb.node_id
        if local:
            await self._node_of(sb).recover(sb.id, snapshot_id=snap.id)
            how = "on the same node"
        else:
            sb = await self._place(sb)
            await self._restore_on_node(sb, snap)
            how = f"on node {sb.node_id} from object storage"
            if old_node is not None and old_node != sb.node_id:
                await asyncio.to_thread(self.store.forget_node_snapshots, sb.id, old_node)
        log.info("sandbox %s: recovered %s in %.2fs", sb.id, how, time.monotonic() - started)
        notice = (
            f"recovered {how} from {snap.kind} checkpoint {snap.id} taken at {snap.created_at.isoformat()}"
        )
        note = Note(
            "sandbox.recovered", notice,
            {"checkpoint": snap.id, "taken_at": snap.created_at.isoformat(), "how": how,
             "node_id": sb.node_id, "reason": sb.notice},
        )  # fmt: skip
        return await self._transition(
            sb, Event.RECOVERED, recovered_at=self.store.now(), notice=notice, note=note
        )
