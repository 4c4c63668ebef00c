"""The reconciler: drives every sandbox's observed state toward its desired state, one idempotent step
at a time.

Invariants:
- Level-triggered: a step is chosen from the row as it is now (state, desired_state), never from an event
  that might have been lost; killing the process at any point and running again converges.
- Each step is: CAS into the in-progress state (recorded *before* the side effect) → an idempotent node
  call → CAS into the completed state. An in-progress state found on a claimed row (its previous owner died)
  simply repeats the node call, which is safe because node calls are idempotent by sandbox id.
- Work is claimed with leases (`Store.claim_work`), so several control planes on one database never work
  on the same sandbox at once. A lost CAS (Conflict) means someone else moved the row: drop it, re-read later.
- Transient failures (node unreachable, timeouts) back off exponentially; permanent ones (the table or the
  node refuses the request as invalid) take the table's `fail` edge and stop retrying until a new wish.
- Sandboxes a node runs that the database does not know (or knows as deleted, or as suspended, or as
  living on another node) are destroyed: no orphans, and never one sandbox running on two nodes.

Suspend, restore and crash recovery (issue 4; docs/adr/0013-suspend-restore-and-recovery-in-the-...):
- suspending: the snapshot id and object-store prefix are recorded on the sandbox, and the snapshot row
  (with its wrapped data key) is written, BEFORE the node is asked to suspend; a re-run reuses all three,
  so a killed control plane resumes the same upload with the same key. The snapshot becomes `restorable`
  only after its manifest was read back from the object store; only then does the record become
  `suspended` (node_id cleared), and then the node's paused copy is deleted (by this step, or by orphan
  collection if the step dies or the node is away). So `suspended` always means "a verified copy exists";
  a node copy of a suspended sandbox is an orphan.
- restoring: the target node is recorded before the node call; a corrupt artifact or a revoked key is a
  permanent failure: back to `suspended`, the error on the record, nothing booted.
- crashed (reported by the node's heartbeat, or its node was lost): recover from the newest usable full
  checkpoint: a local one on the same (ready) node, else the newest uploaded one on any node chosen by the
  scheduler; with none, stop and start again on the kept disk. The snapshot used and the target node are
  recorded with the `recover` transition, so a re-run repeats the same recovery.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from space.controlplane import failpoints
from space.controlplane.nodes import NodePool
from space.controlplane.scheduler import choose_node
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.ids import new_snapshot_id
from space.core.lifecycle import LIVE_STATES, Event, State, can
from space.crypto.envelope import DataKey
from space.node.rpc_client import NodeClient

if TYPE_CHECKING:
    from space.controlplane.keys import DataKeys
    from space.objectstore.base import ObjectStore

log = logging.getLogger(__name__)

LEASE_S = 8.0
BATCH = 16
MAX_BACKOFF_S = 30.0
ORPHAN_GRACE_S = 60.0
SUSPENDED_GRACE_S = 10.0  # see is_orphan_copy
NODE_CALL_TIMEOUT_S = 5.0
PERMANENT: tuple[type[errors.SpaceError], ...] = (
    errors.InvalidArgument,
    errors.InvalidState,
    errors.PermissionDenied,
    errors.TooLarge,
    errors.ArtifactCorrupt,  # never retried: the same bytes fail the same way; visible on the record
    errors.KeyRevoked,  # revoked on purpose: the data is meant to be unreadable
)
# A restore whose artifact is gone cannot succeed by retrying either.
RESTORE_PERMANENT: tuple[type[errors.SpaceError], ...] = (*PERMANENT, errors.NotFound)

NodeCall = Callable[[NodeClient, str], Awaitable[object]]


@dataclass(frozen=True)
class Step:
    start: Event | None  # None: the row is already in the in-progress state
    call: NodeCall
    done: Event


def _node_call(name: str) -> NodeCall:
    async def call(node: NodeClient, sandbox_id: str) -> object:
        return await getattr(node, name)(sandbox_id)

    return call


PAUSE = Step(Event.PAUSE, _node_call("pause"), Event.PAUSED)
RESUME = Step(Event.RESUME, _node_call("resume"), Event.RESUMED)
STOP = Step(Event.STOP, _node_call("stop"), Event.STOPPED)
START = Step(Event.START, _node_call("start"), Event.STARTED)

# (stable state, desired state) -> the step that moves toward it.
PLAN: dict[tuple[State, State], Step] = {
    (State.RUNNING, State.PAUSED): PAUSE,
    (State.PAUSED, State.RUNNING): RESUME,
    (State.RUNNING, State.STOPPED): STOP,
    (State.PAUSED, State.STOPPED): STOP,
    (State.STOPPED, State.RUNNING): START,
    (State.STOPPED, State.PAUSED): START,  # then pause, on the next round
    (State.CRASHED, State.STOPPED): STOP,
}
# In-progress state -> how to finish it (after a crash of whoever started it).
RESUME_STEP: dict[State, Step] = {
    State.PAUSING: Step(None, PAUSE.call, PAUSE.done),
    State.RESUMING: Step(None, RESUME.call, RESUME.done),
    State.STOPPING: Step(None, STOP.call, STOP.done),
    State.STARTING: Step(None, START.call, START.done),
}


def backoff(attempts: int) -> float:
    return float(min(MAX_BACKOFF_S, 0.25 * (2 ** min(attempts, 10))))


# (stable state, desired state) -> the event that starts a step implemented below (not a plain node call).
CUSTOM_PLAN: dict[tuple[State, State], Event] = {
    (State.RUNNING, State.SUSPENDED): Event.SUSPEND,
    (State.PAUSED, State.SUSPENDED): Event.SUSPEND,
    (State.SUSPENDED, State.RUNNING): Event.RESTORE,
    (State.SUSPENDED, State.PAUSED): Event.RESTORE,  # then pause, on the next round
    (State.SUSPENDED, State.STOPPED): Event.RESTORE,  # then stop
}
# Desired states from which a crashed sandbox is recovered (stopped: PLAN stops it instead).
RECOVER_FOR: frozenset[State] = frozenset({State.RUNNING, State.PAUSED, State.SUSPENDED})


def snapshot_prefix(sb: SandboxRecord, snapshot_id: str) -> str:
    """Where a snapshot of `sb` lives in object storage (one artifact per snapshot)."""
    return f"sandboxes/{sb.project_id}/{sb.id}/{snapshot_id}"


def sandbox_prefix(sb: SandboxRecord) -> str:
    return f"sandboxes/{sb.project_id}/{sb.id}/"


class Reconciler:
    def __init__(
        self,
        store: Store,
        nodes: NodePool,
        *,
        owner: str | None = None,
        interval: float = 0.05,
        objects: ObjectStore | None = None,
        store_url: str | None = None,
        data_keys: DataKeys | None = None,
    ) -> None:
        self.store = store
        self.nodes = nodes
        self.objects = objects
        self.store_url = store_url
        self.data_keys = data_keys
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"
        self.interval = interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._orphans: asyncio.Task[list[str]] | None = None
        # Deletes of node copies left behind by a finished suspend, running after the step (and its lease)
        # ended: sandbox id -> (node id, task). A restore onto that node in this process waits for it.
        self._freeing: dict[str, tuple[str, asyncio.Task[None]]] = {}
        #: Set (and replaced) whenever this reconciler moved a sandbox: waiters re-read without polling.
        self.changed = asyncio.Event()

    def poke(self) -> None:
        """Something changed (a request recorded a wish): look now instead of at the next tick."""
        self._wake.set()

    async def free_dead_leases(self) -> list[str]:
        """Leases of control planes on this host whose process is gone (same pid *and* start time) are
        freed at once instead of waiting LEASE_S; other hosts' leases simply expire."""
        freed = []
        host = socket.gethostname()
        for owner in await asyncio.to_thread(self.store.lease_owners):
            parts = owner.split(":")
            if len(parts) != 3 or parts[0] != host or owner == self.owner or not parts[1].isdigit():
                continue
            if process_start_time(int(parts[1])) != parts[2]:
                await asyncio.to_thread(self.store.clear_leases, owner)
                freed.append(owner)
        return freed

    async def run_forever(self) -> None:
        with contextlib.suppress(errors.SpaceError):
            freed = await self.free_dead_leases()
            if freed:
                log.info("freed the leases of dead control planes: %s", ", ".join(freed))
        while True:
            try:
                worked = await self.run_once()
            except Exception:
                log.exception("reconciler round failed")
                worked = 0
            if worked:
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval if worked else 0.5)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run_forever(), name="reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _node, task in list(self._freeing.values()):
            task.cancel()  # an abandoned copy is collected as an orphan

    async def run_once(self) -> int:
        claimed = await asyncio.to_thread(self.store.claim_work, self.owner, BATCH, LEASE_S)
        await asyncio.gather(*(self._work(record) for record in claimed))
        return len(claimed)

    async def _work(self, record: SandboxRecord) -> None:
        renewer = asyncio.create_task(self._renew(record.id))
        try:
            await self.reconcile(record)
        except errors.Conflict:
            log.debug("sandbox %s moved under us; it will be looked at again", record.id)
        except Exception:
            log.exception("reconciling %s failed unexpectedly", record.id)
        finally:
            renewer.cancel()
            with contextlib.suppress(errors.SpaceError):
                await asyncio.to_thread(self.store.release, record.id, self.owner)

    async def _renew(self, sandbox_id: str) -> None:
        """Keep the lease while a long step runs; leases can then be short, so a crashed control plane's
        work is taken over within LEASE_S."""
        while True:
            await asyncio.sleep(LEASE_S / 3)
            with contextlib.suppress(errors.SpaceError):
                await asyncio.to_thread(self.store.renew, sandbox_id, self.owner, LEASE_S)

    # -- one sandbox ----------------------------------------------------------------------------------------
    async def reconcile(self, sb: SandboxRecord) -> None:
        """Advance `sb` by as many steps as it takes to reach a stable state (or a failure)."""
        for _ in range(8):  # bounded: every loop either completes a step or returns
            nxt = await self._advance(sb)
            if nxt is None:
                return
            sb = nxt

    async def _transition(self, sb: SandboxRecord, event: Event, **fields: object) -> SandboxRecord:
        record = await asyncio.to_thread(
            self.store.transition, sb.id, sb.state, sb.generation, event, **fields
        )
        self._notify()
        return record

    def _notify(self) -> None:
        """Wake requests in this process that wait for a sandbox to settle (others poll the database)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def _advance(self, sb: SandboxRecord) -> SandboxRecord | None:
        if sb.state == State.DELETED:
            return None
        if sb.desired_state == State.DELETED and sb.state != State.DELETING:
            return await self._transition(sb, Event.DELETE)
        if sb.state == State.DELETING:
            return await self._guarded(sb, self._delete)
        if sb.expires_at is not None and sb.expires_at <= self.store.now():
            await asyncio.to_thread(self.store.set_desired, sb.id, State.DELETED)
            return await asyncio.to_thread(self.store.load_sandbox, sb.id)
        if sb.state == State.PENDING:
            return await self._transition(sb, Event.FORK if sb.forked_from else Event.CREATE)
        if sb.state == State.CREATING:
            return await self._guarded(sb, self._create)
        custom = self._custom_steps().get(sb.state)
        if custom is not None:
            return await self._guarded(sb, custom)
        step = RESUME_STEP.get(sb.state)
        if step is None:
            if sb.state == sb.desired_state or sb.error_permanent:
                return None
            if sb.state == State.CRASHED and sb.desired_state in RECOVER_FOR:
                return await self._guarded(sb, self._begin_recovery)
            start = CUSTOM_PLAN.get((sb.state, sb.desired_state))
            if start is not None:
                sb = await self._transition(sb, start)
                return await self._guarded(sb, self._custom_steps()[sb.state])
            step = PLAN.get((sb.state, sb.desired_state))
            if step is None:
                return None  # not reachable from here (e.g. failed): the API refuses such requests
            assert step.start is not None
            sb = await self._transition(sb, step.start)
        return await self._guarded(sb, lambda current: self._run_step(current, step))

    def _custom_steps(self) -> dict[State, Callable[[SandboxRecord], Awaitable[SandboxRecord | None]]]:
        return {
            State.SUSPENDING: self._suspend,
            State.RESTORING: self._restore,
            State.RECOVERING: self._recover,
        }

    async def _guarded(
        self, sb: SandboxRecord, effect: Callable[[SandboxRecord], Awaitable[SandboxRecord | None]]
    ) -> SandboxRecord | None:
        """Run a step's side effect; classify its failure as transient (retry later) or permanent (fail).

        The effect may have moved the record (a node chosen, recovery begun): the failure is recorded on
        the record as it is now, so a re-run neither loses the back-off nor fails a state it left."""
        restoring = (State.RESTORING, State.RECOVERING, State.CRASHED, State.SUSPENDED)
        permanent = RESTORE_PERMANENT if sb.state in restoring else PERMANENT
        try:
            return await effect(sb)
        except errors.Conflict:
            raise
        except errors.SpaceError as exc:
            current = await asyncio.to_thread(self.store.load_sandbox, sb.id)
            if current is None or current.state == State.DELETED:
                return None
            error = f"{exc.code}: {exc.message}"
            if isinstance(exc, permanent):
                log.warning("sandbox %s: %s failed permanently: %s", sb.id, current.state, exc.message)
                if can(current.state, Event.FAIL):
                    extra: dict[str, Any] = {}
                    if current.state == State.RESTORING:
                        extra["node_id"] = None  # nothing booted on the target; suspended = on no node
                    return await self._transition(
                        current, Event.FAIL, error=error, error_permanent=True, **extra
                    )
            else:
                log.info("sandbox %s: %s failed, will retry: %s", sb.id, current.state, exc.message)
            await asyncio.to_thread(
                self.store.record_failure,
                sb.id,
                error,
                retry_in_s=backoff(current.attempts),
                permanent=isinstance(exc, permanent),
                expected_generation=current.generation,
            )
            self._notify()
            return None

    async def _run_step(self, sb: SandboxRecord, step: Step) -> SandboxRecord:
        node = self._node_of(sb)
        await step.call(node, sb.id)
        return await self._transition(sb, step.done)

    def _node_of(self, sb: SandboxRecord) -> NodeClient:
        if sb.node_id is None:
            raise errors.Unavailable(f"sandbox {sb.id} has no node")
        return self.nodes.client(sb.node_id)

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

    async def _delete(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.node_id is not None and await self._node_ready(sb.node_id):
            with contextlib.suppress(errors.NotFound):  # the node no longer knows it: already gone
                await self._node_of(sb).delete_sandbox(sb.id)
        # A lost node's copy is collected as an orphan when it comes back. Snapshots: marked for deletion
        # (their node copies and objects are removed by SnapshotKeeper.collect), then the prefix itself,
        # which also takes any half-written upload whose row never got written.
        await asyncio.to_thread(self.store.delete_snapshots_of, sb.id)
        if self.objects is not None:
            await asyncio.to_thread(self.objects.delete_prefix, sandbox_prefix(sb))
        return await self._transition(sb, Event.DELETED)

    # -- object storage, keys ----------------------------------------------------------------------------
    def _objects(self) -> tuple[ObjectStore, str]:
        if self.objects is None or self.store_url is None:
            raise errors.InvalidArgument("this control plane has no object store configured (--store-url)")
        return self.objects, self.store_url

    async def _node_ready(self, node_id: str) -> bool:
        node = await asyncio.to_thread(self.store.get_node, node_id)
        return node is not None and node.status == "ready"

    async def _data_key(self, sb: SandboxRecord, snap: SnapshotRecord | None) -> DataKey | None:
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

    async def _verify_uploaded(self, snap_id: str, prefix: str) -> SnapshotRecord:
        """Read the manifest back from the object store; only then is the snapshot restorable."""
        from space.objectstore.artifacts import read_manifest

        objects, _url = self._objects()
        manifest = await asyncio.to_thread(read_manifest, objects, prefix)
        await asyncio.to_thread(self.store.mark_snapshot_ready, snap_id, manifest.total_stored_bytes)
        return await asyncio.to_thread(
            self.store.update_snapshot, snap_id, restorable=True, uploaded_at=self.store.now(),
            size_bytes=manifest.total_stored_bytes, error=None,
        )  # fmt: skip

    # -- suspend -----------------------------------------------------------------------------------------
    async def _suspend(self, sb: SandboxRecord) -> SandboxRecord:
        _objects, store_url = self._objects()
        if sb.suspended_snapshot_id is None or sb.suspended_prefix is None:
            chosen = new_snapshot_id()
            sb = await asyncio.to_thread(
                self.store.update_observed, sb.id, expected_generation=sb.generation,
                suspended_snapshot_id=chosen, suspended_prefix=snapshot_prefix(sb, chosen),
            )  # fmt: skip
            failpoints.hit("suspend.recorded")
        snapshot_id, prefix = sb.suspended_snapshot_id, sb.suspended_prefix
        assert snapshot_id is not None and prefix is not None
        snap = await asyncio.to_thread(self.store.get_snapshot, snapshot_id)
        key: DataKey | None = None
        if snap is None:
            key = await self._data_key(sb, None)
            snap = await asyncio.to_thread(
                self.store.create_snapshot, sb.id, "full", sb.node_id, snapshot_id=snapshot_id,
                prefix=prefix, origin="suspend", data_key_id=key.key_id if key else None,
                wrapped_key=base64.b64encode(key.wrapped).decode() if key else None,
            )  # fmt: skip
            failpoints.hit("suspend.row")
        elif not snap.restorable:
            key = await self._data_key(sb, snap)  # a re-run: the key recorded before the first call
        if not snap.restorable:
            if sb.node_id is None:
                raise errors.InvalidState(f"sandbox {sb.id} is suspending but on no node", state=sb.state)
            started = time.monotonic()
            await self._node_of(sb).suspend(
                sb.id, store_url=store_url, prefix=prefix, snapshot_id=snapshot_id, data_key=key
            )
            failpoints.hit("suspend.uploaded")
            snap = await self._verify_uploaded(snapshot_id, prefix)
            failpoints.hit("suspend.verified")
            log.info("sandbox %s: suspended to %s in %.2fs", sb.id, prefix, time.monotonic() - started)
        # Verified: now (and only now) the sandbox is suspended (on no node), then its node copy is freed.
        # If that delete fails or this process dies first, orphan collection removes the copy: a copy of a
        # suspended sandbox is an orphan by definition (is_orphan_copy).
        old_node = sb.node_id
        if old_node is not None:
            await asyncio.to_thread(self.store.forget_node_snapshots, sb.id, old_node)
        done = await self._transition(sb, Event.SUSPENDED, node_id=None)
        failpoints.hit("suspend.marked")
        if old_node is not None:
            # In the background: the node's delete of a paused runtime and its subvolumes takes a while, and
            # a restore to another node need not wait for it (nor for this step's lease).
            task = asyncio.create_task(self._free_copy(old_node, sb.id), name=f"free-{sb.id}")
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

    async def _free_copy(self, node_id: str, sandbox_id: str) -> None:
        """Best effort: delete a sandbox's copy on a node it no longer lives on."""
        if not await self._node_ready(node_id):
            return  # collected as an orphan when the node is back
        try:
            await asyncio.wait_for(self.nodes.client(node_id).delete_sandbox(sandbox_id), 60.0)
        except errors.NotFound:
            pass
        except (errors.SpaceError, TimeoutError) as exc:
            log.info(
                "sandbox %s: its copy on node %s stays until orphan collection: %s", sandbox_id, node_id, exc
            )

    # -- restore -----------------------------------------------------------------------------------------
    async def _place(self, sb: SandboxRecord) -> SandboxRecord:
        """Make sure sb has a ready target node recorded (before any node call)."""
        if sb.node_id is not None and await self._node_ready(sb.node_id):
            return sb
        node_id = await asyncio.to_thread(choose_node, self.store, sb)
        return await asyncio.to_thread(
            self.store.update_observed, sb.id, expected_generation=sb.generation, node_id=node_id
        )

    async def _restore_on_node(self, sb: SandboxRecord, snap: SnapshotRecord) -> None:
        """Restore sb from the uploaded snapshot on sb.node_id (idempotent: a running copy is kept)."""
        _objects, store_url = self._objects()
        if not snap.restorable or not snap.prefix:
            raise errors.NotFound(f"snapshot {snap.id} has no verified copy in object storage")
        node = self._node_of(sb)
        freeing = self._freeing.get(sb.id)
        if freeing is not None and freeing[0] == sb.node_id:
            await asyncio.shield(freeing[1])  # the suspended copy's delete goes first on that node
        # A stale copy of this sandbox on the target (a lost node that came back before orphan collection)
        # must not be mistaken for the restored one.
        with contextlib.suppress(errors.NotFound):
            observed = await node.get_sandbox(sb.id)
            if observed.exists and observed.state != State.RUNNING.value:
                await node.delete_sandbox(sb.id)
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

    # -- crash recovery ----------------------------------------------------------------------------------
    async def _recovery_source(self, sb: SandboxRecord) -> tuple[SnapshotRecord, bool] | None:
        """The newest usable full checkpoint and whether it is local to sb's (ready) node."""
        snaps = await asyncio.to_thread(self.store.list_snapshots, sb.id)
        node_ready = sb.node_id is not None and await self._node_ready(sb.node_id)
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
            if sb.node_id is not None and await self._node_ready(sb.node_id):
                # Nothing to recover from: processes start again on the kept disk (stop, then start).
                sb = await self._transition(
                    sb, Event.STOP, notice="crashed with no usable checkpoint: restarted on the kept disk"
                )
                return await self._run_step(sb, STOP)
            raise errors.Unavailable(f"sandbox {sb.id} crashed on a lost node and has no uploaded checkpoint")
        snap, local = source
        target = sb.node_id if local else None
        sb = await self._transition(sb, Event.RECOVER, recovered_from=snap.id, node_id=target)
        failpoints.hit("recover.begun")
        return await self._recover(sb)

    async def _recover(self, sb: SandboxRecord) -> SandboxRecord:
        if sb.recovered_from is None:
            raise errors.InvalidState(f"sandbox {sb.id} is recovering from nothing", state=sb.state)
        snap = await asyncio.to_thread(self.store.get_snapshot, sb.recovered_from)
        if snap is None or snap.state != "ready":
            raise errors.NotFound(f"checkpoint {sb.recovered_from} of sandbox {sb.id} is gone")
        started = time.monotonic()
        local = sb.node_id is not None and snap.node_id == sb.node_id and await self._node_ready(sb.node_id)
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
        return await self._transition(sb, Event.RECOVERED, recovered_at=self.store.now(), notice=notice)

    # -- orphans ---------------------------------------------------------------------------------------------
    def collect_orphans_soon(self) -> None:
        """Run an orphan collection now in the background (one at a time)."""
        if self._orphans is None or self._orphans.done():
            self._orphans = asyncio.create_task(self.collect_orphans(), name="collect-orphans")

    async def collect_orphans(self) -> list[str]:
        """Destroy sandboxes that run on a node but are unknown to (or deleted in) the database."""
        removed = []
        for node in await asyncio.to_thread(self.store.list_nodes, "ready"):
            client = self.nodes.client(node.id)
            try:
                observed = await asyncio.wait_for(client.list_sandboxes(guest=False), NODE_CALL_TIMEOUT_S)
            except (errors.SpaceError, TimeoutError):
                continue  # a hung node is the lost-node detector's business, not a reason to stall here
            for item in observed.sandboxes:
                record = await asyncio.to_thread(self.store.load_sandbox, item.id)
                if record is not None and is_orphan_copy(record, node.id, self.store.now()):
                    # Suspended, or moved to another node (restored or recovered there): this copy is stale
                    # however young it is (a restore on a node that came back makes a young copy).
                    with contextlib.suppress(errors.SpaceError):
                        await client.delete_sandbox(item.id)
                        removed.append(item.id)
                    continue
                if time.time() - item.created_at < ORPHAN_GRACE_S:
                    continue  # its record may still be on its way (e.g. a fork in flight)
                if record is None or record.state == State.DELETED or record.node_id not in (None, node.id):
                    with contextlib.suppress(errors.SpaceError):
                        await client.delete_sandbox(item.id)
                        removed.append(item.id)
        return removed


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


def crash_candidates(records: list[SandboxRecord]) -> list[SandboxRecord]:
    """Sandboxes of a lost node that can be recovered elsewhere (they are live there)."""
    return [sb for sb in records if sb.state in LIVE_STATES]


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if it does not exist): with the pid, it names
    one process uniquely even when pids are reused."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - tiny read
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]
