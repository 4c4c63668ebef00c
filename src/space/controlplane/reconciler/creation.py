"""The `creating` step: a new sandbox on the node the scheduler chose, or a fork child on its parent's node.

Invariants:
- The target node and the incarnation (this step's generation, docs/adr/0032-lost-nodes-and-incarnations.md)
  are recorded on the sandbox BEFORE the node is asked, so a re-run after a crash asks the same node again
  for the same incarnation, and the node call is idempotent by sandbox id (create returns an existing
  sandbox as it is; fork is given the child's id). A copy of an older incarnation on that node (it was
  placed there before, then re-planned) is deleted by its own incarnation first, never reused.
- Only a ready node with a fresh heartbeat is chosen; a creating sandbox whose node is gone is re-planned
  (back to pending, on no node) by the lost-node round (replan.py), never left waiting.
- A new sandbox's node is chosen BEFORE its `create` compare-and-swap and written with it (node and
  incarnation = the generation the swap makes), so the placing costs no transaction of its own; when no
  node has room the swap happens without one and the step chooses again (with back-off) as before. The
  choice of a create prefers a node with a pooled sandbox of its template (scheduler.PoolLedger).
- The node says how it made the sandbox (`created_from`: pool, warm, cold); it is recorded with the
  `created` transition, and a create that found no pooled sandbox (warm, cold) writes a `pool.empty`
  sandbox event in the same transaction.
- A fork child starts on its parent's node from the parent's checkpoint (`fork_snapshot_id`); a parent
  that is on no node is a permanent failure (InvalidState); one whose node is not ready is retried (the
  checkpoint lives only there) without recording that node on the child.
- A child of a checkpoint that lives only in object storage (a kept snapshot, ADR 0060: its sandbox
  deleted or suspended) is restored from there on a node of the scheduler's choice instead
  (kept_snapshots.py); a child of a named snapshot whose sandbox is being deleted waits (retried) until
  that step kept it or dropped it; a snapshot that is gone is a permanent failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from space.controlplane.reconciler.context import stale_incarnation
from space.controlplane.reconciler.kept_snapshots import KeptSnapshotSteps, keepable, kept
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandbox_state import Note
from space.core import errors
from space.core.lifecycle import Event, State

#: How a node may say it made a sandbox (SandboxObserved.created_from); anything else is not recorded.
CREATED_FROM = frozenset({"pool", "warm", "cold"})


def pool_empty_note(sb: SandboxRecord, created_from: str) -> Note | None:
    """The `pool.empty` event of a create that found no pooled sandbox of its template (None for one that did
    or for a node that does not say)."""
    if created_from not in CREATED_FROM - {"pool"}:
        return None
    how = "its template's warm checkpoint" if created_from == "warm" else "a cold boot"
    return Note(
        "pool.empty",
        f"no pooled sandbox of template {sb.template!r} was ready on node {sb.node_id}: created from {how}",
        {"template": sb.template, "node_id": sb.node_id, "created_from": created_from},
    )


class CreationSteps(KeptSnapshotSteps):
    async def _begin_create(self, sb: SandboxRecord) -> SandboxRecord:
        """pending -> creating, with the chosen node and the incarnation written by the same swap (a fork
        child or a sandbox no node has room for now: without, the step places it)."""
        fields: dict[str, Any] = {}
        if sb.forked_from is None and sb.node_id is None:
            with contextlib.suppress(errors.ResourceExhausted):
                fields = {"node_id": await self._choose(sb, create=True), "incarnation": sb.generation + 1}
        event = Event.FORK if sb.forked_from else Event.CREATE
        return await self._transition(sb, event, **fields)

    async def _create(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.forked_from is not None:
            return await self._fork_child(sb)
        if sb.node_id is None:
            node_id = await self._choose(sb, create=True)
            sb = await asyncio.to_thread(
                self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=node_id,
                incarnation=sb.generation,
            )  # fmt: skip
        sb = await self._record_incarnation(sb)
        node = self._node_of(sb)
        try:
            observed, _made = await node.create_sandbox(
                sb.id, template=sb.template, env=sb.env, limits=sb.limits, incarnation=sb.incarnation
            )
        except errors.Conflict as exc:
            held = stale_incarnation(exc)
            if held is None:
                raise errors.Unavailable(f"sandbox {sb.id}: {exc.message}") from exc
            # An older copy of this sandbox is on that node (placed there before, then re-planned).
            with contextlib.suppress(errors.NotFound):
                await node.delete_sandbox(sb.id, incarnation=held)
            raise errors.Unavailable(
                f"sandbox {sb.id}: removed a stale copy on {sb.node_id}; retrying"
            ) from exc
        made_from = getattr(observed, "created_from", None)
        if made_from not in CREATED_FROM:
            return await self._transition(sb, Event.CREATED)
        note = pool_empty_note(sb, made_from)
        return await self._transition(sb, Event.CREATED, note=note, created_from=made_from)

    async def _fork_child(self, sb: SandboxRecord) -> SandboxRecord:
        """A fork child starts on its parent's node from the parent's checkpoint; the node call is idempotent
        because the child's id is given."""
        assert sb.forked_from is not None
        parent = await asyncio.to_thread(self.store.load_sandbox, sb.forked_from)
        snap = None
        if sb.fork_snapshot_id is not None:
            snap = await asyncio.to_thread(self.store.get_snapshot, sb.fork_snapshot_id)
            if snap is None or snap.state == "deleting":
                raise errors.InvalidState(f"snapshot {sb.fork_snapshot_id} is gone", state="deleted")
        on_parent = parent is not None and parent.node_id is not None and parent.state != State.DELETED
        if snap is not None and (kept(snap) or (not on_parent and snap.restorable)):
            return await self._child_from_store(sb, snap)
        if (
            snap is not None
            and keepable(snap)
            and parent is not None
            and State.DELETED in (parent.state, parent.desired_state)
        ):
            raise errors.Unavailable(f"snapshot {snap.id} is being kept as its sandbox is deleted")
        if parent is None or parent.node_id is None:
            raise errors.InvalidState(f"fork source {sb.forked_from} is not on a node", state="unknown")
        if sb.node_id != parent.node_id:
            if not await self.node_ready(parent.node_id):
                raise errors.Unavailable(
                    f"fork source {parent.id} is on node {parent.node_id}, which is not ready"
                )
            sb = await asyncio.to_thread(
                self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=parent.node_id,
                incarnation=sb.generation,
            )  # fmt: skip
        sb = await self._record_incarnation(sb)
        await self._announce(sb)
        await self._node_of(sb).fork(parent.id, count=1, snapshot_id=sb.fork_snapshot_id, child_ids=[sb.id])
        return await self._transition(sb, Event.CREATED)
