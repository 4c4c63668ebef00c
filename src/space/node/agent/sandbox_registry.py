"""The node agent's registry of sandboxes and the bounds every step checks: the base the agent's layers
build on (space.node.agent.agent assembles them).

Invariants:
- Every state change goes through `_step`: the in-progress state is recorded before the side effect
  starts, the completion (or `fail`) event after it; a request the table does not allow raises
  InvalidState naming the current state, before anything is touched.
- `sandboxes` holds one handle per sandbox id this node runs; `get` is NotFound for any other.
- Disk is bounded (space.core.disk, docs/adr/0027-disk-budgets.md): a checkpoint starts only if the
  sandbox stays within its storage budget and the node above its free-space reserve (`_check_growth`; a
  disk snapshot, which shares every byte when taken, only within its count), and a snapshot or checkpoint
  that turns out to exceed either is deleted again before the error is raised (`_settle_growth`):
  nothing half-made stays. Creates, forks and imports are refused below the reserve (`check_reserve`)
  before anything is written.
- `incarnations` says which copy of each sandbox this node holds (space.node.agent.incarnations): requests
  naming another incarnation are refused, so a stale delete never removes a newer copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from space.core import disk, errors
from space.core.ids import parse_sandbox_id
from space.core.lifecycle import Event, transition
from space.core.settings import DiskReserve
from space.node.agent.incarnations import Incarnations
from space.node.agent.pools import WarmPools
from space.node.agent.sandbox_handle import SandboxHandle
from space.node.drivers.base import Driver
from space.objectstore.base import ObjectStore

log = logging.getLogger("space.node.agent.agent")
T = TypeVar("T")


class SandboxRegistry:
    """The sandboxes of this node, the driver that runs them, and the node's disk bounds."""

    def __init__(
        self, driver: Driver, *, store: ObjectStore | None = None, disk_reserve: DiskReserve | None = None
    ) -> None:
        self.driver = driver
        #: Free space the node keeps (NodeSettings.disk_reserve); `disk` is the last reading of its disk.
        self.disk_reserve = disk_reserve or DiskReserve()
        self.disk: dict[str, int] | None = None
        self.sandboxes: dict[str, SandboxHandle] = {}
        #: The incarnation of each copy here, persisted where the driver keeps the agent's state.
        self.incarnations = Incarnations(driver.state_file("incarnations.json"))
        #: The object store this node was configured with: templates come from and go to it, and it is the
        #: only store suspend/restore requests may name (space.node.agent.service checks the URL).
        self.store = store
        # One restore (download + import) per sandbox id at a time, before its handle exists.
        self._restores: dict[str, asyncio.Lock] = {}
        #: This node's warm pools (set by the agent's launcher when it keeps any; ADR 0047).
        self.pools: WarmPools | None = None
        #: Lifecycle steps running now: pool refills wait while there are any (space.node.agent.pools).
        self.steps_in_flight = 0
        #: Resumes after checkpoints running in the background (ADR 0077), referenced until they end.
        self._resumes: set[asyncio.Task[None]] = set()

    def get(self, sandbox_id: str) -> SandboxHandle:
        handle = self.sandboxes.get(parse_sandbox_id(sandbox_id))
        if handle is None:
            raise errors.NotFound(f"sandbox {sandbox_id} does not exist on this node")
        return handle

    # -- the lifecycle step runner --------------------------------------------------------------------------
    async def _step(
        self, handle: SandboxHandle, start: Event, done: Event, effect: Callable[[], Awaitable[T]]
    ) -> T:
        """start-event → in-progress state → effect → done-event, or `fail` if the effect raised."""
        handle.state = transition(handle.state, start)
        self.steps_in_flight += 1
        if self.pools is not None:
            self.pools.wake()  # the step's sandbox now counts: a pool may have to give way
        try:
            result = await effect()
        except BaseException:
            with contextlib.suppress(errors.InvalidState):
                handle.state = transition(handle.state, Event.FAIL)
            raise
        finally:
            self.steps_in_flight -= 1
            if self.pools is not None:
                self.pools.wake()  # room may have been freed
        handle.state = transition(handle.state, done)
        return result

    # -- channels ----------------------------------------------------------------------------------------
    async def _close_channel(self, handle: SandboxHandle) -> None:
        if handle.channel is not None:
            channel, handle.channel = handle.channel, None
            await channel.close()

    async def _reconnect_if_running(self, handle: SandboxHandle) -> None:
        if handle.channel is not None and not handle.channel.closed:
            return
        with contextlib.suppress(errors.SpaceError):
            observed = await self.driver.state(handle.sandbox_id)
            if observed.channel_open and observed.runtime == "running":
                handle.attach(await self.driver.connect(handle.sandbox_id))

    async def usage(self, sandbox_id: str) -> dict[str, Any]:
        self.get(sandbox_id)
        return await self.driver.usage(sandbox_id)

    # -- disk bounds (space.core.disk) --------------------------------------------------------------------
    async def disk_space(self) -> dict[str, int] | None:
        """The node's disk now ({"total_bytes", "free_bytes", "reserve_bytes"}), kept as `self.disk` for the
        heartbeat; None when the driver cannot tell."""
        try:
            measured = await self.driver.disk_space()
        except errors.SpaceError as exc:
            log.warning("free space of the node unavailable: %s", exc.message)
            return self.disk
        if measured is not None:
            measured = {**measured, "reserve_bytes": self.disk_reserve.bytes_for(measured["total_bytes"])}
        self.disk = measured
        return measured

    async def check_reserve(self, what: str, *, needed_bytes: int = 0) -> None:
        """StorageExhausted (naming free space and reserve) when `what` would eat into the node's reserve."""
        measured = await self.disk_space()
        if measured is None:
            return
        disk.check_reserve(
            free_bytes=measured["free_bytes"], total_bytes=measured["total_bytes"], needed_bytes=needed_bytes,
            reserve=self.disk_reserve, what=what,
        )  # fmt: skip

    async def storage(self, sandbox_id: str) -> dict[str, Any]:
        """What the sandbox keeps on this node against its budget: {"used_bytes", "budget_bytes", ...}."""
        handle = self.get(sandbox_id)
        usage = await self.driver.storage_usage(handle.sandbox_id) or {}
        return {**usage, "budget_bytes": handle.spec.limits.storage_mb * disk.MiB}

    @staticmethod
    def _last_image(handle: SandboxHandle) -> int:
        """The newest checkpoint image's size: what the next one will likely take (0: none yet)."""
        fulls = [r for r in handle.snapshots.values() if r.kind == "full" and r.image_bytes]
        return max(fulls, key=lambda r: r.created_at).image_bytes if fulls else 0

    def _image_bound(self, handle: SandboxHandle) -> int:
        """What a checkpoint image may take at most, as far as the node's reserve is concerned: it holds
        the sandbox's memory, so its limit (or a larger image seen before)."""
        return max(self._last_image(handle), handle.spec.limits.memory_mb * disk.MiB)

    async def _check_growth(
        self, handle: SandboxHandle, what: str, *, budget_bytes: int = 0, reserve_bytes: int = 0
    ) -> None:
        """Before a snapshot or checkpoint: count, budget and reserve (StorageExhausted naming them). The
        budget is checked with the likely size (the measurement afterwards is the bound), the node's
        reserve with the largest possible one (the node must never run out)."""
        disk.check_snapshot_count(handle.sandbox_id, len(handle.snapshots))
        # As of the last commit (no commit of its own: that would double a snapshot's cost); writes since
        # then are counted by the check after, which the snapshot's own commit makes exact.
        usage = await self.driver.storage_usage(handle.sandbox_id, fresh=False)
        if usage is not None:
            disk.check_budget(
                handle.sandbox_id, used_bytes=int(usage["used_bytes"]), needed_bytes=budget_bytes,
                budget_bytes=handle.spec.limits.storage_mb * disk.MiB, what=what,
            )  # fmt: skip
        await self.check_reserve(what, needed_bytes=reserve_bytes)

    async def _settle_growth(self, handle: SandboxHandle, snapshot_id: str, what: str) -> None:
        """After: a snapshot that took the sandbox over its budget or the node into its reserve is deleted
        again, then the error raised (estimates before are only estimates; this is the bound)."""
        try:
            await self._check_growth_after(handle, what)
        except errors.StorageExhausted:
            handle.snapshots.pop(snapshot_id, None)
            with contextlib.suppress(errors.NotFound):
                await self.driver.delete_snapshot(handle.sandbox_id, snapshot_id)
            raise

    async def _check_growth_after(self, handle: SandboxHandle, what: str) -> None:
        # Creating the snapshot flushed the sandbox's data and committed: the accounting is current.
        usage = await self.driver.storage_usage(handle.sandbox_id, fresh=False)
        if usage is not None:
            disk.check_budget(
                handle.sandbox_id, used_bytes=int(usage["used_bytes"]), needed_bytes=0,
                budget_bytes=handle.spec.limits.storage_mb * disk.MiB, what=what,
            )  # fmt: skip
        await self.check_reserve(what)
