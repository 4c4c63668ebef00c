"""The node agent's snapshot verbs: disk snapshots, full checkpoints, rollback, fork, recovery from a
checkpoint on this node.

Invariants:
- A restored or forked sandbox is reseeded before it is handed out, so copies of one checkpoint never
  share random state.
- A fork child that fails to come up leaves nothing behind (driver leftovers destroyed, id unregistered).
- Snapshots and checkpoints are bounded by the sandbox's storage budget and the node's reserve (checked
  before, settled after: space.node.agent.sandbox_registry); recovery is exempt (it is how a node gets
  its sandboxes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from space.core import disk, errors
from space.core.ids import new_sandbox_id, new_snapshot_id, parse_snapshot_id
from space.core.lifecycle import Event, State, transition
from space.node.agent.guest import GuestSession
from space.node.agent.sandbox_handle import SandboxHandle, SnapshotRecord
from space.node.agent.sandbox_lifecycle import SandboxLifecycle
from space.node.drivers.base import SandboxSpec

log = logging.getLogger("space.node.agent.agent")


class SandboxSnapshots(SandboxLifecycle):
    """Snapshot, checkpoint, rollback and fork verbs over the lifecycle."""

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
            # Taken, a disk snapshot shares every byte with the sandbox and needs none of the node's free
            # space: the budget and reserve checks before it could refuse only what the exact ones after it
            # refuse too (deleting it again), so only the count is checked first (two helper calls fewer).
            disk.check_snapshot_count(handle.sandbox_id, len(handle.snapshots))
            record = SnapshotRecord(new_snapshot_id(), "disk", time.time())
            await self.driver.disk_snapshot(sandbox_id, record.snapshot_id)
            handle.snapshots[record.snapshot_id] = record
            await self._settle_growth(handle, record.snapshot_id, what)
            return record

    async def checkpoint(self, sandbox_id: str) -> SnapshotRecord:
        """A full checkpoint (processes, memory, files); the sandbox runs on afterwards. With a driver that
        can (`resumes_after_checkpoint`), the runtime is left paused by the checkpoint and resumed in the
        background, still under the sandbox's lock: the answer (and a fork's children, restored from the
        checkpoint) need not wait for the resume, every later step on the sandbox waits for it, and calls
        over its channel meanwhile are answered once it runs (ADR 0077)."""
        handle = self.get(sandbox_id)
        apart = self.driver.resumes_after_checkpoint
        paused_by_us = False
        await handle.lock.acquire()
        try:
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
                nonlocal paused_by_us
                await handle.session.sync()
                paused_by_us = apart  # from here on the checkpoint may have paused it, even if it fails
                info, channel = await self.driver.checkpoint(
                    sandbox_id, record.snapshot_id, keep_running=True, leave_paused=apart
                )
                record.image_bytes = info.image_bytes
                record.timings = info.timings
                if channel is not None:
                    await self._close_channel(handle)
                    handle.attach(channel)

            try:
                await self._step(handle, Event.CHECKPOINT, Event.CHECKPOINTED, effect)
            except BaseException:
                if paused_by_us:
                    paused_by_us = False
                    with contextlib.suppress(errors.SpaceError):
                        await self.driver.resume(sandbox_id)  # whatever the failed checkpoint left paused
                await self._reconnect_if_running(handle)
                raise
            handle.snapshots[record.snapshot_id] = record
            await self._settle_growth(handle, record.snapshot_id, what)
            return record
        finally:
            if paused_by_us:
                self._resume_after_checkpoint(handle)  # releases the lock once resumed
            else:
                handle.lock.release()

    def _resume_after_checkpoint(self, handle: SandboxHandle) -> None:
        """Resume `handle`'s runtime, paused by its checkpoint, in the background; the sandbox's lock (held
        by the caller, handed over here) is released once it runs. A resume that fails leaves the sandbox
        recorded as paused, which it is (a resume request tries again), never as running."""

        async def resume() -> None:
            try:
                await self.driver.resume(handle.sandbox_id)
            except errors.SpaceError as exc:
                log.error("sandbox %s stays paused after its checkpoint: %s", handle.sandbox_id, exc.message)
                with contextlib.suppress(errors.InvalidState):
                    handle.state = transition(transition(handle.state, Event.PAUSE), Event.PAUSED)
            finally:
                handle.lock.release()

        task = asyncio.get_running_loop().create_task(resume(), name=f"resume-{handle.sandbox_id}")
        self._resumes.add(task)
        task.add_done_callback(self._resumes.discard)

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
                    await self.driver.discard(sandbox_id)  # its files are replaced next (ADR 0077)
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

    async def fork_with_ids(
        self, parent: SandboxHandle, snapshot_id: str | None, child_ids: list[str]
    ) -> list[SandboxHandle]:
        """`fork` with the children's ids chosen by the caller (the control plane); children that already
        exist are returned as they are, so a repeated request converges."""
        missing = [cid for cid in child_ids if cid not in self.sandboxes]
        if missing:
            if snapshot_id is None:
                snapshot_id = (await self.checkpoint(parent.sandbox_id)).snapshot_id
            record = parent.snapshots.get(snapshot_id)
            if record is None or record.kind != "full":
                raise errors.InvalidArgument(
                    f"{snapshot_id} is not a full checkpoint of {parent.sandbox_id}", field="snapshot_id"
                )
            source = snapshot_id
            await asyncio.gather(*(self._fork_child(parent, source, cid) for cid in missing))
        return [self.get(cid) for cid in child_ids]

    async def _fork_child(self, parent: SandboxHandle, snapshot_id: str, child_id: str) -> None:
        if child_id in self.sandboxes:
            return
        spec = SandboxSpec(
            sandbox_id=child_id,
            template=parent.spec.template,
            limits=parent.spec.limits,
            env=dict(parent.spec.env),
        )
        child = SandboxHandle(child_id, spec, State.PENDING, time.time())
        self.sandboxes[child_id] = child
        driver = self.driver

        async def effect() -> None:
            channel = await driver.restore(
                child_id, snapshot_id, source_sandbox_id=parent.sandbox_id, limits=spec.limits
            )
            # attach, not a bare assignment: a child whose runtime dies later must be seen to crash.
            child.attach(channel)
            await GuestSession(channel).reseed()

        async with child.lock:
            try:
                await self._step(child, Event.FORK, Event.CREATED, effect)
            except BaseException:
                with contextlib.suppress(Exception):
                    await driver.destroy(child_id)
                self.sandboxes.pop(child_id, None)
                raise

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:
            if handle.snapshots.pop(snapshot_id, None) is None:
                raise errors.NotFound(f"snapshot {snapshot_id} of sandbox {sandbox_id} does not exist")
            await self.driver.delete_snapshot(sandbox_id, snapshot_id)

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
