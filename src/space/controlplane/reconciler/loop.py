"""The reconciler: drives every sandbox's observed state toward its desired state, one idempotent step
at a time.

This module is the driver: it claims work, chooses each sandbox's next step from the lifecycle table and
the plan (plan.py), runs it, and classifies its failure. The steps themselves live by family: creation.py,
suspension.py (suspend, restore), recovery.py, deletion.py (delete, orphans); what they share in
context.py.

Invariants:
- Level-triggered: a step is chosen from the row as it is now (state, desired_state), never from an event
  that might have been lost; killing the process at any point and running again converges.
- Each step is: CAS into the in-progress state (recorded *before* the side effect) → an idempotent node
  call → CAS into the completed state. An in-progress state found on a claimed row (its previous owner died)
  simply repeats the node call, which is safe because node calls are idempotent by sandbox id.
- Every in-progress state the reconciler can enter has exactly one effect (`_in_flight`); every stable
  state's next step comes from plan.NEXT_STEP, whose events are checked against the lifecycle table.
- Work is claimed with leases (`Store.claim_work`), so several control planes on one database never work
  on the same sandbox at once. Each claimed sandbox's steps run in a task of their own (at most
  MAX_IN_FLIGHT at once): a slow step (a teardown, an upload) never holds back the claim of another
  sandbox, which a poke makes at once (ADR 0087). A lost CAS (Conflict) means someone else moved the
  row: drop it, re-read later.
- Transient failures (node unreachable, timeouts) back off exponentially; permanent ones (the table or the
  node refuses the request as invalid) take the table's `fail` edge and stop retrying until a new wish.
- Sandboxes a node runs that the database does not know (or knows as deleted, or as suspended, or as
  living on another node) are destroyed: no orphans, and never one sandbox running on two nodes.
- The direct create path (`drive`, docs/adr/0046-direct-create-path.md): an API request that recorded a new
  sandbox takes its lease (`Store.hold`) and runs the very steps a claim would (`work_on`: lease renewed
  meanwhile, released after), so no pass of the loop is waited for, and no other replica's reconciler
  runs the same step; whatever it leaves undone (a failure with its back-off, a kill) the loop finishes.
- Leases of a dead control plane on this host (same pid *and* start time gone) are freed at start; other
  hosts' leases simply expire after LEASE_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from space.controlplane.nodes import NodePool
from space.controlplane.reconciler.context import log
from space.controlplane.reconciler.creation import CreationSteps
from space.controlplane.reconciler.deletion import DeletionSteps
from space.controlplane.reconciler.expiry import expire, expired
from space.controlplane.reconciler.plan import (
    NEXT_STEP,
    NODE_CALLS,
    RECOVER_FOR,
    backoff,
    permanent_failures,
)
from space.controlplane.reconciler.recovery import RecoverySteps
from space.controlplane.scheduler import DEFAULT_FRESH_S
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandbox_state import Note
from space.controlplane.store.store import Store
from space.core import errors, request_ids, tracing
from space.core.lifecycle import Event, State, can

if TYPE_CHECKING:
    from space.controlplane.keys import DataKeys
    from space.objectstore.base import ObjectStore

LEASE_S = 8.0
LAYER = tracing.Layer("space.controlplane")
BATCH = 16
#: The most steps one reconciler runs at once; a claim takes no more than there is room for.
MAX_IN_FLIGHT = 64
#: How long an idle loop waits for a poke before it looks again (back-offs and leases that expired).
IDLE_WAIT_S = 0.5
# Steps begun from a stable state that act on the sandbox's own node (not begun while it is gone).
NODE_BOUND = frozenset({Event.PAUSE, Event.RESUME, Event.STOP, Event.START, Event.SUSPEND})


Effect = Callable[[SandboxRecord], Awaitable[SandboxRecord | None]]


class Reconciler(CreationSteps, RecoverySteps, DeletionSteps):
    def __init__(
        self,
        store: Store,
        nodes: NodePool,
        *,
        owner: str | None = None,
        objects: ObjectStore | None = None,
        store_url: str | None = None,
        data_keys: DataKeys | None = None,
        node_fresh_s: float | None = DEFAULT_FRESH_S,
    ) -> None:
        super().__init__(
            store, nodes, objects=objects, store_url=store_url, data_keys=data_keys, node_fresh_s=node_fresh_s
        )
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Leases of direct steps (drive), given back just after their request answered.
        self._releasing: set[asyncio.Task[None]] = set()
        # Sandboxes this process is advancing (loop or drive): the lease owner is the same for both, so
        # this is what keeps a claim and a request of this process off one sandbox at once.
        self._busy: set[str] = set()
        # The loop's steps under way, by sandbox (each a claimed sandbox's `work_on`).
        self._working: dict[str, asyncio.Task[SandboxRecord | None]] = {}
        # Not after every release: a claim racing the next request for SQLite's write lock costs it more.
        self._poke_after_release = False
        # In-progress state -> the effect that (re)runs its step and reports its completion.
        self._in_flight: dict[State, Effect] = {
            State.CREATING: self._create,
            State.SUSPENDING: self._suspend,
            State.RESTORING: self._restore,
            State.RECOVERING: self._recover,
            State.DELETING: self._delete,
            State.ROLLING_BACK: self._abandoned_rollback,
            **dict.fromkeys(NODE_CALLS, self._run_node_step),
        }

    async def _abandoned_rollback(self, sb: SandboxRecord) -> SandboxRecord | None:
        """A rollback runs inside its API request, which holds the sandbox's lease; a `rolling_back` row the
        reconciler could claim was left by a control plane that died mid-way. Whether the node rolled back
        is unknown: the table's `fail` edge (crashed), then recovery from the newest checkpoint."""
        reason = "the control plane that ran this rollback stopped before it finished"
        note = Note("step.abandoned", reason, {"state": sb.state.value})
        return await self._transition(sb, Event.FAIL, notice=reason, note=note)

    def poke(self) -> None:
        """Something changed (a request recorded a wish): look now instead of at the next tick."""
        self._wake.set()
        # A direct step's lease not yet given back keeps its sandbox from this claim: look again after it.
        self._poke_after_release = bool(self._releasing)

    # -- the loop and its leases -----------------------------------------------------------------------------
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
            self._wake.clear()  # before the claim: a poke or a freed slot meanwhile is not lost
            try:
                worked = await self.start_claimed()
            except Exception:
                log.exception("reconciler round failed")
                worked = 0
            if worked:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_WAIT_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run_forever(), name="reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for working in list(self._working.values()):
            working.cancel()  # its step is cancelled and its lease given back (work_on)
        await asyncio.gather(*self._working.values(), return_exceptions=True)
        for _node, task in list(self._freeing.values()):
            task.cancel()  # an abandoned copy is collected as an orphan
        await asyncio.gather(*self._releasing, return_exceptions=True)  # a clean stop gives its leases back

    async def run_once(self) -> int:
        """One pass, waited for (tests and tools: the loop itself does not wait): the number claimed."""
        started = await self.start_claimed()
        await self.settle()
        return started

    async def start_claimed(self) -> int:
        """Claim what needs work, as much as there is room for, and start each sandbox's steps in a task of
        their own; the number started."""
        room = MAX_IN_FLIGHT - len(self._working)
        if room <= 0:
            return 0  # a step that ends wakes the loop
        claimed = await asyncio.to_thread(self.store.claim_work, self.owner, min(BATCH, room), LEASE_S)
        started = 0
        for record in claimed:
            stale = self._working.get(record.id)
            if stale is not None:
                # Its lease was free although a step of ours runs on it: taken away (the step re-planned, a
                # node gone) or expired. That step is over; its end gives the lease back, and the sandbox is
                # claimed afresh (its renewal cannot tell: this claim made the lease ours again).
                stale.cancel()
                continue
            if record.id in self._busy:
                continue  # a request drives it
            self._busy.add(record.id)  # now: the next claim must not start it twice
            working = asyncio.create_task(self.work_on(record), name=f"work-{record.id}")
            self._working[record.id] = working
            working.add_done_callback(functools.partial(self._ended, record.id))
            started += 1
        return started

    async def settle(self) -> None:
        """Until the loop's steps under way have ended."""
        while self._working:
            await asyncio.gather(*self._working.values(), return_exceptions=True)

    def _ended(self, sandbox_id: str, working: asyncio.Task[SandboxRecord | None]) -> None:
        full = len(self._working) >= MAX_IN_FLIGHT
        if self._working.get(sandbox_id) is working:
            del self._working[sandbox_id]
        if full or working.cancelled():
            self._wake.set()  # room again, or a sandbox to claim afresh

    @property
    def request_lease(self) -> tuple[str, float]:
        """(owner, seconds) of the lease a request that drives a step takes with its wish
        (Store.set_desired's `hold`; then drive(record) finds it held and takes it no second time)."""
        return self.owner, LEASE_S

    async def drive(self, record: SandboxRecord) -> SandboxRecord | None:
        """Take `record`'s lease and advance it now (an API request's direct path); None when another owner
        holds the lease (its work is under way elsewhere) or the step did not end in a record. The lease
        is given back just after the answer (the request need not wait for that transaction). A record
        whose lease this process holds already (taken with the wish: `request_lease`) costs no hold."""
        if record.id in self._busy:
            return None
        self._busy.add(record.id)  # before the hold: the loop of this process may claim it meanwhile
        try:
            held = record.lease_owner == self.owner or await asyncio.to_thread(
                self.store.hold, record.id, self.owner, LEASE_S
            )
        except BaseException:
            self._busy.discard(record.id)
            raise
        if not held:
            self._busy.discard(record.id)
            return None
        return await self.work_on(record, release_later=True)  # busy until it ends

    async def work_on(self, record: SandboxRecord, *, release_later: bool = False) -> SandboxRecord | None:
        """Advance a sandbox whose lease this process holds, renewing the lease meanwhile and releasing it
        after (`release_later`: in a task of its own, so the caller answers first); the record as the last
        step left it (None if a step failed or lost a race)."""
        self._busy.add(record.id)
        # The step's log lines and node calls name the request driving it (or a step id) and the sandbox.
        context = request_ids.step_context(record.id)
        step = asyncio.create_task(self.reconcile(record), name=f"step-{record.id}", context=context)
        renewer = asyncio.create_task(self._renew(record.id, step))
        try:
            return await step
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                step.cancel()  # this reconciler is stopping
                raise
            log.info("sandbox %s: its lease was taken (its step re-planned): step abandoned", record.id)
        except errors.Conflict:
            log.debug("sandbox %s moved under us; it will be looked at again", record.id)
        except Exception:
            log.exception("reconciling %s failed unexpectedly", record.id)
        finally:
            renewer.cancel()
            self._busy.discard(record.id)
            if release_later:
                releasing = asyncio.create_task(self._release(record.id), name=f"release-{record.id}")
                self._releasing.add(releasing)
                releasing.add_done_callback(self._releasing.discard)
            else:
                await self._release(record.id)
        return None

    async def _release(self, sandbox_id: str) -> None:
        # Shielded, and tracked for `stop` to wait on: a stop that cancels a step's task must not cancel the
        # release behind it (a lease left to expire keeps its sandbox from every replica for LEASE_S).
        releasing = asyncio.ensure_future(self._give_back(sandbox_id))
        self._releasing.add(releasing)
        releasing.add_done_callback(self._releasing.discard)
        await asyncio.shield(releasing)
        if self._poke_after_release:  # a wish recorded while it was held (a pause right after a create)
            self._poke_after_release = False
            self._wake.set()

    async def _give_back(self, sandbox_id: str) -> None:
        with contextlib.suppress(errors.SpaceError):
            await asyncio.to_thread(self.store.release, sandbox_id, self.owner)

    async def _renew(self, sandbox_id: str, step: asyncio.Task[Any]) -> None:
        """Keep the lease while a long step runs; leases can then be short, so a crashed control plane's
        work is taken over within LEASE_S. A lease that was taken away (its step re-planned because the
        node is gone) ends the step: nothing waits on a node that is gone."""
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                renewed = await asyncio.to_thread(self.store.renew, sandbox_id, self.owner, LEASE_S)
            except errors.SpaceError:
                continue
            if not renewed:
                step.cancel()
                return

    # -- one sandbox -----------------------------------------------------------------------------------------
    async def reconcile(self, sb: SandboxRecord) -> SandboxRecord | None:
        """Advance `sb` by as many steps as it takes to reach a stable state (or a failure); the record
        as the last completed step left it (None when a step failed: its row says why)."""
        for _ in range(8):  # bounded: every loop either completes a step or returns
            # One span per move (a new trace in the loop, a child of the request on the direct path).
            with LAYER.span(f"reconcile.{sb.state.value}", root=True, sandbox_id=sb.id, state=sb.state.value):
                nxt = await self._advance(sb)
            if nxt is None:
                return sb if sb.state == sb.desired_state else None
            sb = nxt
        return None

    async def _advance(self, sb: SandboxRecord) -> SandboxRecord | None:
        """One move: a wish to delete first, then a passed deadline (its on_timeout), then the step in
        progress (re-run), else the next step planned from this stable state."""
        if sb.state == State.DELETED:
            return None
        if sb.desired_state == State.DELETED and sb.state != State.DELETING:
            return await self._transition(sb, Event.DELETE)
        if expired(sb, self.store.now()):  # deleted, or kept suspended/paused: its on_timeout (expiry.py)
            moved = await expire(self.store, sb, can_suspend=self.objects is not None)
            if moved is not None:
                return moved
        effect = self._in_flight.get(sb.state)
        if effect is not None:
            return await self._guarded(sb, effect)
        return await self._next_step(sb)

    async def _next_step(self, sb: SandboxRecord) -> SandboxRecord | None:
        """From a stable state: begin the step toward the desired state (CAS into its in-progress state,
        then its effect), or nothing when it is there, failed for good, or cannot get there."""
        if sb.state == State.PENDING:
            return await self._begin_create(sb)
        if sb.state == sb.desired_state or sb.error_permanent:
            return None
        if sb.state == State.CRASHED and sb.desired_state in RECOVER_FOR:
            return await self._guarded(sb, self._begin_recovery)
        start = NEXT_STEP.get((sb.state, sb.desired_state))
        if start is None:
            return None  # not reachable from here (e.g. failed): the API refuses such requests
        if start in NODE_BOUND and sb.node_id is not None and await self.node_gone(sb.node_id):
            # Never begin a step on a node that is gone: the sandbox stays in its stable state, the reason
            # on the record, until the node returns (or a recovery moves it).
            gone = errors.Unavailable(f"node {sb.node_id} of sandbox {sb.id} is gone (lost or offline)")
            return await self._failed(sb, gone, permanent=False)
        sb = await self._transition(sb, start)
        return await self._guarded(sb, self._in_flight[sb.state])

    async def _guarded(self, sb: SandboxRecord, effect: Effect) -> SandboxRecord | None:
        """Run a step's side effect; classify its failure as transient (retry later) or permanent (fail).

        The effect may have moved the record (a node chosen, recovery begun): the failure is recorded on
        the record as it is now, so a re-run neither loses the back-off nor fails a state it left."""
        permanent = permanent_failures(sb.state)
        try:
            return await effect(sb)
        except errors.Conflict:
            raise
        except errors.SpaceError as exc:
            current = await asyncio.to_thread(self.store.load_sandbox, sb.id)
            if current is None or current.state == State.DELETED:
                return None
            return await self._failed(current, exc, permanent=isinstance(exc, permanent))

    async def _failed(
        self, current: SandboxRecord, exc: errors.SpaceError, *, permanent: bool
    ) -> SandboxRecord | None:
        """Record a step's failure: a permanent one takes the table's `fail` edge where there is one;
        otherwise (or also) the failure and its back-off go on the record."""
        error = f"{exc.code}: {exc.message}"
        if permanent:
            log.warning("sandbox %s: %s failed permanently: %s", current.id, current.state, exc.message)
            if can(current.state, Event.FAIL):
                extra: dict[str, Any] = {}
                if current.state == State.RESTORING:
                    # Nothing booted on the target; suspended = on no node (and no copy's incarnation).
                    extra.update(node_id=None, incarnation=None)
                return await self._transition(
                    current, Event.FAIL, error=error, error_code=exc.code, error_permanent=True, **extra
                )
        else:
            log.info("sandbox %s: %s failed, will retry: %s", current.id, current.state, exc.message)
        await asyncio.to_thread(
            self.store.record_failure,
            current.id,
            error,
            code=exc.code,
            retry_in_s=backoff(current.attempts),
            permanent=permanent,
            expected_generation=current.generation,
        )
        self._notify()
        return None


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if it does not exist): with the pid, it names
    one process uniquely even when pids are reused."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - tiny read
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]
