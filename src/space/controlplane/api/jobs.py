"""The control plane's periodic jobs, run by every replica that reconciles (`run_reconciler=True`).

Invariants:
- Each job runs in a loop of its own: a job that hangs (a node that does not answer) holds up nothing else,
  and a job that fails is logged and tried again at its next period.
- Every job is safe to run on several replicas at once (compare-and-swap on generations, leases, idempotent
  deletes). Jobs marked `once_per_cluster` must also not be DONE twice (two snapshot schedulers take two
  scheduled snapshots of one sandbox; two sweeps of the object store each list all of it): they run only
  on the replica that holds the leader lease LEADER_LEASE (ADR 0034).
- A replica acts as leader only until `Leadership.valid_until`: the monotonic time at which it STARTED its
  last successful claim plus half the lease. The lease in the database runs a full lease from the claim
  (stamped after that start), so the holder stops before any other replica can take over, as long as the
  replicas' clocks agree to within half a lease and their rates to a few percent.
- A replica marks nodes lost only once its housekeeping has run for node_lost_after_s (`warm_up_s`): after
  an outage of every replica, nodes are not declared lost for a silence nobody could have heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from space.controlplane.api.deps import Services
from space.controlplane.node_drain import drain_round
from space.controlplane.retention import RetentionSettings, purge_expired
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.snapshots import report_lost_node_crashes
from space.core import errors
from space.core.lifecycle import State

log = logging.getLogger(__name__)


LEADER_LEASE = "housekeeping"


@dataclass(frozen=True)
class Job:
    period_s: float
    work: Callable[[Services], Awaitable[object]]
    what: str  # for the log line of a failed run
    once_per_cluster: bool = False  # only the leader runs it
    #: Not before this replica's housekeeping has run this long (from its settings): a replica that just
    #: started has not yet had the chance to hear from the nodes.
    warm_up_s: Callable[[ControlPlaneSettings], float] = lambda _settings: 0.0


class Leadership:
    """This replica's view of the leader lease: claimed and renewed every third of the lease, held (for
    acting on it) until half a lease after the start of the last successful claim."""

    def __init__(self, services: Services, *, owner: str | None = None) -> None:
        self.services = services
        self.owner = owner or services.reconciler.owner
        self.lease_s = services.settings.leader_lease_s
        self.valid_until = 0.0  # monotonic
        self.leading = False

    def held(self) -> bool:
        return time.monotonic() < self.valid_until

    async def claim(self) -> bool:
        started = time.monotonic()
        won = await asyncio.to_thread(
            self.services.store.claim_leadership, LEADER_LEASE, self.owner, self.lease_s
        )
        self.valid_until = started + self.lease_s / 2 if won else 0.0
        if won != self.leading:
            log.info("replica %s %s the leader lease %r", self.owner, "took" if won else "lost", LEADER_LEASE)
            self.leading = won
        return won

    async def run(self) -> None:
        """Claim or renew until cancelled; a failed claim (database away) is logged and tried again, and
        this replica stops leading when its last claim's validity runs out."""
        while True:
            try:
                await self.claim()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping: claiming the leader lease failed")
            await asyncio.sleep(self.lease_s / 3)

    async def release(self) -> None:
        """Give the lease up (a clean stop): another replica takes over at its next claim."""
        self.valid_until = 0.0
        if self.leading:
            self.leading = False
            await asyncio.to_thread(self.services.store.release_leadership, LEADER_LEASE, self.owner)


async def pause_idle(services: Services) -> None:
    """Sandboxes idle past their idle_timeout_s are asked to pause."""
    store = services.store
    now = store.now()
    for node in await asyncio.to_thread(store.list_nodes, "ready"):
        for sb in await asyncio.to_thread(store.list_sandboxes_on_node, node.id):
            idle = (now - sb.last_activity_at).total_seconds()
            if (
                sb.idle_timeout_s
                and sb.state == State.RUNNING
                and sb.desired_state == State.RUNNING
                and idle > sb.idle_timeout_s
            ):
                services.forget(sb.id)
                with contextlib.suppress(errors.Conflict, errors.InvalidState):
                    await asyncio.to_thread(store.set_desired, sb.id, State.PAUSED, sb.generation)
                services.reconciler.poke()


async def _drain_nodes(services: Services) -> None:
    """Move sandboxes off the nodes an operator drains (space.controlplane.node_drain, ADR 0065)."""
    if await asyncio.to_thread(drain_round, services.store):
        services.reconciler.poke()


async def _mark_lost(services: Services) -> None:
    await asyncio.to_thread(services.store.mark_lost, services.settings.node_lost_after_s)


async def _purge(services: Services) -> None:
    await purge_expired(services.store, RetentionSettings.of(services.settings))


async def _scheduled_snapshots(services: Services) -> None:
    taken = await services.snapshots.run_policies()
    if taken:
        log.info("leader %s: took %d scheduled snapshots", services.reconciler.owner, taken)


JOBS: tuple[Job, ...] = (
    Job(1.0, pause_idle, "pausing idle sandboxes"),
    # A replica marks nodes lost only after one full loss timeout of its own: after an outage of every
    # replica, the nodes (which fenced if it lasted longer than their lease) get to report first.
    Job(1.0, _mark_lost, "marking lost nodes", warm_up_s=lambda settings: settings.node_lost_after_s),
    Job(5.0, lambda s: s.reconciler.collect_orphans(), "collecting orphans"),
    Job(1.0, _drain_nodes, "draining nodes"),
    Job(1.0, _scheduled_snapshots, "taking scheduled snapshots", once_per_cluster=True),
    Job(2.0, lambda s: s.snapshots.collect(), "removing deleted snapshots"),
    Job(
        300.0,
        lambda s: s.snapshots.sweep_objects(),
        "removing artifacts nothing refers to",
        once_per_cluster=True,
    ),
    Job(1.0, lambda s: report_lost_node_crashes(s.reconciler), "recovering lost nodes' sandboxes"),
    Job(600.0, _purge, "deleting expired idempotency and audit rows", once_per_cluster=True),
)


async def _every(services: Services, job: Job, leadership: Leadership) -> None:
    await asyncio.sleep(job.warm_up_s(services.settings))
    while True:
        await asyncio.sleep(job.period_s)
        if job.once_per_cluster and not leadership.held():
            continue
        try:
            await job.work(services)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("housekeeping: %s failed", job.what)


async def housekeeping(services: Services) -> None:
    """Run every job of JOBS until cancelled; the once-per-cluster ones only while this replica leads (the
    lease is given up when housekeeping is cancelled, so a clean stop hands over at once)."""
    leadership = Leadership(services)
    try:
        await asyncio.gather(leadership.run(), *(_every(services, job, leadership) for job in JOBS))
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(leadership.release())
