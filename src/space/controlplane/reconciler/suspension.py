"""The `suspending` and `restoring` steps: a sandbox to object storage and back, on any node.

Invariants (docs/adr/0013-suspend-restore-and-recovery-in-the-control-plane.md):
- suspending: the snapshot id and object-store prefix are recorded on the sandbox, and the snapshot row
  (with its wrapped data key) is written, BEFORE the node is asked to suspend; a re-run reuses all three,
  so a killed control plane resumes the same upload with the same key. The snapshot becomes `restorable`
  only after its manifest was read back from the object store; only then does the record become
  `suspended` (node_id cleared), and then the node's paused copy is deleted (by this step, in the
  background, or by orphan collection if the step dies or the node is away). So `suspended` always means
  "a verified copy exists"; a node copy of a suspended sandbox is an orphan.
- restoring: the target node is recorded before the node call; a corrupt artifact or a revoked key is a
  permanent failure: back to `suspended`, the error on the record, nothing booted. A restore onto the
  node whose suspended copy this process is still deleting waits for that delete; a stale copy of the
  sandbox on the target that is not running is deleted first, so it is never taken for the restored one.
- Incarnations (docs/adr/0032-lost-nodes-and-incarnations.md): the suspended copy is freed by naming its
  incarnation, and a restore records its own (the restoring generation) with the target node and announces
  it to the node before the copy is made, so the old copy's delete, however late, never removes the new one.
- Without a snapshot policy, a finished suspend supersedes the sandbox's earlier suspend artifacts (the
  snapshot collector removes them); with one, its retention decides.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import time

from space.controlplane import failpoints
from space.controlplane.reconciler.context import StepContext, log, snapshot_prefix
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors
from space.core.ids import new_snapshot_id
from space.core.lifecycle import Event, State
from space.crypto.envelope import DataKey


class SuspensionSteps(StepContext):
    # -- suspend ---------------------------------------------------------------------------------------------
    async def _suspend(self, sb: SandboxRecord) -> SandboxRecord:
        _objects, store_url = self.object_store()
        sb = await self._record_suspend_target(sb)
        snapshot_id, prefix = sb.suspended_snapshot_id, sb.suspended_prefix
        assert snapshot_id is not None and prefix is not None
        snap, key = await self._suspend_row(sb, snapshot_id, prefix)
        if not snap.restorable:
            if sb.node_id is None:
                raise errors.InvalidState(f"sandbox {sb.id} is suspending but on no node", state=sb.state)
            started = time.monotonic()
            await self._node_of(sb).suspend(
                sb.id, store_url=store_url, prefix=prefix, snapshot_id=snapshot_id, data_key=key
            )
            failpoints.hit("suspend.uploaded")
            await self.verify_uploaded(snapshot_id, prefix)
            failpoints.hit("suspend.verified")
            log.info("sandbox %s: suspended to %s in %.2fs", sb.id, prefix, time.monotonic() - started)
        return await self._mark_suspended(sb, snapshot_id)

    async def _record_suspend_target(self, sb: SandboxRecord) -> SandboxRecord:
        """The snapshot id and prefix of this suspend, chosen once and recorded before anything else."""
        if sb.suspended_snapshot_id is not None and sb.suspended_prefix is not None:
            return sb
        chosen = new_snapshot_id()
        sb = await asyncio.to_thread(
            self.store.update_observed, sb.id, expected_generation=sb.generation,
            suspended_snapshot_id=chosen, suspended_prefix=snapshot_prefix(sb, chosen),
        )  # fmt: skip
        failpoints.hit("suspend.recorded")
        return sb

    async def _suspend_row(
        self, sb: SandboxRecord, snapshot_id: str, prefix: str
    ) -> tuple[SnapshotRecord, DataKey | None]:
        """The suspend's snapshot row (written with a fresh data key the first time) and the key to upload
        with: on a re-run, the key recorded before the first call; none once the upload is verified."""
        snap = await asyncio.to_thread(self.store.get_snapshot, snapshot_id)
        if snap is None:
            key = await self.data_key(sb, None)
            snap = await asyncio.to_thread(
                self.store.create_snapshot, sb.id, "full", sb.node_id, snapshot_id=snapshot_id,
                prefix=prefix, origin="suspend", data_key_id=key.key_id if key else None,
                wrapped_key=base64.b64encode(key.wrapped).decode() if key else None,
            )  # fmt: skip
            failpoints.hit("suspend.row")
            return snap, key
        if snap.restorable:
            return snap, None
        return snap, await self.data_key(sb, snap)

    async def _mark_suspended(self, sb: SandboxRecord, snapshot_id: str) -> SandboxRecord:
        """Verified: now (and only now) the sandbox is suspended (on no node), then its node copy is freed.
        If that delete fails or this process dies first, orphan collection removes the copy: a copy of a
        suspended sandbox is an orphan by definition (deletion.is_orphan_copy)."""
        old_node, old_incarnation = sb.node_id, sb.incarnation
        if old_node is not None:
            await asyncio.to_thread(self.store.forget_node_snapshots, sb.id, old_node)
        done = await self._transition(sb, Event.SUSPENDED, node_id=None, incarnation=None)
        failpoints.hit("suspend.marked")
        if old_node is not None:
            # In the background: the node's delete of a paused runtime and its subvolumes takes a while, and
            # a restore to another node need not wait for it (nor for this step's lease).
            task = asyncio.create_task(
                self._free_copy(old_node, sb.id, old_incarnation), name=f"free-{sb.id}"
            )
            self._freeing[sb.id] = (old_node, task)
            task.add_done_callback(functools.partial(self._freed, sb.id))
        if sb.snapshot_policy is None:
            # Without a policy (whose retention decides), earlier suspend artifacts are superseded by this
            # one; the snapshot collector removes them from the object store.
            for old in await asyncio.to_thread(self.store.list_snapshots, sb.id):
                if old.origin == "suspend" and old.id != snapshot_id:
                    await asyncio.to_thread(self.store.delete_snapshot, old.id)
        return done

    def _freed(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._freeing.get(sandbox_id, (None, None))[1] is task:
            del self._freeing[sandbox_id]

    async def _free_copy(self, node_id: str, sandbox_id: str, incarnation: int | None = None) -> None:
        """Best effort: delete a sandbox's copy (of `incarnation`) on a node it no longer lives on."""
        if not await self.node_ready(node_id):
            return  # collected as an orphan when the node is back
        node = self.nodes.client(node_id)
        try:
            await asyncio.wait_for(node.delete_sandbox(sandbox_id, incarnation=incarnation), 60.0)
        except errors.NotFound:
            pass
        except (errors.SpaceError, TimeoutError) as exc:
            log.info(
                "sandbox %s: its copy on node %s stays until orphan collection: %s", sandbox_id, node_id, exc
            )

    # -- restore ---------------------------------------------------------------------------------------------
    async def _restore_on_node(self, sb: SandboxRecord, snap: SnapshotRecord) -> None:
        """Restore sb from the uploaded snapshot on sb.node_id (idempotent: a running copy is kept)."""
        _objects, store_url = self.object_store()
        if not snap.restorable or not snap.prefix:
            raise errors.NotFound(f"snapshot {snap.id} has no verified copy in object storage")
        node = self._node_of(sb)
        freeing = self._freeing.get(sb.id)
        if freeing is not None and freeing[0] == sb.node_id:
            await asyncio.shield(freeing[1])  # the suspended copy's delete goes first on that node
        # A stale copy of this sandbox on the target (a lost node that came back before orphan collection)
        # must not be mistaken for the restored one: one that is not running, or of another incarnation, is
        # deleted by its own incarnation; then this restore's incarnation is announced before the copy.
        with contextlib.suppress(errors.NotFound):
            observed = await node.get_sandbox(sb.id)
            held = await node.get_incarnation(sb.id)
            foreign = held is not None and held != sb.incarnation
            if observed.exists and (observed.state != State.RUNNING.value or foreign):
                await node.delete_sandbox(sb.id, incarnation=held)
        await self._announce(sb)
        plaintext = await self._plaintext_key(sb, snap)
        await node.restore(
            sb.id, store_url=store_url, prefix=snap.prefix, data_key=plaintext, template=sb.template,
            limits=sb.limits, env=sb.env,
        )  # fmt: skip

    async def _restore(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.suspended_snapshot_id is None:
            raise errors.InvalidState(f"sandbox {sb.id} has no suspended snapshot", state=sb.state)
        snap = await asyncio.to_thread(self.store.get_snapshot, sb.suspended_snapshot_id)
        if snap is None:
            raise errors.NotFound(f"snapshot {sb.suspended_snapshot_id} of sandbox {sb.id} is gone")
        sb = await self._place(sb)
        failpoints.hit("restore.placed")
        started = time.monotonic()
        await self._restore_on_node(sb, snap)
        failpoints.hit("restore.done")
        log.info("sandbox %s: restored on %s in %.2fs", sb.id, sb.node_id, time.monotonic() - started)
        return await self._transition(
            sb, Event.RESTORED, suspended_snapshot_id=None, suspended_prefix=None, notice=None
        )
