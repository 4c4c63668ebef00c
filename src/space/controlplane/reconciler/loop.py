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
- Sandboxes a node runs that the database does not know (or knows as deleted) are destroyed: no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from space.controlplane.nodes import NodePool
from space.controlplane.scheduler import choose_node
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.lifecycle import Event, State
from space.node.rpc_client import NodeClient

log = logging.getLogger(__name__)

LEASE_S = 8.0
BATCH = 16
MAX_BACKOFF_S = 30.0
ORPHAN_GRACE_S = 60.0
NODE_CALL_TIMEOUT_S = 5.0
PERMANENT = (errors.InvalidArgument, errors.InvalidState, errors.PermissionDenied, errors.TooLarge)

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


class Reconciler:
    def __init__(
        self, store: Store, nodes: NodePool, *, owner: str | None = None, interval: float = 0.05
    ) -> None:
        self.store = store
        self.nodes = nodes
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"
        self.interval = interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
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
        step = RESUME_STEP.get(sb.state)
        if step is None:
            if sb.state == sb.desired_state or sb.error_permanent:
                return None
            step = PLAN.get((sb.state, sb.desired_state))
            if step is None:
                return None  # not reachable by this control plane yet (e.g. suspend): the API refuses it
            assert step.start is not None
            sb = await self._transition(sb, step.start)
        return await self._guarded(sb, lambda current: self._run_step(current, step))

    async def _guarded(
        self, sb: SandboxRecord, effect: Callable[[SandboxRecord], Awaitable[SandboxRecord | None]]
    ) -> SandboxRecord | None:
        """Run a step's side effect; classify its failure as transient (retry later) or permanent (fail)."""
        try:
            return await effect(sb)
        except errors.Conflict:
            raise
        except PERMANENT as exc:
            log.warning("sandbox %s: %s failed permanently: %s", sb.id, sb.state, exc.message)
            return await self._transition(
                sb, Event.FAIL, error=f"{exc.code}: {exc.message}", error_permanent=True
            )
        except errors.SpaceError as exc:
            log.info("sandbox %s: %s failed, will retry: %s", sb.id, sb.state, exc.message)
            await asyncio.to_thread(
                self.store.record_failure,
                sb.id,
                f"{exc.code}: {exc.message}",
                retry_in_s=backoff(sb.attempts),
                expected_generation=sb.generation,
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
        if sb.node_id is not None:
            with contextlib.suppress(errors.NotFound):  # the node no longer knows it: already gone
                await self._node_of(sb).delete_sandbox(sb.id)
        return await self._transition(sb, Event.DELETED)

    # -- orphans ---------------------------------------------------------------------------------------------
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
                if time.time() - item.created_at < ORPHAN_GRACE_S:
                    continue  # its record may still be on its way (e.g. a fork in flight)
                record = await asyncio.to_thread(self.store.load_sandbox, item.id)
                if record is None or record.state == State.DELETED or record.node_id not in (None, node.id):
                    with contextlib.suppress(errors.SpaceError):
                        await client.delete_sandbox(item.id)
                        removed.append(item.id)
        return removed


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if it does not exist): with the pid, it names
    one process uniquely even when pids are reused."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - tiny read
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]
