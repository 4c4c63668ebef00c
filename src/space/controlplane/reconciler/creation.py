"""The `creating` step: a new sandbox on the node the scheduler chose, or a fork child on its parent's node.

Invariants:
- The target node is recorded on the sandbox BEFORE the node is asked, so a re-run after a crash asks the
  same node again, and the node call is idempotent by sandbox id (create returns an existing sandbox as
  it is; fork is given the child's id).
- A fork child starts on its parent's node from the parent's checkpoint (`fork_snapshot_id`); a parent
  that is on no node is a permanent failure (InvalidState).
"""

from __future__ import annotations

import asyncio

from space.controlplane.reconciler.context import StepContext
from space.controlplane.scheduler import choose_node
from space.controlplane.store.records import SandboxRecord
from space.core import errors
from space.core.lifecycle import Event


class CreationSteps(StepContext):
    async def _create(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.forked_from is not None:
            return await self._fork_child(sb)
        if sb.node_id is None:
            node_id = await asyncio.to_thread(choose_node, self.store, sb)
            sb = await asyncio.to_thread(
                self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=node_id
            )
        node = self._node_of(sb)
        await node.create_sandbox(sb.id, template=sb.template, env=sb.env, limits=sb.limits)
        return await self._transition(sb, Event.CREATED)

    async def _fork_child(self, sb: SandboxRecord) -> SandboxRecord:
        """A fork child starts on its parent's node from the parent's checkpoint; the node call is idempotent
        because the child's id is given."""
        assert sb.forked_from is not None
        parent = await asyncio.to_thread(self.store.load_sandbox, sb.forked_from)
        if parent is None or parent.node_id is None:
            raise errors.InvalidState(f"fork source {sb.forked_from} is not on a node", state="unknown")
        if sb.node_id != parent.node_id:
            sb = await asyncio.to_thread(
                self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=parent.node_id
            )
        await self._node_of(sb).fork(parent.id, count=1, snapshot_id=sb.fork_snapshot_id, child_ids=[sb.id])
        return await self._transition(sb, Event.CREATED)
