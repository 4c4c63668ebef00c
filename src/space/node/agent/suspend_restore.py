"""The node agent's side of suspend, upload and restore through object storage (ADR 0012).

Invariants:
- Suspend keeps the source: the sandbox stays on the node, paused (state `suspended`), until the caller
  deletes it after it recorded the upload as verified. Restore from object storage downloads and verifies
  every part before the driver touches anything; a failed restore leaves nothing of the sandbox behind.
- Suspend, upload and restore are repeatable: a repeat after a crash (of the agent, at any point) finds what
  is already done (the checkpoint on disk, the staged export, the manifest in the store) and finishes.
- Suspend is exempt from the disk bounds (it is how a node gets its disk back); an import is refused below
  the node's reserve before anything is written.
- One restore (download + import) per sandbox id at a time, before its handle exists.
- Every uploaded checkpoint's manifest names the runtime it needs (`metadata.runtime`, the descriptor runsc
  wrote into the image, ADR 0035); a restore whose manifest names a runtime this node does not have is
  refused (RuntimeIncompatible, with the reason) before anything is downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from space.core import errors, runtimes
from space.core.ids import parse_sandbox_id, parse_snapshot_id
from space.core.lifecycle import Event, State, transition
from space.crypto.envelope import DataKey
from space.node.agent import runtime_info, transfer
from space.node.agent.sandbox_handle import SandboxHandle, SnapshotRecord
from space.node.agent.template_prep import TemplatePreparation
from space.node.drivers.base import SandboxSpec
from space.objectstore.artifacts import Manifest, read_manifest
from space.objectstore.base import ObjectStore


class SuspendRestore(TemplatePreparation):
    """Suspend, upload and restore through object storage over the template and snapshot verbs."""

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
            # The image's own descriptor (written by the runsc that made it), else this node's.
            "runtime": runtime_info.read_descriptor(
                staged.directory / "image" / runtime_info.RUNTIME_DESCRIPTOR
            )
            or self.node_runtime(),
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
            runtimes.check_restore(
                self.node_runtime(), manifest.metadata.get("runtime"), what=f"checkpoint {snapshot_id}"
            )
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
