"""Warm pools: sandboxes of a template started before anyone asks, so a create binds one instead of making
one (docs/adr/0047-warm-pools.md).

A member is restored from its template's warm checkpoint (root filesystem cloned, network slot attached,
daemon answering, the node's CA and proxy environment in place) under a runtime id of its own
(space.node.agent.runtime_names), with the pool's limits. A create of that template with those limits
takes one (`take`), and the agent binds it to the user's sandbox id: environment, egress policy, fresh
randomness (space.node.agent.sandbox_lifecycle).

Invariants:
- A member is used once: `take` removes it from the pool for good; a bind that fails destroys it. It is
  never returned to the pool, so nothing of one user ever reaches another.
- A member belongs to nobody until bound: no user environment, no egress policy (so no egress at all),
  not in the agent's registry, not reported to the control plane as a sandbox nor as unmanaged.
- Members hold room only while nothing else needs it: a refill starts only while one more fits the node
  beside its sandboxes and other members (`room`: memory and overcommitted CPUs, as the scheduler
  counts), and while the node's sandboxes and members do not fit (the scheduler placed a sandbox in room a
  member held: members are not in the heartbeat's `used`) the oldest ready member is destroyed. So pools
  never push a node past its capacity and never keep a placement out.
- Pools are refilled in the background, at most `fill_concurrency` members at a time (default 1); a fill
  waits (up to `fill_yield_s`) while a user's lifecycle step runs on this node, so a refill competes with
  user requests for the CPU at most that many restores at a time, and only when the node has been busy
  for that long.
- A member holds what its template's start command started: restored from the warm start, which has it;
  booted cold (no warm start), it runs the command itself once its daemon answers (a failure logged,
  never a failed fill; space.node.agent.template_start).
- Leftovers are destroyed at start (`clean_leftovers`): members recorded by an earlier agent (whose
  channels this process does not hold) are never adopted into the pool or as sandboxes; never leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial

from space.core import errors
from space.core.ids import new_sandbox_id, parse_template_name
from space.core.settings import SandboxLimits
from space.node.agent import template_start
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.drivers.base import Driver, SandboxSpec

log = logging.getLogger(__name__)

#: After a failed fill, the next one for that template waits this long, doubling up to the maximum.
FILL_BACKOFF_S = 1.0
FILL_BACKOFF_MAX_S = 60.0
#: How often a fill waiting for the node to be idle looks again.
IDLE_POLL_S = 0.01
#: How often a full pool, or one waiting for room on the node, looks again without being woken.
ROOM_POLL_S = 2.0


def parse_pool_sizes(value: str) -> dict[str, int]:
    """`"python=4,web=1"` -> {"python": 4, "web": 1}; InvalidArgument for anything else."""
    sizes: dict[str, int] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) > 256:
            raise errors.InvalidArgument(
                f"pool size {item!r}: expected TEMPLATE=N with N from 0 to 256", field="pools"
            )
        sizes[parse_template_name(name.strip(), field="pools")] = int(count)
    return sizes


@dataclass
class Member:
    runtime_id: str
    template: str
    limits: SandboxLimits
    channel: GuestChannel
    ready_at: float


class WarmPools:
    """The pools of one node agent: `WarmPools(driver_of, sizes, busy=...)`; `start()` runs the filler."""

    def __init__(
        self,
        driver_of: Callable[[], Driver],
        sizes: Mapping[str, int],
        *,
        busy: Callable[[], bool] = lambda: False,
        room: Callable[[SandboxLimits | None], bool] = lambda _limits: True,
        fill_yield_s: float = 0.5,
        fill_concurrency: int = 1,
        limits: SandboxLimits | None = None,
        before_fill: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        # The driver is read at each use: the egress wiring wraps the agent's driver after start-up.
        self._driver_of = driver_of
        # Awaited before each fill: a user template the node lacks is fetched first (ADR 0056); its
        # failure is a failed fill (backed off).
        self._before_fill = before_fill
        self.sizes = {parse_template_name(t): n for t, n in sizes.items()}
        self.limits = limits or SandboxLimits()
        self._busy = busy
        self._room = room
        self.fill_yield_s = fill_yield_s
        self.fill_concurrency = max(1, fill_concurrency)
        self._ready: dict[str, deque[Member]] = {t: deque() for t in self.sizes}
        self._filling: dict[str, int] = dict.fromkeys(self.sizes, 0)
        self._backoff: dict[str, float] = {}  # template -> monotonic time before which it is not filled
        self._last_delay: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Counters for the heartbeat and the benchmark: members bound, failed fills, lost members.
        self.stats = {"taken": 0, "fill_failures": 0, "lost": 0, "evicted": 0}
        self._discarding: set[asyncio.Task[None]] = set()

    # -- what the node reports -------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._ready.items()}

    def reserved(self) -> tuple[float, int, int]:
        """(cpus, memory MB, disk MB) held by members: ready, being filled or being destroyed."""
        held = sum(len(q) for q in self._ready.values()) + sum(self._filling.values()) + len(self._discarding)
        return held * self.limits.cpus, held * self.limits.memory_mb, held * self.limits.disk_mb

    # -- taking ------------------------------------------------------------------------------------------
    def take(self, template: str, limits: SandboxLimits) -> Member | None:
        """A ready member of `template` with exactly `limits` (the pool's), removed for good; None if none."""
        queue = self._ready.get(template)
        if not queue or limits != self.limits:
            return None
        member = queue.popleft()
        member.channel.on_lost = None
        self.stats["taken"] += 1
        self._wake.set()
        return member

    async def discard(self, member: Member) -> None:
        """Destroy a member that was taken and could not be bound (or was lost)."""
        driver = self._driver_of()
        with contextlib.suppress(errors.SpaceError, OSError):
            await member.channel.close()
        try:
            await driver.destroy(member.runtime_id)
        except errors.SpaceError as exc:
            log.warning("pooled runtime %s not destroyed: %s", member.runtime_id, exc.message)
        if driver.names is not None:
            driver.names.drop_member(member.runtime_id)

    # -- start-up and shut-down ----------------------------------------------------------------------------
    async def clean_leftovers(self) -> list[str]:
        """Destroy every member an earlier agent recorded (see the module invariants); returns their ids."""
        return await clean_leftovers(self._driver_of())

    def start(self) -> None:
        if self._task is None and any(self.sizes.values()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="warm-pools")

    async def close(self, *, destroy: bool = False) -> None:
        """Stop filling; with `destroy`, destroy the members too, ready or interrupted in their making (else
        the next start does)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        members = [m for q in self._ready.values() for m in q]
        for queue in self._ready.values():
            queue.clear()
        for member in members:
            with contextlib.suppress(errors.SpaceError, OSError):
                await member.channel.close()
        if destroy:
            await clean_leftovers(self._driver_of())

    # -- filling -------------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Look at the pools now (a lifecycle step ended: room may have been taken or freed)."""
        self._wake.set()

    def _give_way(self) -> None:
        """Destroy ready members, oldest first, while the node's sandboxes and members do not fit."""
        while not self._room(None):
            ready = [m for q in self._ready.values() for m in q]
            if not ready:
                return
            oldest = min(ready, key=lambda m: m.ready_at)
            self._ready[oldest.template].remove(oldest)
            oldest.channel.on_lost = None
            self.stats["evicted"] += 1
            log.info("warm pool %s: member %s destroyed to make room", oldest.template, oldest.runtime_id)
            task = asyncio.get_running_loop().create_task(self.discard(oldest))
            self._discarding.add(task)
            task.add_done_callback(self._discarding.discard)

    def _deficit(self) -> str | None:
        if not self._room(self.limits):
            return None  # looked at again when woken (a take, a step, a fill's end) or after ROOM_POLL_S
        now = time.monotonic()
        for template, size in self.sizes.items():
            if self._backoff.get(template, 0.0) > now:
                continue
            if len(self._ready[template]) + self._filling[template] < size:
                return template
        return None

    async def _run(self) -> None:
        fills: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._give_way()
                template = self._deficit() if len(fills) < self.fill_concurrency else None
                if template is None:
                    self._wake.clear()
                    now = time.monotonic()
                    waits = [b - now for b in self._backoff.values() if b > now] + [ROOM_POLL_S]
                    # asyncio.timeout, not wait_for: on 3.11 wait_for may swallow a cancellation that
                    # arrives as the event is set, and the pool would never stop.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(waits)):
                            await self._wake.wait()
                    continue
                await self._yield_to_users()
                self._filling[template] += 1  # counted before the fill starts: the deficit sees it
                fill = asyncio.get_running_loop().create_task(self._fill_one(template))
                fills.add(fill)
                fill.add_done_callback(partial(self._fill_done, fills))
        finally:
            for fill in fills:
                fill.cancel()
            await asyncio.gather(*fills, return_exceptions=True)

    def _fill_done(self, fills: set[asyncio.Task[None]], fill: asyncio.Task[None]) -> None:
        fills.discard(fill)
        self._wake.set()

    async def _yield_to_users(self) -> None:
        deadline = time.monotonic() + self.fill_yield_s
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(IDLE_POLL_S)

    async def _fill_one(self, template: str) -> None:
        driver = self._driver_of()
        names = driver.names
        assert names is not None, "WarmPools runs only over a driver that keeps them (launch.start_pools)"
        runtime_id = new_sandbox_id()
        try:
            if self._before_fill is not None:
                await self._before_fill(template)
            names.add_member(runtime_id, template)  # recorded before anything exists: never leaked
            spec = SandboxSpec(sandbox_id=runtime_id, template=template, limits=self.limits, env={})
            warm = await driver.warm_ready(template)
            channel = await driver.create_pooled(spec)
            if not warm:
                await _start_command(driver, template, channel)
        except (errors.SpaceError, OSError) as exc:
            self.stats["fill_failures"] += 1
            delay = min(self._backoff_delay(template), FILL_BACKOFF_MAX_S)
            self._backoff[template] = time.monotonic() + delay
            log.warning("warm pool %s: fill failed (%s); next try in %.0f s", template, exc, delay)
            with contextlib.suppress(errors.SpaceError):
                await driver.destroy(runtime_id)
            names.drop_member(runtime_id)
            return
        finally:
            self._filling[template] -= 1
        self._backoff.pop(template, None)
        self._last_delay.pop(template, None)
        member = Member(runtime_id, template, self.limits, channel, time.monotonic())
        channel.on_lost = lambda _reason: self._lost(member)
        self._ready[template].append(member)

    def _backoff_delay(self, template: str) -> float:
        delay = self._last_delay.get(template, FILL_BACKOFF_S / 2) * 2
        self._last_delay[template] = delay
        return delay

    def _lost(self, member: Member) -> None:
        """A ready member's runtime ended: out of the pool, destroyed, and the pool refilled."""
        queue = self._ready.get(member.template)
        if queue is None or member not in queue:
            return
        queue.remove(member)
        self.stats["lost"] += 1
        log.warning("warm pool %s: member %s lost its runtime", member.template, member.runtime_id)
        asyncio.get_running_loop().create_task(self.discard(member))
        self._wake.set()


async def _start_command(driver: Driver, template: str, channel: GuestChannel) -> None:
    """A member booted cold: its template's start command, as a cold create runs it (never fatal)."""
    try:
        command = await driver.start_command(template)
    except errors.SpaceError as exc:
        log.warning("warm pool %s: its start command could not be read: %s", template, exc.message)
        return
    if command is not None:
        await template_start.start(GuestSession(channel), template, command, driver.start_log)


async def clean_leftovers(driver: Driver) -> list[str]:
    """Destroy the pool members recorded in `driver.names` (left by an earlier agent); their ids."""
    names = driver.names
    if names is None:
        return []
    cleaned = []
    for runtime_id in names.members():
        try:
            await driver.destroy(runtime_id)
        except errors.SpaceError as exc:
            log.warning("leftover pooled runtime %s not destroyed: %s", runtime_id, exc.message)
            continue
        names.drop_member(runtime_id)
        cleaned.append(runtime_id)
    return cleaned
