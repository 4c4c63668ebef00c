"""The node agent's lifecycle verbs: adopt what runs after a restart, create, pause, resume, stop, start,
delete.

Invariants:
- The node is the source of truth for what runs on it: `recover()` rebuilds the registry from the driver
  (runtime state + channel) after an agent restart, reconnecting to running sandboxes without touching them;
  the incarnations persisted by the previous agent are kept for the copies adopted, dropped for the rest.
- A deleted copy's incarnation is forgotten with it.
- A create that fails leaves nothing behind: the driver's leftovers are destroyed and the id unregistered.
- A sandbox created from its template's warm checkpoint is reseeded (and given its environment) before it
  is handed out, so copies of one checkpoint never share random state.
"""

from __future__ import annotations

import contextlib
import logging
import time

from space.core import errors
from space.core.ids import new_sandbox_id
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits
from space.node.agent.sandbox_handle import SandboxHandle, SnapshotRecord
from space.node.agent.sandbox_registry import SandboxRegistry
from space.node.drivers.base import SandboxSpec

log = logging.getLogger("space.node.agent.agent")


class SandboxLifecycle(SandboxRegistry):
    """Lifecycle verbs over the registry (each one a `_step` under the sandbox's lock)."""

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
        self.incarnations.keep_only(self.sandboxes)
        return adopted

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

    # -- delete ----------------------------------------------------------------------------------------------
    async def delete(self, sandbox_id: str) -> None:
        handle = self.get(sandbox_id)
        async with handle.lock:

            async def effect() -> None:
                await self._close_channel(handle)
                await self.driver.destroy(sandbox_id)

            await self._step(handle, Event.DELETE, Event.DELETED, effect)
            self.sandboxes.pop(sandbox_id, None)
            self.incarnations.forget(sandbox_id)

    async def delete_all(self) -> None:
        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(errors.SpaceError):
                await self.delete(sandbox_id)

    async def close(self) -> None:
        """Disconnect from every sandbox; they keep running (the holders keep their channels)."""
        for handle in self.sandboxes.values():
            await self._close_channel(handle)
        await self.driver.close()
