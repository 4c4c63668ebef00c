"""What every family of reconciler steps shares: the store, the nodes, object storage and data keys.

StepContext is the base of the step families (creation, suspension, recovery, deletion) that the
Reconciler (loop.py) is assembled from, and what the snapshot keeper (space.controlplane.snapshots) uses to
reach nodes, object storage and keys.

Invariants:
- Every state change goes through `_transition`: a compare-and-swap on (state, generation) through the
  lifecycle table (Store.transition), so a step that lost a race gets Conflict, never a silent overwrite.
- A plain node step (plan.NODE_CALLS) is: the idempotent node call, then its completion event from the
  lifecycle table; re-running it after a crash is safe.
- An uploaded snapshot becomes `restorable` only after its manifest was read back from the object store
  (`verify_uploaded`). A re-run of an upload uses the data key already recorded on the snapshot (`data_key`).
- A sandbox's artifacts live under `sandbox_prefix`; one snapshot's under `snapshot_prefix`.
- Placing (docs/adr/0032-lost-nodes-and-incarnations.md): a node is chosen only among ready nodes with a
  fresh heartbeat (`node_fresh_s`); the chosen node AND the incarnation (the record's generation in the
  placing step) are written to the record before the node is asked, and the incarnation is announced to
  the node (`_announce`) before a restore or fork makes the copy, after a stale copy of another
  incarnation there was deleted by name. So a stale delete or orphan sweep never removes the new copy.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Final

from space.controlplane.nodes import NodePool
from space.controlplane.reconciler.plan import NODE_CALLS, completion
from space.controlplane.scheduler import DEFAULT_FRESH_S, PoolLedger, choose_node
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.controlplane.store.sandbox_state import Note
from space.controlplane.store.store import Store
from space.core import errors
from space.core.lifecycle import Event
from space.crypto.envelope import DataKey
from space.node.rpc_client import NodeClient
from space.objectstore.artifacts import read_manifest

if TYPE_CHECKING:
    from space.controlplane.keys import DataKeys
    from space.objectstore.base import ObjectStore

#: Node statuses of nodes that are gone: no step waits on them (docs/adr/0032-lost-nodes-and-incarnations.md).
GONE_STATUSES: Final = ("lost", "offline")

# One log for the whole reconciler, under the name it had before its steps moved into their own modules.
log = logging.getLogger("space.controlplane.reconciler.loop")


def snapshot_prefix(sb: SandboxRecord, snapshot_id: str) -> str:
    """Where a snapshot of `sb` lives in object storage (one artifact per snapshot)."""
    return f"sandboxes/{sb.project_id}/{sb.id}/{snapshot_id}"


def sandbox_prefix(sb: SandboxRecord) -> str:
    return f"sandboxes/{sb.project_id}/{sb.id}/"


def stale_incarnation(exc: errors.SpaceError) -> int | None:
    """The incarnation a node holds, when it refused a request for naming another one; else None."""
    held = exc.details.get("incarnation")
    if (
        exc.details.get("reason") == "stale_incarnation"
        and isinstance(held, int)
        and not isinstance(held, bool)
    ):
        return held
    return None


class StepContext:
    def __init__(
        self,
        store: Store,
        nodes: NodePool,
        *,
        objects: ObjectStore | None = None,
        store_url: str | None = None,
        data_keys: DataKeys | None = None,
        node_fresh_s: float | None = DEFAULT_FRESH_S,
    ) -> None:
        self.store = store
        #: A node is chosen only if its last heartbeat is younger than this (None: any ready node).
        self.node_fresh_s = node_fresh_s
        self.nodes = nodes
        self.objects = objects
        self.store_url = store_url
        self.data_keys = data_keys
        # Deletes of node copies left behind by a finished suspend, running after the step (and its lease)
        # ended: sandbox id -> (node id, task). A restore onto that node in this process waits for it.
        self._freeing: dict[str, tuple[str, asyncio.Task[None]]] = {}
        #: Set (and replaced) whenever this reconciler moved a sandbox: waiters re-read without polling.
        self.changed = asyncio.Event()
        #: What this process believes of each node's warm pools (placements since their last heartbeat).
        self.pool_ledger = PoolLedger()

    # -- the record ------------------------------------------------------------------------------------------
    async def _transition(
        self, sb: SandboxRecord, event: Event, *, note: Note | None = None, **fields: object
    ) -> SandboxRecord:
        """The compare-and-swap `event` on sb as read; `note`: the sandbox event written with it."""
        record = await asyncio.to_thread(
            functools.partial(self.store.transition, note=note),
            sb.id,
            sb.state,
            sb.generation,
            event,
            **fields,
        )
        self._notify()
        return record

    def _notify(self) -> None:
        """Wake requests in this process that wait for a sandbox to settle (others poll the database)."""
        self.changed.set()
        self.changed = asyncio.Event()

    # -- nodes -----------------------------------------------------------------------------------------------
    def _node_of(self, sb: SandboxRecord) -> NodeClient:
        if sb.node_id is None:
            raise errors.Unavailable(f"sandbox {sb.id} has no node")
        return self.nodes.client(sb.node_id)

    async def node_ready(self, node_id: str) -> bool:
        node = await asyncio.to_thread(self.store.get_node, node_id)
        return node is not None and node.status == "ready"

    async def node_gone(self, node_id: str) -> bool:
        """Lost, offline (deregistered) or unknown: no step may wait on it (a draining node is not gone)."""
        node = await asyncio.to_thread(self.store.get_node, node_id)
        return node is None or node.status in GONE_STATUSES

    async def _choose(self, sb: SandboxRecord, *, create: bool = False) -> str:
        """A node for sb; a create (`create`) prefers nodes with a pooled sandbox of its template."""
        pools = self.pool_ledger if create else None
        return await asyncio.to_thread(
            functools.partial(choose_node, fresh_within_s=self.node_fresh_s, pools=pools), self.store, sb
        )

    async def _place(self, sb: SandboxRecord) -> SandboxRecord:
        """Make sure sb has a ready target node and its incarnation recorded (before any node call)."""
        if sb.node_id is not None and await self.node_ready(sb.node_id):
            return await self._record_incarnation(sb)
        node_id = await self._choose(sb)
        return await asyncio.to_thread(
            self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=node_id,
            incarnation=sb.generation,
        )  # fmt: skip

    async def _record_incarnation(self, sb: SandboxRecord) -> SandboxRecord:
        """A placing step on a recorded node without an incarnation (a row from before incarnations, or a
        step re-run by an older process) records this step's generation as it, before the node call."""
        if sb.incarnation is not None:
            return sb
        return await asyncio.to_thread(
            self.store.update_observed, sb.id, expected_generation=sb.generation, incarnation=sb.generation
        )

    async def _announce(self, sb: SandboxRecord) -> None:
        """Tell sb's node which incarnation the copy it is about to make is. A stale copy of another
        incarnation there is deleted first, naming its own incarnation (never the new one)."""
        if sb.incarnation is None:
            return
        node = self._node_of(sb)
        try:
            await node.place_incarnation(sb.id, sb.incarnation)
        except errors.Conflict as exc:
            held = stale_incarnation(exc)
            if held is None:
                raise errors.Unavailable(f"sandbox {sb.id}: {exc.message}") from exc
            log.info("sandbox %s: deleting the stale copy (incarnation %s) on %s", sb.id, held, sb.node_id)
            with contextlib.suppress(errors.NotFound):
                await node.delete_sandbox(sb.id, incarnation=held)
            try:
                await node.place_incarnation(sb.id, sb.incarnation)
            except errors.Conflict as again:  # a step a retry takes again (not a lost compare-and-swap)
                raise errors.Unavailable(f"sandbox {sb.id}: {again.message}") from again

    async def _run_node_step(self, sb: SandboxRecord) -> SandboxRecord:
        """The in-progress state's node call (plan.NODE_CALLS), then its completion event."""
        await getattr(self._node_of(sb), NODE_CALLS[sb.state])(sb.id)
        return await self._transition(sb, completion(sb.state))

    # -- object storage, keys --------------------------------------------------------------------------------
    def object_store(self) -> tuple[ObjectStore, str]:
        """The object store and its URL (as nodes reach it); InvalidArgument when none is configured."""
        if self.objects is None or self.store_url is None:
            raise errors.InvalidArgument("this control plane has no object store configured (--store-url)")
        return self.objects, self.store_url

    async def data_key(self, sb: SandboxRecord, snap: SnapshotRecord | None) -> DataKey | None:
        """The data key of `snap` if it already has one (a re-run: same key), else a fresh one."""
        if self.data_keys is None:
            return None
        if snap is not None and snap.data_key_id and snap.wrapped_key:
            wrapped = base64.b64decode(snap.wrapped_key)
            plaintext = await asyncio.to_thread(self.data_keys.unwrap, sb, snap.data_key_id, wrapped)
            return DataKey(key_id=snap.data_key_id, wrapped=wrapped, plaintext=plaintext)
        return await asyncio.to_thread(self.data_keys.for_sandbox, sb)

    async def _plaintext_key(self, sb: SandboxRecord, snap: SnapshotRecord) -> bytes | None:
        if not snap.wrapped_key or not snap.data_key_id:
            return None
        if self.data_keys is None:
            raise errors.KeyUnavailable(f"snapshot {snap.id} is encrypted and no key service is configured")
        wrapped = base64.b64decode(snap.wrapped_key)
        return await asyncio.to_thread(self.data_keys.unwrap, sb, snap.data_key_id, wrapped)

    async def upload_full_snapshot(
        self, sb: SandboxRecord, snap: SnapshotRecord, node_id: str
    ) -> SnapshotRecord:
        """Have `node_id` upload the full checkpoint `snap` of `sb` to object storage, then verify it. The
        prefix and wrapped data key are recorded on the row BEFORE the node call, so a re-run after a crash
        uploads to the same place with the same key (the node's upload is idempotent by prefix)."""
        _objects, store_url = self.object_store()
        if snap.prefix is None:
            key = await self.data_key(sb, None)
            snap = await asyncio.to_thread(
                self.store.update_snapshot, snap.id, prefix=snapshot_prefix(sb, snap.id),
                data_key_id=key.key_id if key else None,
                wrapped_key=base64.b64encode(key.wrapped).decode() if key else None,
            )  # fmt: skip
        else:
            key = await self.data_key(sb, snap)
        assert snap.prefix is not None
        await self.nodes.client(node_id).upload_snapshot(
            sb.id, snap.id, store_url=store_url, prefix=snap.prefix, data_key=key
        )
        return await self.verify_uploaded(snap.id, snap.prefix)

    async def verify_uploaded(self, snap_id: str, prefix: str) -> SnapshotRecord:
        """Read the manifest back from the object store; only then is the snapshot restorable."""
        objects, _url = self.object_store()
        manifest = await asyncio.to_thread(read_manifest, objects, prefix)
        await asyncio.to_thread(self.store.mark_snapshot_ready, snap_id, manifest.total_stored_bytes)
        return await asyncio.to_thread(
            self.store.update_snapshot, snap_id, restorable=True, uploaded_at=self.store.now(),
            size_bytes=manifest.total_stored_bytes, error=None,
        )  # fmt: skip
