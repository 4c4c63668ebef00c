"""The node agent's sandbox manager: lifecycle per sandbox on this node, driven through a Driver.

Invariants:
- Every state change goes through space.core.lifecycle.transition: the in-progress state is recorded
  before the side effect starts, the completion (or `fail`) event after it; a request the table does not
  allow raises InvalidState naming the current state, before anything is touched.
- Operations on one sandbox are serialised by its lock; different sandboxes proceed in parallel.
- The node is the source of truth for what runs on it: `recover()` rebuilds the registry from the driver
  (runtime state + channel) after an agent restart, reconnecting to running sandboxes without touching them.
- A restored or forked sandbox is reseeded before it is handed out, so copies of one checkpoint never
  share random state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id, parse_sandbox_id, parse_snapshot_id
from space.core.lifecycle import LIVE_STATES, Event, State, transition
from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.drivers.base import Driver, Progress, SandboxSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class SnapshotRecord:
    snapshot_id: str
    kind: str  # "disk" | "full"
    created_at: float
    image_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class SandboxHandle:
    sandbox_id: str
    spec: SandboxSpec
    state: State
    created_at: float
    channel: GuestChannel | None = None
    snapshots: dict[str, SnapshotRecord] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    crashed_at: float | None = None

    def attach(self, channel: GuestChannel | None) -> None:
        """Adopt a new channel; if it ends without the node closing it, the runtime died: `crash`."""
        self.channel = channel
        if channel is not None:
            channel.on_lost = lambda reason: self._lost(channel, reason)

    def _lost(self, channel: GuestChannel, reason: str) -> None:
        if channel is not self.channel:
            return  # a channel we already replaced
        if self.state in LIVE_STATES and not self.lock.locked():
            log.warning("sandbox %s lost its runtime (%s): crashed", self.sandbox_id, reason)
            self.state = transition(self.state, Event.CRASH)
            self.crashed_at = time.time()

    @property
    def session(self) -> GuestSession:
        if self.channel is None or self.channel.closed:
            raise errors.InvalidState(
                f"sandbox {self.sandbox_id} has no running processes (state '{self.state}')",
                state=str(self.state),
            )
        return GuestSession(self.channel)


class NodeAgent:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.sandboxes: dict[str, SandboxHandle] = {}

    # -- set-up ------------------------------------------------------------------------------------------
    async def prepare(
        self, templates: tuple[str, ...] = ("python",), progress: Progress | None = None
    ) -> None:
        await self.driver.prepare(progress)
        for name in templates:
            await self.driver.ensure_template(name, progress)
            await self.ensure_warm(name, progress)

    async def ensure_warm(self, template: str, progress: Progress | None = None) -> None:
        """Give `template` a warm start: boot one sandbox of it, let its daemon finish initialising, take a
        full checkpoint, and hand that to the driver. Later creates restore it instead of booting."""
        if not self.driver.warm_supported or await self.driver.warm_ready(template):
            return
        if progress is not None:
            progress(f"preparing the warm start of template {template}")
        handle = await self.create(template, warm=False)
        try:
            session = handle.session
            await session.processes()  # loads the daemon's process code, as the first exec would
            await session.stat("/")  # and its file code
            record = await self.checkpoint(handle.sandbox_id)
            await self._close_channel(handle)
            await self.driver.adopt_warm(template, handle.sandbox_id, record.snapshot_id)
        finally:
            self.sandboxes.pop(handle.sandbox_id, None)
            with contextlib.suppress(errors.SpaceError):
                await self.driver.destroy(handle.sandbox_id)

    async def recover(self) -> list[str]:
        """Adopt what the node already runs (after an agent restart); returns the adopted ids."""
        adopted = []
        for observed in await self.driver.list():
            if observed.sandbox_id in self.sandboxes or not observed.exists:
                continue
            spec = observed.spec or SandboxSpec(sandbox_id=observed.sandbox_id)
            handle = SandboxHandle(observed.sandbox_id, spec, State.STOPPED, time.time())
            if observed.channel_open and observed.runtime in {"running", "paused"}:
                handle.state = State.RUNNING if observed.runtime == "running" else State.PAUSED
                if observed.runtime == "running":
                    handle.attach(await self.driver.connect(observed.sandbox_id))
            for snap in await self.driver.list_snapshots(observed.sandbox_id):
                handle.snapshots[snap["snapshot_id"]] = SnapshotRecord(
                    snap["snapshot_id"], snap["kind"], float(snap["created_at"]), int(snap["image_bytes"])
                )
            self.sandboxes[observed.sandbox_id] = handle
            adopted.append(observed.sandbox_id)
        return adopted

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
        try:
            result = await effect()
        except BaseException:
            with contextlib.suppress(errors.InvalidState):
                handle.state = transition(handle.state, Event.FAIL)
            raise
        handle.state = transition(handle.state, done)
        return result

    # -- create ----------------------------------------------------------------------------------------------
    async def create(
        self,
        template: str = "python",
        *,
        limits: SandboxLimits | None = None,
        env: dict[str, str] | None = None,
        sandbox_id: str | None = None,
        warm: bool = True,
    ) -> SandboxHandle:
        spec = SandboxSpec(
            sandbox_id=sandbox_id or new_sandbox_id(),
            template=template,
            limits=limits or SandboxLimits(),
            env=dict(env or {}),
        )
        if spec.sandbox_id in self.sandboxes:
            raise errors.AlreadyExists(f"sandbox {spec.sandbox_id} already exists")
        handle = SandboxHandle(spec.sandbox_id, spec, State.PENDING, time.time())
        self.sandboxes[spec.sandbox_id] = handle
        async with handle.lock:

            async def effect() -> None:
                channel = await self.driver.create_warm(spec) if warm and self.driver.warm_supported else None
                if channel is None:
                    await self.driver.create(spec)
                    handle.attach(await self.driver.start(spec.sandbox_id))
                    return
                handle.attach(channel)
                # Restored from the template's checkpoint: its own randomness and its own environment.
                await handle.session.reseed()
                if spec.env:
                    await handle.session.configure(spec.env)

            try:
                await self._step(handle, Event.CREATE, Event.CREATED, effect)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.driver.destroy(spec.sandbox_id)
                self.sandboxes.pop(spec.sandbox_id, None)
                raise
        return handle

    # -- pause / resume / stop / start ----------------------------------------------------------------------
    async def pause(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:
            await self._step(handle, Event.PAUSE, Event.PAUSED, lambda: self.driver.pause(sandbox_id))

    async def resume(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:

            async def effect() -> None:
                await self.driver.resume(sandbox_id)
                if handle.channel is None or handle.channel.closed:
                    handle.attach(await self.driver.connect(sandbox_id))

            await self._step(handle, Event.RESUME, Event.RESUMED, effect)

    async def stop(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:

            async def effect() -> None:
                await self._close_channel(handle)
                await self.driver.stop(sandbox_id)

            await self._step(handle, Event.STOP, Event.STOPPED, effect)

    async def start(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:

            async def effect() -> None:
                handle.attach(await self.driver.start(sandbox_id))

            await self._step(handle, Event.START, Event.STARTED, effect)

    # -- snapshots -------------------------------------------------------------------------------------------
    async def disk_snapshot(self, sandbox_id: str) -> SnapshotRecord:
        """A read-only snapshot of the files, after the guest flushed them; the sandbox keeps running."""
        handle = self.get(sandbox_id)
        async with handle.lock:
            if handle.state not in {State.RUNNING, State.PAUSED, State.STOPPED}:
                raise errors.InvalidState(
                    f"cannot snapshot a sandbox in state '{handle.state}'", state=str(handle.state),
                    event="snapshot",
                )  # fmt: skip
            if handle.state == State.RUNNING:
                await handle.session.sync()
            record = SnapshotRecord(new_snapshot_id(), "disk", time.time())
            await self.driver.disk_snapshot(sandbox_id, record.snapshot_id)
            handle.snapshots[record.snapshot_id] = record
            return record

    async def checkpoint(self, sandbox_id: str) -> SnapshotRecord:
        """A full checkpoint (processes, memory, files); the sandbox runs on afterwards."""
        handle = self.get(sandbox_id)
        async with handle.lock:
            record = SnapshotRecord(new_snapshot_id(), "full", time.time())

            async def effect() -> None:
                await handle.session.sync()
                info, channel = await self.driver.checkpoint(
                    sandbox_id, record.snapshot_id, keep_running=True
                )
                record.image_bytes = info.image_bytes
                record.timings = info.timings
                if channel is not None:
                    await self._close_channel(handle)
                    handle.attach(channel)

            try:
                await self._step(handle, Event.CHECKPOINT, Event.CHECKPOINTED, effect)
            except BaseException:
                await self._reconnect_if_running(handle)
                raise
            handle.snapshots[record.snapshot_id] = record
            return record

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> None:
        """Back to a snapshot: a full checkpoint brings processes back as they were; a disk snapshot brings
        the files back and restarts the processes from the template's init."""
        handle = self.get(sandbox_id)
        snapshot_id = parse_snapshot_id(snapshot_id)
        record = handle.snapshots.get(snapshot_id)
        if record is None:
            raise errors.NotFound(f"snapshot {snapshot_id} of sandbox {sandbox_id} does not exist")
        async with handle.lock:

            async def effect() -> None:
                await self._close_channel(handle)
                if record.kind == "full":
                    handle.attach(await self.driver.restore(sandbox_id, snapshot_id))
                    await handle.session.reseed()
                else:
                    await self.driver.stop(sandbox_id)
                    await self.driver.reset_rootfs(sandbox_id, snapshot_id)
                    handle.attach(await self.driver.start(sandbox_id))

            await self._step(handle, Event.ROLLBACK, Event.ROLLED_BACK, effect)

    async def fork(
        self, sandbox_id: str, *, snapshot_id: str | None = None, count: int = 1
    ) -> list[SandboxHandle]:
        """Children that continue the parent's processes and files from a full checkpoint (taken now when
        none is given); each child is reseeded and diverges independently."""
        parent = self.get(sandbox_id)
        if not 1 <= count <= 100:
            raise errors.InvalidArgument("count must be between 1 and 100", field="count")
        if snapshot_id is None:
            snapshot_id = (await self.checkpoint(sandbox_id)).snapshot_id
        record = parent.snapshots.get(snapshot_id)
        if record is None or record.kind != "full":
            raise errors.InvalidArgument(f"{snapshot_id} is not a full checkpoint of {sandbox_id}")

        async def one_child() -> SandboxHandle:
            child_spec = SandboxSpec(
                sandbox_id=new_sandbox_id(),
                template=parent.spec.template,
                limits=parent.spec.limits,
                env=dict(parent.spec.env),
            )
            child = SandboxHandle(child_spec.sandbox_id, child_spec, State.PENDING, time.time())
            self.sandboxes[child.sandbox_id] = child

            async def effect() -> None:
                child.attach(
                    await self.driver.restore(
                        child.sandbox_id, snapshot_id, source_sandbox_id=sandbox_id, limits=child_spec.limits
                    )
                )
                await child.session.reseed()

            async with child.lock:
                try:
                    await self._step(child, Event.FORK, Event.CREATED, effect)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self.driver.destroy(child.sandbox_id)
                    self.sandboxes.pop(child.sandbox_id, None)
                    raise
            return child

        return list(await asyncio.gather(*(one_child() for _ in range(count))))

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:
            if handle.snapshots.pop(snapshot_id, None) is None:
                raise errors.NotFound(f"snapshot {snapshot_id} of sandbox {sandbox_id} does not exist")
            await self.driver.delete_snapshot(sandbox_id, snapshot_id)

    # -- delete ----------------------------------------------------------------------------------------------
    async def delete(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:

            async def effect() -> None:
                await self._close_channel(handle)
                await self.driver.destroy(sandbox_id)

            await self._step(handle, Event.DELETE, Event.DELETED, effect)
            self.sandboxes.pop(sandbox_id, None)

    async def delete_all(self) -> None:
        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(errors.SpaceError):
                await self.delete(sandbox_id)

    async def close(self) -> None:
        """Disconnect from every sandbox; they keep running (the holders keep their channels)."""
        for handle in self.sandboxes.values():
            await self._close_channel(handle)
        await self.driver.close()

    # -- helpers ---------------------------------------------------------------------------------------------
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
