"""No sandbox waits on a node that is gone: the steps of lost and offline nodes are re-planned.

docs/adr/0032-lost-nodes-and-incarnations.md has the table of decisions; in short, for a sandbox recorded
on a node whose status is `lost` (no heartbeat for node_lost_after_s) or `offline` (deregistered on
purpose by `space down`):
- creating   -> pending (on no node): placed again on a ready, fresh node by the next reconciler round;
- restoring  -> suspended (on no node): the artifact is still in object storage; restored elsewhere;
- recovering and every step on an established runtime or its kept disk (pausing, resuming, suspending,
  stopping, starting, checkpointing, rolling_back) -> crashed, with the reason: recovered from the newest
  uploaded checkpoint where one exists (recovery.py), else crashed (stable, visible) until the node returns;
- a suspending whose upload is already verified is left alone: the reconciler finishes it without the node;
- deleting finishes without the node (deletion.py); the node's copy is collected when it returns;
- running or paused on a LOST node with a verified uploaded full checkpoint -> crashed (then recovered
  elsewhere); without one it waits for its node. An offline node's stable sandboxes wait for it: it was
  taken down on purpose and keeps their disks.

Invariants:
- Level-triggered: every round looks at every sandbox of every lost or offline node, so a control plane
  that dies half-way through strands nothing; a move is a compare-and-swap (`node_lost`, or `crash`) on the
  (state, generation) that was read, so a step that finished meanwhile, or a node that came back (read
  again just before each move), is left alone.
- Only nodes the control plane has MARKED lost or offline are acted on (never a node that merely missed a
  heartbeat): a partitioned node fences its own sandboxes before it can be marked lost (ADR 0033).
- Every move writes a sandbox event in the same transaction: `step.replanned` (creating, restoring) or
  `sandbox.crashed` (into crashed), with the node, its status, the step and the reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from space.controlplane.reconciler.context import GONE_STATUSES, StepContext, log
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.sandbox_state import Note
from space.core import errors
from space.core.lifecycle import LIVE_STATES, REPLANNED_STATES, TRANSITIONS, Event, State


async def replan_gone_nodes(ctx: StepContext) -> list[str]:
    """One round over every lost or offline node's sandboxes; returns the ids moved."""
    moved: list[str] = []
    for status in GONE_STATUSES:
        for node in await asyncio.to_thread(ctx.store.list_nodes, status):
            for sb in await asyncio.to_thread(ctx.store.list_sandboxes_on_node, node.id):
                try:
                    if await _replan(ctx, sb, node):
                        moved.append(sb.id)
                except (errors.Conflict, errors.InvalidState, errors.NotFound):
                    continue  # moved meanwhile: whoever moved it decides
    if moved:
        log.info("re-planned %d sandbox(es) of gone nodes: %s", len(moved), ", ".join(moved))
    return moved


async def _replan(ctx: StepContext, sb: SandboxRecord, node: NodeRecord) -> bool:
    if sb.state in REPLANNED_STATES:
        if sb.state == State.SUSPENDING and await _suspend_verified(ctx, sb):
            return False  # the reconciler finishes it without the node
        if not await ctx.node_gone(node.id):
            return False
        await _move(ctx, sb, node)
        return True
    if sb.state in LIVE_STATES and node.status == "lost":
        if not await _has_uploaded_checkpoint(ctx, sb) or not await ctx.node_gone(node.id):
            return False  # nothing to recover from elsewhere: it waits for its node to come back
        changed = await asyncio.to_thread(
            ctx.store.report_crash, sb.id, node.id, notice=f"node {node.id} was lost"
        )
        return changed is not None
    return False


async def _move(ctx: StepContext, sb: SandboxRecord, node: NodeRecord) -> SandboxRecord:
    target = TRANSITIONS[(sb.state, Event.NODE_LOST)]
    fields: dict[str, Any] = {}
    if target == State.CRASHED:
        kind = "sandbox.crashed"
        notice = f"node {node.id} is {node.status}: {sb.state} could not finish there"
        fields.update(crash_count=(sb.crash_count or 0) + 1)
    else:
        kind = "step.replanned"
        where = "placed again on another node" if target == State.PENDING else "restored on another node"
        notice = f"node {node.id} is {node.status}: {sb.state} is {where}"
        fields.update(node_id=None, incarnation=None)  # on no node: the next step places it afresh
    detail = {
        "node_id": node.id, "node_status": node.status, "from": sb.state.value, "to": target.value,
        "reason": "node_lost", "incarnation": sb.incarnation,
    }  # fmt: skip
    return await ctx._transition(
        sb, Event.NODE_LOST, notice=notice, note=Note(kind, notice, detail), **fields
    )


async def _suspend_verified(ctx: StepContext, sb: SandboxRecord) -> bool:
    if sb.suspended_snapshot_id is None:
        return False
    snap = await asyncio.to_thread(ctx.store.get_snapshot, sb.suspended_snapshot_id)
    return snap is not None and snap.restorable


async def _has_uploaded_checkpoint(ctx: StepContext, sb: SandboxRecord) -> bool:
    snaps = await asyncio.to_thread(ctx.store.list_snapshots, sb.id)
    return any(s.kind == "full" and s.restorable and s.state == "ready" for s in snaps)
