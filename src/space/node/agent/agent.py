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
- Suspend keeps the source: the sandbox stays on the node, paused (state `suspended`), until the caller
  deletes it after it recorded the upload as verified. Restore from object storage downloads and verifies
  every part before the driver touches anything; a failed restore leaves nothing of the sandbox behind.
- Suspend, upload and restore are repeatable: a repeat after a crash (of the agent, at any point) finds what
  is already done (the checkpoint on disk, the staged export, the manifest in the store) and finishes.
- Disk is bounded (space.core.disk, docs/adr/0027-disk-budgets.md): a snapshot or checkpoint starts only if
  the sandbox stays within its storage budget and the node above its free-space reserve, and one that
  turns out to exceed either is deleted again before the error is raised (nothing half-made stays); creates,
  forks and imports are refused below the reserve before anything is written. Suspend and recovery are
  exempt: they are how a node gets its disk back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from space.core import disk, errors
from space.core.ids import new_sandbox_id, new_snapshot_id, parse_sandbox_id, parse_snapshot_id
from space.core.lifecycle import LIVE_STATES, Event, State, transition
from space.core.settings import DiskReserve, SandboxLimits
from space.crypto.envelope import DataKey
from space.node.agent import transfer
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.drivers.base import Driver, Progress, SandboxSpec
from space.objectstore.artifacts import Manifest, read_manifest
from space.objectstore.base import ObjectStore

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
    #: The checkpoint a suspended sandbox is paused at (set when its suspend completed on this node).
    suspended_at: str | None = None

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
    def __init__(
        self, driver: Driver, *, store: ObjectStore | None = None, disk_reserve: DiskReserve | None = None
    ) -> None:
        self.driver = driver
        #: Free space the node keeps (NodeSettings.disk_reserve); `disk` is the last reading of its disk.
        self.disk_reserve = disk_reserve or DiskReserve()
        self.disk: dict[str, int] | None = None
        self.sandboxes: dict[str, SandboxHandle] = {}
        #: The object store this node was configured with: templates come from and go to it, and it is the
        #: only store suspend/restore requests may name (space.node.agent.server checks the URL).
        self.store = store
        # One restore (download + import) per sandbox id at a time, before its handle exists.
        self._restores: dict[str, asyncio.Lock] = {}

    # -- set-up ------------------------------------------------------------------------------------------
    async def prepare(
        self, templates: tuple[str, ...] = ("python",), progress: Progress | None = None
    ) -> None:
        await self.driver.prepare(progress)
        for name in templates:
            await self.ensure_template(name, progress)
            await self.ensure_warm(name, progress)

    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        """Make template `name` available. With an object store, a node that lacks the template base takes
        it from there (so every node holds the same base and deltas apply anywhere); a node that has the
        base's original stream and finds none in the store publishes it."""
        status = await self.driver.template_base_status() if self.store is not None else None
        if self.store is not None and status is not None:
            prefix = transfer.template_prefix(str(status["name"]), str(status["version"]))
            manifest = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
            if not status["present"] and manifest is not None:
                for attempt in range(3):
                    try:
                        await self._fetch_template_base(manifest, progress)
                        break
                    except errors.ArtifactCorrupt:
                        # Possibly another node re-publishing the same stream right now (its writer
                        # first clears stray parts): read the manifest again; a third failure is real.
                        if attempt == 2:
                            raise
                        await asyncio.sleep(2.0)
                        manifest = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
                        if manifest is None:
                            break
        info = await self.driver.ensure_template(name, progress)
        if self.store is not None and status is not None:
            status = await self.driver.template_base_status()
            assert status is not None
            prefix = transfer.template_prefix(str(status["name"]), str(status["version"]))
            exists = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
            if exists is None and status["present"] and status["publishable"]:
                await self._publish_template_base(prefix, progress)
        return info

    async def _fetch_template_base(self, manifest: Manifest, progress: Progress | None) -> None:
        assert self.store is not None
        if progress is not None:
            progress(f"space: fetching the template base from {manifest.prefix}")
        directory = await self.driver.prepare_base_import()
        try:
            await asyncio.to_thread(
                transfer.download, self.store, manifest, directory, data_key=None, skip=set()
            )
            await self.driver.import_template_base()
        finally:
            await self.driver.release_staging("base-import")

    async def _publish_template_base(self, prefix: str, progress: Progress | None) -> None:
        assert self.store is not None
        if progress is not None:
            progress(f"space: publishing the template base to {prefix}")
        try:
            staged = await self.driver.export_template_base()
            await asyncio.to_thread(
                transfer.upload, self.store, prefix, staged.directory, staged.files,
                data_key=None, metadata=staged.metadata,
            )  # fmt: skip
        except errors.SpaceError as exc:
            # Another node publishing the same original stream at the same moment (AlreadyExists, or its
            # manifest replacing ours before our read-back), or the store is down: this node works either
            # way, and the next node start publishes again if the store still lacks the base.
            log.warning("template base not published to %s: %s", prefix, exc.message)
        finally:
            await self.driver.release_staging("base-export")

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
        await self.check_reserve(f"creating sandbox {spec.sandbox_id}")
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
            what = f"disk snapshot of {handle.sandbox_id}"
            if handle.state == State.RUNNING:
                await handle.session.sync()  # first: what the guest still buffers counts too
            await self._check_growth(handle, what)
            record = SnapshotRecord(new_snapshot_id(), "disk", time.time())
            await self.driver.disk_snapshot(sandbox_id, record.snapshot_id)
            handle.snapshots[record.snapshot_id] = record
            await self._settle_growth(handle, record.snapshot_id, what)
            return record

    async def checkpoint(self, sandbox_id: str) -> SnapshotRecord:
        """A full checkpoint (processes, memory, files); the sandbox runs on afterwards."""
        handle = self.get(sandbox_id)
        async with handle.lock:
            what = f"full checkpoint of {handle.sandbox_id}"
            if handle.state == State.RUNNING:
                await self._check_growth(
                    handle,
                    what,
                    budget_bytes=self._last_image(handle),
                    reserve_bytes=self._image_bound(handle),
                )
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
            await self._settle_growth(handle, record.snapshot_id, what)
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

        await self.check_reserve(f"forking {count} children of {sandbox_id}")

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

    # -- suspend / upload / restore through object storage, recovery ---------------------------------------
    async def suspend(
        self,
        sandbox_id: str,
        *,
        store: ObjectStore,
        prefix: str,
        snapshot_id: str,
        data_key: DataKey | None,
    ) -> dict[str, Any]:
        """pause → full checkpoint `snapshot_id` → export (disk delta against the template base, image) →
        upload as an artifact under `prefix` (manifest last, read back) → state `suspended`. The sandbox
        stays here, paused, until the caller deletes it. A repeat whose manifest exists returns the same
        result; a repeat after a crash reuses the checkpoint and the export already on the node."""
        handle = self.get(sandbox_id)
        snapshot_id = parse_snapshot_id(snapshot_id)
        async with handle.lock:
            done = await asyncio.to_thread(transfer.existing_manifest, store, prefix)
            if done is not None:
                _check_same_snapshot(done, handle.sandbox_id, snapshot_id)
                if handle.state == State.SUSPENDED:
                    return _upload_result(done, snapshot_id, {})
                if handle.state == State.RUNNING:
                    raise errors.Conflict(
                        f"{prefix} holds checkpoint {snapshot_id}, but the sandbox ran on after it; suspend "
                        "it to a new prefix", prefix=prefix,
                    )  # fmt: skip
                handle.state = transition(handle.state, Event.SUSPEND)
                handle.state = transition(handle.state, Event.SUSPENDED)
                handle.suspended_at = snapshot_id
                return _upload_result(done, snapshot_id, {})
            if handle.state == State.RUNNING:
                await handle.session.sync()  # the guest's dirty file data reaches the disk snapshot

            async def effect() -> dict[str, Any]:
                timings: dict[str, float] = {}
                mark = time.monotonic()
                record = await self._checkpoint_paused(handle, snapshot_id)
                timings.update(record.timings)
                timings["checkpoint_total_ms"] = (time.monotonic() - mark) * 1000
                manifest, upload_timings = await self._upload(handle, snapshot_id, store, prefix, data_key)
                timings.update(upload_timings)
                return _upload_result(manifest, snapshot_id, timings)

            try:
                result: dict[str, Any] = await self._step(handle, Event.SUSPEND, Event.SUSPENDED, effect)
            except BaseException:
                # A failed suspend settles in `paused` (the lifecycle table): make the runtime match.
                with contextlib.suppress(errors.SpaceError):
                    await self.driver.pause(handle.sandbox_id)
                raise
            handle.suspended_at = snapshot_id
            return result

    async def _checkpoint_paused(self, handle: SandboxHandle, snapshot_id: str) -> SnapshotRecord:
        """The full checkpoint `snapshot_id`, leaving the sandbox paused; reused if an earlier attempt
        already made it (the runtime is then still paused at that very moment)."""
        record = await self._reusable_checkpoint(handle, snapshot_id)
        if record is None:
            record = SnapshotRecord(snapshot_id, "full", time.time())
            try:
                info, _channel = await self.driver.checkpoint(
                    handle.sandbox_id, snapshot_id, keep_running=True, leave_paused=True
                )
            except errors.AlreadyExists:
                # The killed attempt's checkpoint was still running in the helper when we looked: it has
                # finished now (the helper serialises verbs per sandbox). Use it, or clear a broken one.
                reused = await self._reusable_checkpoint(handle, snapshot_id)
                if reused is not None:
                    return reused
                with contextlib.suppress(errors.NotFound):
                    await self.driver.delete_snapshot(handle.sandbox_id, snapshot_id)
                info, _channel = await self.driver.checkpoint(
                    handle.sandbox_id, snapshot_id, keep_running=True, leave_paused=True
                )
            record.image_bytes, record.timings = info.image_bytes, info.timings
        handle.snapshots[snapshot_id] = record
        return record

    async def _reusable_checkpoint(self, handle: SandboxHandle, snapshot_id: str) -> SnapshotRecord | None:
        on_disk = {s["snapshot_id"]: s for s in await self.driver.list_snapshots(handle.sandbox_id)}
        existing = on_disk.get(snapshot_id)
        if existing is None:
            return None
        if existing["kind"] != "full":  # a disk-only leftover under this id (a checkpoint killed half-way)
            await self.driver.delete_snapshot(handle.sandbox_id, snapshot_id)
            return None
        if (await self.driver.state(handle.sandbox_id)).runtime != "paused":
            raise errors.Conflict(
                f"checkpoint {snapshot_id} exists but the sandbox ran on after it; suspend with a new "
                "snapshot id", snapshot_id=snapshot_id,
            )  # fmt: skip
        record = handle.snapshots.get(snapshot_id) or SnapshotRecord(
            snapshot_id, "full", float(existing["created_at"]), int(existing["image_bytes"])
        )
        handle.snapshots[snapshot_id] = record
        return record

    async def _upload(
        self,
        handle: SandboxHandle,
        snapshot_id: str,
        store: ObjectStore,
        prefix: str,
        data_key: DataKey | None,
    ) -> tuple[Manifest, dict[str, float]]:
        staged = await self.driver.export_snapshot(handle.sandbox_id, snapshot_id)
        spec = handle.spec
        metadata = {
            **staged.metadata,
            "template": spec.template,
            "limits": spec.limits.model_dump(),
            "source_created_at": handle.created_at,
            "snapshot_created_at": handle.snapshots[snapshot_id].created_at
            if snapshot_id in handle.snapshots
            else time.time(),
        }
        sandbox_json = json.dumps(
            {"template": spec.template, "limits": spec.limits.model_dump(), "env": dict(spec.env)}
        ).encode()
        manifest, timings = await asyncio.to_thread(
            transfer.upload, store, prefix, staged.directory, staged.files,
            data_key=data_key, metadata=metadata, extra={"sandbox.json": sandbox_json},
        )  # fmt: skip
        await self.driver.release_staging("export", handle.sandbox_id, snapshot_id)
        return manifest, {**staged.timings, **timings}

    async def upload_snapshot(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        store: ObjectStore,
        prefix: str,
        data_key: DataKey | None,
    ) -> dict[str, Any]:
        """Upload an existing full checkpoint (e.g. so a lost node's sandbox can be restored elsewhere);
        the sandbox keeps running. Idempotent: a manifest already at `prefix` for it is the result."""
        handle = self.get(sandbox_id)
        snapshot_id = parse_snapshot_id(snapshot_id)
        record = handle.snapshots.get(snapshot_id)
        if record is None or record.kind != "full":
            raise errors.NotFound(f"{snapshot_id} is not a full checkpoint of {sandbox_id} on this node")
        async with handle.lock:
            done = await asyncio.to_thread(transfer.existing_manifest, store, prefix)
            if done is not None:
                _check_same_snapshot(done, handle.sandbox_id, snapshot_id)
                return _upload_result(done, snapshot_id, {})
            manifest, timings = await self._upload(handle, snapshot_id, store, prefix, data_key)
            return _upload_result(manifest, snapshot_id, timings)

    async def restore_from_store(
        self,
        sandbox_id: str,
        *,
        store: ObjectStore,
        prefix: str,
        data_key: bytes | None,
        spec: SandboxSpec,
    ) -> SandboxHandle:
        """Run a suspended sandbox here from its artifact: download and verify every part, take in the disk
        delta (onto the template base) and the image, restore the processes, reseed. Idempotent: a sandbox
        that already runs here is returned as it is."""
        sandbox_id = parse_sandbox_id(sandbox_id)
        if spec.sandbox_id != sandbox_id:
            raise errors.InvalidArgument("spec.sandbox_id must be the sandbox being restored", field="spec")
        lock = self._restores.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            existing = self.sandboxes.get(sandbox_id)
            if existing is not None and existing.state == State.RUNNING and existing.channel is not None:
                await existing.session.reseed()  # cheap, and a copy adopted mid-restore may have missed it
                return existing
            manifest = await asyncio.to_thread(read_manifest, store, prefix)
            snapshot_id = _checkpoint_of(manifest, spec)
            if existing is not None:
                if await self._holds_paused_source(existing, snapshot_id):
                    return await self._resume_source(existing)
                if existing.state == State.SUSPENDED:
                    raise errors.Conflict(
                        f"sandbox {sandbox_id} is kept here suspended at {existing.suspended_at}, not at "
                        f"{snapshot_id}; delete it before restoring another checkpoint", state="suspended",
                    )  # fmt: skip
                # A half-restored copy adopted after a crash (or a stale copy): the artifact is the truth.
                await self.delete(sandbox_id)
            await self._check_base(manifest, spec)
            # The download is staged, then taken in: about twice its size at the peak.
            incoming = 2 * sum(entry.size for entry in manifest.entries.values())
            await self.check_reserve(f"importing sandbox {sandbox_id}", needed_bytes=incoming)
            await self._download_checkpoint(spec, snapshot_id, store, manifest, data_key)
            handle = SandboxHandle(sandbox_id, spec, State.SUSPENDED, time.time())
            self.sandboxes[sandbox_id] = handle
            async with handle.lock:

                async def effect() -> None:
                    await self.driver.import_snapshot(spec, snapshot_id)
                    handle.attach(await self.driver.restore(sandbox_id, snapshot_id))
                    await handle.session.reseed()

                try:
                    await self._step(handle, Event.RESTORE, Event.RESTORED, effect)
                except BaseException:
                    await self._close_channel(handle)
                    with contextlib.suppress(Exception):
                        await self.driver.destroy(sandbox_id)
                    self.sandboxes.pop(sandbox_id, None)
                    raise
            taken = manifest.metadata.get("snapshot_created_at")
            record = SnapshotRecord(snapshot_id, "full", float(taken) if taken else time.time())
            handle.snapshots[snapshot_id] = record
            return handle

    async def _holds_paused_source(self, handle: SandboxHandle, snapshot_id: str) -> bool:
        """Whether `handle` is the suspended source of the artifact, still paused at its checkpoint. (After
        an agent restart the node no longer knows which checkpoint a paused sandbox is at: then the copy
        is replaced from the artifact.)"""
        if handle.state != State.SUSPENDED or handle.suspended_at != snapshot_id:
            return False
        with contextlib.suppress(errors.SpaceError):
            observed = await self.driver.state(handle.sandbox_id)
            return observed.runtime == "paused" and observed.channel_open
        return False

    async def _resume_source(self, handle: SandboxHandle) -> SandboxHandle:
        """Restore onto the node that still keeps the paused source: it *is* the checkpointed state, so
        it runs on in place (no download), reseeded like any restored copy."""
        async with handle.lock:

            async def effect() -> None:
                await self.driver.resume(handle.sandbox_id)
                if handle.channel is None or handle.channel.closed:
                    handle.attach(await self.driver.connect(handle.sandbox_id))
                await handle.session.reseed()

            await self._step(handle, Event.RESTORE, Event.RESTORED, effect)
            handle.suspended_at = None
        return handle

    async def _check_base(self, manifest: Manifest, spec: SandboxSpec) -> None:
        """The node must hold the template base the delta was made against: fetch it if it is missing."""
        wanted = manifest.metadata.get("base_identity")
        if wanted is None:
            return
        status = await self.driver.template_base_status()
        if status is not None and not status["present"]:
            await self.ensure_template(spec.template)
            status = await self.driver.template_base_status()
        if status is not None and status.get("identity") != wanted:
            raise errors.NotFound(
                f"the checkpoint was made against template base {wanted}; this node has "
                f"{status.get('identity')}", field="base",
            )  # fmt: skip

    async def _download_checkpoint(
        self,
        spec: SandboxSpec,
        snapshot_id: str,
        store: ObjectStore,
        manifest: Manifest,
        data_key: bytes | None,
    ) -> None:
        directory = await self.driver.prepare_import(spec.sandbox_id, snapshot_id)
        try:
            await asyncio.to_thread(
                transfer.download, store, manifest, directory, data_key=data_key, skip={"sandbox.json"}
            )
        except BaseException:
            with contextlib.suppress(errors.SpaceError):
                await self.driver.release_staging("import", spec.sandbox_id, snapshot_id)
            raise

    async def recover_from_checkpoint(self, sandbox_id: str, snapshot_id: str | None = None) -> SandboxHandle:
        """crashed (or failed) → recovering → running, from a full checkpoint on this node (the newest one
        when none is named): processes and files as they were at that checkpoint, then reseeded. A sandbox
        adopted as `stopped` (runtime gone) is brought back the same way, as a rollback."""
        handle = self.get(sandbox_id)
        async with handle.lock:
            for snap in await self.driver.list_snapshots(handle.sandbox_id):
                handle.snapshots.setdefault(
                    snap["snapshot_id"],
                    SnapshotRecord(snap["snapshot_id"], snap["kind"], float(snap["created_at"]),
                                   int(snap["image_bytes"])),
                )  # fmt: skip
            fulls = sorted(
                (r for r in handle.snapshots.values() if r.kind == "full"), key=lambda r: r.created_at
            )
            if snapshot_id is not None:
                snapshot_id = parse_snapshot_id(snapshot_id)
                if snapshot_id not in {r.snapshot_id for r in fulls}:
                    raise errors.NotFound(f"{snapshot_id} is not a full checkpoint of {sandbox_id} here")
            elif fulls:
                snapshot_id = fulls[-1].snapshot_id
            else:
                raise errors.NotFound(f"sandbox {sandbox_id} has no full checkpoint on this node")
            chosen = snapshot_id

            async def effect() -> None:
                await self._close_channel(handle)
                handle.attach(await self.driver.restore(handle.sandbox_id, chosen))
                await handle.session.reseed()

            if handle.state == State.STOPPED:
                # Adopted after an agent restart with its runtime gone: the node cannot tell a crash from a
                # stop, the caller can. Bringing it back from a full checkpoint is then a rollback.
                await self._step(handle, Event.ROLLBACK, Event.ROLLED_BACK, effect)
            else:
                await self._step(handle, Event.RECOVER, Event.RECOVERED, effect)
            handle.crashed_at = None
            return handle

    async def snapshot_usage(self, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
        handle = self.get(sandbox_id)
        if snapshot_id not in handle.snapshots:
            raise errors.NotFound(f"snapshot {snapshot_id} of {sandbox_id} does not exist")
        return await self.driver.snapshot_usage(handle.sandbox_id, snapshot_id)

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


def _check_same_snapshot(manifest: Manifest, sandbox_id: str, snapshot_id: str) -> None:
    meta = manifest.metadata
    if meta.get("snapshot_id") != snapshot_id or meta.get("sandbox_id") != sandbox_id:
        raise errors.Conflict(
            f"{manifest.prefix} already holds checkpoint {meta.get('snapshot_id')} of "
            f"{meta.get('sandbox_id')}", prefix=manifest.prefix,
        )  # fmt: skip


def _upload_result(manifest: Manifest, snapshot_id: str, timings: dict[str, float]) -> dict[str, Any]:
    return {
        "snapshot_id": snapshot_id,
        "prefix": manifest.prefix,
        "stored_bytes": manifest.total_stored_bytes,
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }


def _checkpoint_of(manifest: Manifest, spec: SandboxSpec) -> str:
    """The snapshot id a checkpoint artifact holds, after checking it fits the sandbox to restore."""
    meta = manifest.metadata
    if meta.get("kind") != "full-checkpoint":
        raise errors.InvalidArgument(f"{manifest.prefix} is not a full checkpoint ({meta.get('kind')!r})")
    if meta.get("template") not in (None, spec.template):
        raise errors.InvalidArgument(
            f"{manifest.prefix} is a sandbox of template {meta.get('template')!r}, not {spec.template!r}",
            field="template",
        )
    try:
        return parse_snapshot_id(str(meta.get("snapshot_id")))
    except errors.InvalidArgument as exc:
        raise errors.ArtifactCorrupt(
            f"{manifest.prefix} names no valid snapshot id", part="manifest", reason="bad_metadata"
        ) from exc
