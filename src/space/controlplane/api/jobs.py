"""The control plane's periodic jobs, run by every replica that reconciles (`run_reconciler=True`).

Invariants:
- Each job runs in a loop of its own: a job that hangs (a node that does not answer) holds up nothing else,
  and a job that fails is logged and tried again at its next period.
- Every job is safe to run on several replicas at once (compare-and-swap on generations, leases, idempotent
  deletes), so replicas need no leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from space.controlplane.api.deps import Services
from space.controlplane.retention import RetentionSettings, purge_expired
from space.controlplane.snapshots import report_lost_node_crashes
from space.core import errors
from space.core.lifecycle import State

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    period_s: float
    work: Callable[[Services], Awaitable[object]]
    what: str  # for the log line of a failed run


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


async def _mark_lost(services: Services) -> None:
    await asyncio.to_thread(services.store.mark_lost, services.settings.node_lost_after_s)


async def _purge(services: Services) -> None:
    await purge_expired(services.store, RetentionSettings.of(services.settings))


JOBS: tuple[Job, ...] = (
    Job(1.0, pause_idle, "pausing idle sandboxes"),
    Job(1.0, _mark_lost, "marking lost nodes"),
    Job(5.0, lambda s: s.reconciler.collect_orphans(), "collecting orphans"),
    Job(1.0, lambda s: s.snapshots.run_policies(), "taking scheduled snapshots"),
    Job(2.0, lambda s: s.snapshots.collect(), "removing deleted snapshots"),
    Job(300.0, lambda s: s.snapshots.sweep_objects(), "removing artifacts nothing refers to"),
    Job(1.0, lambda s: report_lost_node_crashes(s.reconciler), "recovering lost nodes' sandboxes"),
    Job(600.0, _purge, "deleting expired idempotency and audit rows"),
)


async def _every(services: Services, job: Job) -> None:
    while True:
        await asyncio.sleep(job.period_s)
        try:
            await job.work(services)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("housekeeping: %s failed", job.what)


async def housekeeping(services: Services) -> None:
    """Run every job of JOBS until cancelled."""
    await asyncio.gather(*(_every(services, job) for job in JOBS))
