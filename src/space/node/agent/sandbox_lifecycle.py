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
- A create first tries the node's warm pool (ADR 0047): a pooled runtime is bound to the sandbox id (boot
  environment, egress policy, reseed, environment) and the binding made durable only once all of it is
  done; a bind that fails destroys the member and creates the usual way. `created_from` says which.
- A deleted sandbox's alias (a bound pooled runtime's name) is forgotten with it.
- A sandbox booted cold runs its template's start command before it is handed out (unless the caller
  says `start=False`: a template build's sandbox); one restored from the warm start or the pool already
  holds what it started (space.node.agent.template_start). Its failure is recorded, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import cast

from space.core import errors
from space.core.ids import new_sandbox_id
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits
from space.node.agent import template_start, template_travel
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.agent.pools import Member, clean_leftovers
from space.node.agent.sandbox_handle import SandboxHandle, SnapshotRecord
from space.node.agent.sandbox_registry import SandboxRegistry
from space.node.drivers.base import SandboxSpec

log = logging.getLogger("space.node.agent.agent")


class SandboxLifecycle(SandboxRegistry):
    """Lifecycle verbs over the registry (each one a `_step` under the sandbox's lock)."""

    async def recover(self) -> list[str]:
        """Adopt what the node already runs (after an agent restart); returns the adopted ids. Pooled runtimes
        an earlier agent left are destroyed, never adopted (space.node.agent.pools)."""
        cleaned = await clean_leftovers(self.driver)
        if cleaned:
            log.info("destroyed %d pooled runtimes left by an earlier agent", len(cleaned))
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
        if self.driver.names is not None:
            self.driver.names.keep_only(set(self.sandboxes))
        return adopted

    # -- create ----------------------------------------------------------------------------------------------
    async def ensure_builtin_here(self, name: str) -> None:
        """Build a built-in template this node did not prepare; the template layer (template_prep) does."""

    async def create(
        self,
        template: str = "python",
        *,
        limits: SandboxLimits | None = None,
        env: dict[str, str] | None = None,
        sandbox_id: str | None = None,
        warm: bool = True,
        start: bool = True,
    ) -> SandboxHandle:
        spec = SandboxSpec(
            sandbox_id=sandbox_id or new_sandbox_id(),
            template=template,
            limits=limits or SandboxLimits(),
            env=dict(env or {}),
        )
        if spec.sandbox_id in self.sandboxes:
            raise errors.AlreadyExists(f"sandbox {spec.sandbox_id} already exists")
        # A user template this node lacks comes from the object store first (one flight per template).
        await template_travel.ensure_template_here(cast("template_travel.TravelAgent", self), template)
        await self.ensure_builtin_here(template)  # a built-in the node did not prepare (ADR 0057)
        member = self.pools.take(template, spec.limits) if warm and self.pools is not None else None
        if member is None:
            await self.check_reserve(f"creating sandbox {spec.sandbox_id}")  # a member's disk is already held
        handle = SandboxHandle(spec.sandbox_id, spec, State.PENDING, time.time())
        self.sandboxes[spec.sandbox_id] = handle
        async with handle.lock:

            async def effect() -> None:
                if member is not None and await self._bind(handle, member):
                    return
                channel = None
                if warm and self.driver.warm_supported:
                    handle.created_from = "warm" if await self.driver.warm_ready(template) else "cold"
                    channel = await self.driver.create_warm(spec)
                if channel is None:
                    handle.created_from = "cold"
                    await self.driver.create(spec)
                    handle.attach(await self.driver.start(spec.sandbox_id))
                else:
                    await self._personalise(handle, channel)
                if start and handle.created_from == "cold":
                    await self._run_start_command(handle)

            try:
                await self._step(handle, Event.CREATE, Event.CREATED, effect)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.driver.destroy(spec.sandbox_id)
                self.sandboxes.pop(spec.sandbox_id, None)
                raise
        return handle

    async def _run_start_command(self, handle: SandboxHandle) -> None:
        """Start the template's start command in a sandbox booted cold; a failure is recorded on `handle`."""
        template = handle.spec.template
        try:
            command = await self.driver.start_command(template)
        except errors.SpaceError as exc:
            log.warning("template %s: its start command could not be read: %s", template, exc.message)
            handle.start_error = exc.message
            return
        if command is not None:
            started = await template_start.start(handle.session, template, command, self.driver.start_log)
            handle.start_process, handle.start_error = started

    async def _personalise(self, handle: SandboxHandle, channel: GuestChannel) -> None:
        """A sandbox restored from a checkpoint: its own randomness and its own environment."""
        handle.attach(channel)
        await handle.session.reseed()
        if handle.spec.env:
            await handle.session.configure(handle.spec.env)

    async def _bind(self, handle: SandboxHandle, member: Member) -> bool:
        """Make pooled `member` the sandbox of `handle` (ADR 0047); False (member destroyed) if it failed,
        and the caller makes the sandbox the usual way."""
        names = self.driver.names
        assert names is not None and self.pools is not None
        sandbox_id = handle.sandbox_id
        names.claim(sandbox_id, member.runtime_id)  # from here the helper's calls for the id reach it
        try:
            # Independent: the boots' environment and the egress policy (helper, gateway) beside the
            # guest's fresh randomness; the guest's environment after both (the driver completes it).
            async with asyncio.TaskGroup() as steps:
                steps.create_task(self.driver.bind_pooled(handle.spec, member.channel))
                steps.create_task(GuestSession(member.channel).reseed())
            handle.attach(member.channel)
            if handle.spec.env:
                await handle.session.configure(handle.spec.env)
            names.commit(sandbox_id)
        except BaseException as exc:
            handle.attach(None)
            with contextlib.suppress(Exception):
                await self.driver.stop(sandbox_id)  # the policy it was given goes; its record stays
            names.release(sandbox_id)
            await self.pools.discard(member)
            if not _a_failed_step(exc):
                raise
            log.warning("binding pooled runtime %s to %s failed (%s): creating it the usual way",
                        member.runtime_id, sandbox_id, exc)  # fmt: skip
            return False
        handle.created_from = "pool"
        return True

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
            if self.driver.names is not None:
                self.driver.names.forget(sandbox_id)

    async def delete_all(self) -> None:
        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(errors.SpaceError):
                await self.delete(sandbox_id)

    async def close(self) -> None:
        """Disconnect from every sandbox; they keep running (the holders keep their channels). Pool members
        are left to the next start, which destroys them."""
        if self.pools is not None:
            await self.pools.close()
        for handle in self.sandboxes.values():
            await self._close_channel(handle)
        await self.driver.close()


def _a_failed_step(exc: BaseException) -> bool:
    """A step's own failure (typed or I/O, alone or from a task group), not a cancellation or a bug."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_a_failed_step(inner) for inner in exc.exceptions)
    return isinstance(exc, errors.SpaceError | OSError)
