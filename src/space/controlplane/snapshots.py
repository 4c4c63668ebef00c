"""The snapshot scheduler and collector (run by the API's housekeeping loop).

Invariants:
- Scheduled snapshots follow each running sandbox's SnapshotPolicy: a full checkpoint when `full_every_s`
  has passed since the newest scheduled one (uploaded to object storage when `upload_full`), else a disk
  snapshot when `disk_every_s` has passed. Taking one is the node's idempotent snapshot call; its row is
  written after the node answered (a crash in between leaves a snapshot only the node knows, deleted with
  the sandbox).
- An upload is recorded on the row (prefix + wrapped data key) BEFORE the node is asked, so a retry uses
  the same key and place; the row becomes `restorable` only after the manifest was read back.
- Retention (space.core.retention.keep with the policy's tiers) prunes only snapshots the platform took
  (origin "policy" or "suspend"), never a user's, and never the newest usable full checkpoint. Pruning
  only marks rows `deleting`; `collect` removes the node copy and the object-storage copy, then the row,
  so a crash anywhere leaves a row that the next round finishes. `sweep_objects` (rarely) removes artifacts
  no record accounts for (an upload that finished after its snapshot was pruned or its sandbox deleted);
  a kept snapshot's (ADR 0060: named, its sandbox deleted) is accounted for by its row.
- Disk budgets (docs/adr/0027-disk-budgets.md): a scheduled snapshot the node refuses for the sandbox's
  storage budget (or its own reserve) is made to fit by deleting the oldest prunable snapshots at once (the
  same protections as retention: never a user's, never the newest usable full checkpoint, never the one a
  suspend or recovery uses), then asked for once more. When even all prunable ones would not free enough,
  nothing is deleted, the sandbox's `notice` says why, and its scheduled snapshots wait BUDGET_BACKOFF_S.
  Retention also keeps at most `policy.max_retained` prunable snapshots (the oldest go first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from space.controlplane.reconciler.context import StepContext
from space.controlplane.reconciler.kept_snapshots import kept
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.reconciler.replan import replan_gone_nodes
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors, retention
from space.core.lifecycle import State
from space.objectstore.artifacts import delete_artifact

log = logging.getLogger(__name__)

PRUNABLE_ORIGINS = frozenset({"policy", "suspend"})
NODE_CALL_TIMEOUT_S = 30.0
BUDGET_BACKOFF_S = 60.0  # a sandbox whose budget is full is not asked again for this long


class SnapshotKeeper:
    def __init__(self, reconciler: StepContext) -> None:
        self.reconciler = reconciler
        self.store = reconciler.store
        self._busy: set[str] = set()
        self._full_until: dict[str, float] = {}  # sandbox id -> monotonic time its budget is looked at again

    async def run_policies(self) -> int:
        """One round of the scheduler over every running sandbox with a policy; returns snapshots taken."""
        taken = 0
        sandboxes = await asyncio.to_thread(self.store.list_sandboxes_with_policy)
        results = await asyncio.gather(
            *(self._one(sb) for sb in sandboxes if sb.id not in self._busy), return_exceptions=True
        )
        for sb, result in zip(sandboxes, results, strict=False):
            if isinstance(result, BaseException):
                if not isinstance(result, errors.SpaceError | TimeoutError):
                    log.error("snapshot policy of %s failed", sb.id, exc_info=result)
                else:
                    log.info("snapshot policy of %s: %s", sb.id, result)
            elif result:
                taken += 1
        return taken

    async def _one(self, sb: SandboxRecord) -> bool:
        if sb.node_id is None or sb.snapshot_policy is None:
            return False
        self._busy.add(sb.id)
        try:
            policy = retention.SnapshotPolicy.from_stored(sb.snapshot_policy)
            snaps = await asyncio.to_thread(self.store.list_snapshots, sb.id)
            now = self.store.now()
            scheduled = [s for s in snaps if s.origin == "policy"]
            last_full = max((s.created_at for s in scheduled if s.kind == "full"), default=None)
            last_disk = max((s.created_at for s in scheduled if s.kind == "disk"), default=None)
            took = False
            if self._full_until.get(sb.id, 0.0) > time.monotonic():
                pass  # its budget was full a moment ago and nothing could be pruned: wait
            elif retention.due(last_full, policy.full_every_s, now):
                snap = await self.take_fitting(sb, full=True)
                if snap is not None and policy.upload_full:
                    await self.upload(sb, snap)
                took = snap is not None
            elif retention.due(last_disk, policy.disk_every_s, now):
                took = await self.take_fitting(sb, full=False) is not None
            await self.prune(sb, policy)
            return took
        finally:
            self._busy.discard(sb.id)

    async def take_fitting(self, sb: SandboxRecord, *, full: bool) -> SnapshotRecord | None:
        """A scheduled snapshot; if the node refuses it for lack of disk, the oldest prunable snapshots are
        deleted to make room and it is asked once more. None (and a notice) when it cannot fit."""
        try:
            snap = await self.take(sb, full=full)
        except errors.StorageExhausted as exc:
            freed = await self.prune_to_fit(sb, exc)
            if not freed:
                await self._report_full(sb, exc)
                return None
            try:
                snap = await self.take(sb, full=full)
            except errors.StorageExhausted as again:
                await self._report_full(sb, again)
                return None
        self._full_until.pop(sb.id, None)
        if sb.notice and sb.notice.startswith(_FULL_NOTICE):
            await asyncio.to_thread(self.store.update_observed, sb.id, notice=None)
        return snap

    async def prune_to_fit(self, sb: SandboxRecord, refusal: errors.StorageExhausted) -> list[str]:
        """Delete (now, on the node too) the oldest prunable snapshots that free what `refusal` says is
        missing; [] when that is impossible (then nothing is deleted)."""
        details = refusal.details
        needed = int(details.get("needed_bytes") or 0)
        if details.get("reason") == "storage_budget":
            excess = int(details.get("used_bytes", 0)) + needed - int(details.get("budget_bytes", 0))
        elif details.get("reason") == "node_reserve":
            excess = int(details.get("reserve_bytes", 0)) + needed - int(details.get("free_bytes", 0))
        else:
            return []  # e.g. too many snapshots on the node: max_retained pruning handles the count
        sized = await self._sized(sb)
        plan = retention.plan_prune_to_fit(sized, max(1, excess))
        if not plan:
            return []
        log.info(
            "sandbox %s: deleting %d old snapshot(s) to fit its %s", sb.id, len(plan), details.get("reason")
        )
        for snapshot_id in plan:
            await asyncio.to_thread(self.store.delete_snapshot, snapshot_id)
            snap = await asyncio.to_thread(self.store.get_snapshot, snapshot_id)
            if snap is None:
                continue
            try:
                await self._remove(snap)
            except (errors.SpaceError, TimeoutError) as exc:
                log.info("snapshot %s: not removed yet: %s", snapshot_id, exc)  # collect() finishes it
                continue
            await asyncio.to_thread(self.store.purge_snapshot, snapshot_id)
        return plan

    async def _sized(self, sb: SandboxRecord) -> list[retention.Sized]:
        """The sandbox's ready snapshots with what deleting each frees (the node's live figures when it
        answers, else the recorded ones) and whether pruning may take it."""
        snaps = [s for s in await asyncio.to_thread(self.store.list_snapshots, sb.id) if s.state == "ready"]
        live: dict[str, tuple[int, int]] = {}
        if sb.node_id is not None:
            with contextlib.suppress(errors.SpaceError, TimeoutError):
                node = self.reconciler.nodes.client(sb.node_id)
                for info in await asyncio.wait_for(node.list_snapshots(sb.id), NODE_CALL_TIMEOUT_S):
                    live[info.snapshot_id] = (info.image_bytes, info.exclusive_bytes or 0)
        fulls = [s for s in snaps if s.kind == "full"]
        newest_full = max(fulls, key=lambda s: (s.created_at, s.id)).id if fulls else None
        protected = {newest_full, sb.suspended_snapshot_id, sb.recovered_from}
        sized = []
        for s in snaps:
            image, exclusive = live.get(s.id, (s.size_bytes or 0, s.exclusive_bytes or 0))
            prunable = s.origin in PRUNABLE_ORIGINS and s.id not in protected
            sized.append(retention.Sized(s.id, s.created_at, image + exclusive, prunable))
        return sized

    async def _report_full(self, sb: SandboxRecord, refusal: errors.StorageExhausted) -> None:
        self._full_until[sb.id] = time.monotonic() + BUDGET_BACKOFF_S
        notice = f"{_FULL_NOTICE}: {refusal.message}"
        log.warning("sandbox %s: %s", sb.id, notice)
        if sb.notice != notice:
            with contextlib.suppress(errors.SpaceError):
                await asyncio.to_thread(self.store.update_observed, sb.id, notice=notice)

    async def take(self, sb: SandboxRecord, *, full: bool, origin: str = "policy") -> SnapshotRecord:
        """A disk snapshot or full checkpoint of a running sandbox, recorded ready."""
        if sb.node_id is None:
            raise errors.InvalidState(f"sandbox {sb.id} is not on a node", state=sb.state.value)
        node = self.reconciler.nodes.client(sb.node_id)
        info = await asyncio.wait_for(node.create_snapshot(sb.id, full=full), NODE_CALL_TIMEOUT_S)
        snap = await asyncio.to_thread(
            self.store.create_snapshot, sb.id, "full" if full else "disk", sb.node_id,
            snapshot_id=info.snapshot_id, origin=origin,
            exclusive_bytes=getattr(info, "exclusive_bytes", None),
        )  # fmt: skip
        return await asyncio.to_thread(self.store.mark_snapshot_ready, snap.id, size_bytes=info.image_bytes)

    async def upload(self, sb: SandboxRecord, snap: SnapshotRecord) -> SnapshotRecord:
        """Upload a full checkpoint the node holds to object storage (for recovery on any node)."""
        if sb.node_id is None:
            raise errors.InvalidState(f"sandbox {sb.id} is not on a node", state=sb.state.value)
        return await self.reconciler.upload_full_snapshot(sb, snap, sb.node_id)

    async def prune(self, sb: SandboxRecord, policy: retention.SnapshotPolicy) -> list[str]:
        snaps = await asyncio.to_thread(self.store.list_snapshots, sb.id)
        candidates = [s for s in snaps if s.state == "ready"]
        items = [
            retention.Item(s.id, s.created_at, s.kind, usable=s.kind == "full" and s.state == "ready")
            for s in candidates
        ]
        kept = retention.keep(items, policy.tiers, self.store.now())
        dropped = [s.id for s in candidates if s.id not in kept and s.origin in PRUNABLE_ORIGINS]
        # A snapshot the sandbox is suspended to or recovering from is never pruned.
        dropped = [i for i in dropped if i not in (sb.suspended_snapshot_id, sb.recovered_from)]
        # At most max_retained prunable snapshots stay, whatever the tiers keep (oldest go first).
        fulls = [s for s in candidates if s.kind == "full"]
        newest_full = max(fulls, key=lambda s: (s.created_at, s.id)).id if fulls else None
        protected = {newest_full, sb.suspended_snapshot_id, sb.recovered_from}
        remaining = [
            retention.Sized(s.id, s.created_at, 0, s.origin in PRUNABLE_ORIGINS and s.id not in protected)
            for s in candidates
            if s.id not in dropped
        ]
        dropped += retention.over_count(remaining, policy.max_retained)
        for snapshot_id in dropped:
            await asyncio.to_thread(self.store.delete_snapshot, snapshot_id)
        return dropped

    async def collect(self) -> int:
        """Remove the data of snapshots marked `deleting` (node copy, object-storage copy), then the row."""
        purged = 0
        for snap in await asyncio.to_thread(self.store.list_deleting_snapshots):
            try:
                await self._remove(snap)
            except (errors.SpaceError, TimeoutError) as exc:
                log.info("snapshot %s: not removed yet: %s", snap.id, exc)
                continue
            if await asyncio.to_thread(self.store.purge_snapshot, snap.id):
                purged += 1
        return purged

    async def _remove(self, snap: SnapshotRecord) -> None:
        rec = self.reconciler
        if snap.node_id is not None:
            sb = await asyncio.to_thread(self.store.load_sandbox, snap.sandbox_id)
            on_node = sb is not None and sb.node_id == snap.node_id and sb.state != State.DELETED
            if on_node and await rec.node_ready(snap.node_id):
                node = rec.nodes.client(snap.node_id)
                with contextlib.suppress(errors.NotFound):
                    await asyncio.wait_for(
                        node.delete_snapshot(snap.sandbox_id, snap.id), NODE_CALL_TIMEOUT_S
                    )
            elif on_node:
                raise errors.Unavailable(f"node {snap.node_id} is not ready")
            # Otherwise the sandbox left that node (or is gone): its node copies went with it.
        if snap.prefix is not None and rec.objects is not None:
            await asyncio.to_thread(delete_artifact, rec.objects, snap.prefix)

    async def sweep_objects(self) -> list[str]:
        """Remove artifacts under sandboxes/ that no record accounts for: the sandbox is deleted (or
        unknown) and the snapshot is not kept, or the snapshot has no row and is not the one a suspend is
        writing. They appear when a
        node finishes an upload after its snapshot was pruned or its sandbox deleted. Returns the removed
        prefixes. Lists the whole sandboxes/ tree: run it rarely."""
        rec = self.reconciler
        if rec.objects is None:
            return []
        objects = rec.objects
        keys = await asyncio.to_thread(objects.list, "sandboxes/")
        prefixes = sorted({"/".join(k.split("/")[:4]) for k in keys if k.count("/") >= 4})
        removed = []
        for prefix in prefixes:
            _root, _project, sandbox_id, snapshot_id = prefix.split("/")
            sb = await asyncio.to_thread(self.store.load_sandbox, sandbox_id)
            snap = await asyncio.to_thread(self.store.get_snapshot, snapshot_id)
            mine = snap is not None and snap.sandbox_id == sandbox_id
            owned = sb is not None and (
                (sb.state != State.DELETED and (mine or sb.suspended_snapshot_id == snapshot_id))
                # A named snapshot kept after its sandbox was deleted (ADR 0060): its row accounts for it.
                or (mine and snap is not None and kept(snap))
            )
            if owned:
                continue
            await asyncio.to_thread(objects.delete_prefix, prefix + "/")
            removed.append(prefix)
        if removed:
            log.info("removed %d artifact(s) nothing refers to: %s", len(removed), ", ".join(removed))
        return removed


_FULL_NOTICE = "scheduled snapshots paused"


async def report_lost_node_crashes(reconciler: Reconciler) -> list[str]:
    """No sandbox waits on a node that is gone (space.controlplane.reconciler.replan): every in-progress
    step on a lost or offline node is re-planned, and a sandbox live on a lost node that has a verified
    uploaded full checkpoint is marked crashed, so the reconciler recovers it on another node.
    Level-triggered: every gone node is looked at each round (a control plane that died right after marking
    a node lost does not strand its sandboxes)."""
    moved = await replan_gone_nodes(reconciler)
    if moved:
        reconciler.poke()
    return moved
