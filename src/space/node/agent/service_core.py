"""The node service's core: the state its verbs share (activity, egress, identity, settings), settling and
auto-resume for data-plane requests, and what the node reports of itself (observed sandboxes, node info,
heartbeat, registration). The verbs build on it (space.node.agent.service).

Invariants:
- A data-plane request to a paused sandbox resumes it first (`session`); one arriving while a lifecycle step
  is in flight waits for that step to settle (at most `settle_timeout_s`). A suspended sandbox serves
  nothing until restored (InvalidState).
- Every data-plane request (and every item it streams) records the sandbox's activity time (`touch`),
  reported as `last_activity_at`.
- Observing never fails because a part is unavailable: a driver or daemon that does not answer leaves its
  fields empty (logged), the rest is reported. A crashed sandbox is reported with the reason its runtime
  ended (`crash_reason`: its memory or task limit enforced by the host, a kill, an exit code).
- Store URLs leave the node only without credentials (`public_url`).
- Node info, the registration and every heartbeat carry the node's runtime descriptor (ADR 0035; None while
  unknown), which the scheduler matches against checkpoints before it sends a restore here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from space.core import errors, versions
from space.core.lifecycle import IN_PROGRESS_STATES, State
from space.core.settings import CPU_OVERCOMMIT, SandboxLimits
from space.node.agent import rpc_models as rm
from space.node.agent.agent import NodeAgent, SandboxHandle, SnapshotRecord
from space.node.agent.egress_wiring import EgressWiring
from space.node.agent.guest import GuestSession
from space.node.agent.idempotency import Replays
from space.node.agent.identity import NodeIdentity
from space.node.agent.settings import NodeAgentSettings
from space.node.drivers.base import RuntimeState
from space.protocol import methods as m
from space.protocol import node_protocol

log = logging.getLogger("space.node.rpc")

MiB = 1 << 20
# NodeInfo's disk fields (MiB) <- agent.disk_space() keys (bytes).
_DISK_FIELDS = {"disk_mb": "total_bytes", "disk_free_mb": "free_bytes", "disk_reserve_mb": "reserve_bytes"}
# States in which a sandbox holds no CPU or memory on this node (stopped keeps only its disk).
_IDLE_STATES = frozenset({State.PENDING, State.STOPPED, State.SUSPENDED, State.DELETED, State.FAILED})


class ServiceCore:
    """What the routes share, over one NodeAgent (usable without HTTP, e.g. for the heartbeat)."""

    def __init__(
        self,
        agent: NodeAgent,
        templates: Sequence[str] = ("python",),
        settings: NodeAgentSettings | None = None,
    ) -> None:
        self.agent = agent
        self.templates = list(templates)
        self.settings = settings or NodeAgentSettings()
        self.activity: dict[str, float] = {}
        self.replays = Replays(self.settings.idempotency_memory)
        self.egress_policies: dict[str, dict[str, Any]] = {}  # sandbox id -> last pushed policy (issue 5)
        #: The node's egress gateway wiring (network = "sandbox"; space.node.agent.egress_wiring), else None.
        self.egress: EgressWiring | None = None
        #: Node id + per-node secret from this node's latest registration (ADR 0019; memory only).
        self.identity = NodeIdentity()
        if isinstance(agent, NodeAgent):  # (tests give some services a stand-in agent without templates)
            agent.template_arrived = self.template_here  # a template fetched on first use is reported

    def template_here(self, name: str) -> None:
        """Report template `name` as held by this node (info, heartbeat) from now on."""
        if name not in self.templates:
            self.templates.append(name)

    @property
    def node_id(self) -> str | None:
        """As the control plane registered this node (None before the first registration)."""
        return self.identity.node_id

    # -- activity, settling, auto-resume ------------------------------------------------------------------
    def touch(self, sandbox_id: str) -> None:
        self.activity[sandbox_id] = time.time()

    async def settle(self, handle: SandboxHandle, timeout: float | None = None) -> None:
        """Wait until no lifecycle step holds the sandbox (every step runs under its lock), at most
        `timeout` (default: settle_timeout_s) seconds."""
        if timeout is None:
            timeout = self.settings.settle_timeout_s
        if handle.state not in IN_PROGRESS_STATES and not handle.lock.locked():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                async with handle.lock:
                    pass

    def _registered(self, handle: SandboxHandle) -> SandboxHandle:
        if self.agent.sandboxes.get(handle.sandbox_id) is not handle:
            raise errors.NotFound(f"sandbox {handle.sandbox_id} does not exist on this node")
        return handle

    async def session(self, sandbox_id: str) -> tuple[SandboxHandle, GuestSession]:
        """The sandbox's daemon session for a data-plane request: waits out a lifecycle step in flight and
        resumes a paused sandbox first (transparent auto-resume)."""
        handle = self.agent.get(sandbox_id)
        self.touch(handle.sandbox_id)
        deadline = time.monotonic() + self.settings.settle_timeout_s
        while True:
            await self.settle(handle, max(0.0, deadline - time.monotonic()))
            self._registered(handle)
            if handle.state == State.SUSPENDED:
                # Kept paused only as the source of an upload: it serves nothing until restored.
                raise errors.InvalidState(
                    f"sandbox {handle.sandbox_id} is suspended; restore it first", state="suspended"
                )
            if handle.state != State.PAUSED or time.monotonic() > deadline:
                break
            log.info("auto-resuming paused sandbox %s for a data-plane request", handle.sandbox_id)
            # InvalidState here means a concurrent request resumed (or stopped) it first: look again.
            with contextlib.suppress(errors.InvalidState):
                await self.agent.resume(handle.sandbox_id)
        return handle, handle.session

    # -- observed state ----------------------------------------------------------------------------------
    async def _guest_info(self, handle: SandboxHandle) -> dict[str, Any] | None:
        channel = handle.channel
        if handle.state != State.RUNNING or channel is None or channel.closed:
            return None
        try:
            return await channel.call(m.SYS_INFO, timeout=self.settings.guest_info_timeout_s)
        except errors.SpaceError as exc:
            log.debug("sys.info of %s failed: %s", handle.sandbox_id, exc)
            return None

    async def observe(
        self, handle: SandboxHandle, runtime: RuntimeState | None, *, guest: bool = True
    ) -> rm.SandboxObserved:
        info = await self._guest_info(handle) if guest else None
        return rm.SandboxObserved(
            id=handle.sandbox_id,
            state=str(handle.state),
            template=handle.spec.template,
            limits=handle.spec.limits,
            created_at=handle.created_at,
            runtime=runtime.runtime if runtime is not None else None,
            exists=runtime.exists if runtime is not None else True,
            channel_open=handle.channel is not None and not handle.channel.closed,
            last_activity_at=self.activity.get(handle.sandbox_id),
            guest=info,
            snapshots=[snapshot_info(handle.sandbox_id, r) for r in handle.snapshots.values()],
            crash_reason=crash_reason(runtime.exit if runtime is not None else None, handle.spec.limits)
            if handle.state == State.CRASHED
            else None,
            created_from=handle.created_from,
        )

    async def _runtime(self, sandbox_id: str) -> RuntimeState | None:
        try:
            return await self.agent.driver.state(sandbox_id)
        except errors.SpaceError as exc:
            log.warning("driver state of %s unavailable: %s", sandbox_id, exc)
            return None

    async def observe_one(self, handle: SandboxHandle) -> rm.SandboxObserved:
        return await self.observe(handle, await self._runtime(handle.sandbox_id))

    async def observe_all(self, *, guest: bool = True) -> rm.SandboxList:
        try:
            runtimes: dict[str, RuntimeState] | None = {
                r.sandbox_id: r for r in await self.agent.driver.list()
            }
        except errors.SpaceError as exc:
            log.warning("driver list unavailable: %s", exc)
            runtimes = None
        handles = list(self.agent.sandboxes.values())
        observed = await asyncio.gather(
            *(self.observe(h, runtimes.get(h.sandbox_id) if runtimes else None, guest=guest) for h in handles)
        )
        names = self.agent.driver.names
        pooled = set(names.members()) if names is not None else set()  # the node's, not the control plane's
        unmanaged = sorted(set(runtimes or {}) - {h.sandbox_id for h in handles} - pooled)
        return rm.SandboxList(sandboxes=list(observed), unmanaged=unmanaged)

    def info(self) -> rm.NodeInfo:
        # Pooled sandboxes are not in `used`: they give way to any placement (ADR 0047, `has_room`).
        used_cpus, used_memory = 0.0, 0
        for handle in self.agent.sandboxes.values():
            if handle.state not in _IDLE_STATES:
                used_cpus += handle.spec.limits.cpus
                used_memory += handle.spec.limits.memory_mb
        disk = self.agent.disk or {}  # refreshed by every heartbeat (agent.disk_space())
        return rm.NodeInfo(
            driver=self.agent.driver.name,
            isolating=self.agent.driver.isolating,
            capacity=rm.Resources(
                cpus=float(os.cpu_count() or 1),
                memory_mb=_physical_memory_mb(),
                **{k: disk[f] >> 20 for k, f in _DISK_FIELDS.items() if f in disk},
            ),
            used=rm.Resources(
                cpus=round(used_cpus, 3),
                memory_mb=used_memory,
                disk_mb=sum(h.spec.limits.disk_mb for h in self.agent.sandboxes.values()),
            ),
            sandbox_count=len(self.agent.sandboxes),
            templates=list(self.templates),
            time=time.time(),
            store_url=public_url(self.agent.store.url) if self.agent.store is not None else None,
            runtime=self.agent.node_runtime(),
            pools=self.agent.pools.counts() if self.agent.pools is not None else {},
            space_version=versions.space_version(),
        )

    def has_room(self, limits: SandboxLimits | None) -> bool:
        """Whether the node's sandboxes, its pooled sandboxes and one more with `limits` (None: none) fit
        its memory and (overcommitted) CPUs, counted as the scheduler counts: a warm pool refills only
        then, and gives way (destroys members) while its node's sandboxes and members do not fit."""
        info = self.info()
        pools = self.agent.pools
        held_cpus, held_memory, _disk = pools.reserved() if pools is not None else (0.0, 0, 0)
        more_cpus, more_memory = (limits.cpus, limits.memory_mb) if limits is not None else (0.0, 0)
        return (
            info.capacity.memory_mb - info.used.memory_mb - held_memory >= more_memory
            and info.capacity.cpus * CPU_OVERCOMMIT - info.used.cpus - held_cpus >= more_cpus
        )

    async def heartbeat(self, node_id: str, url: str) -> rm.Heartbeat:
        # The beat's `time` is when its observation BEGAN: the control plane ignores a crash or halt report
        # about a record changed after it (node_routes._crash_reports). Stamped after the observation and the
        # disk reading, a report seen before a restore finished could pass as newer than that restore.
        observed_from = time.time()
        observed = await self.observe_all(guest=False)
        await self.agent.disk_space()
        info = self.info()
        activity = {s.id: s.last_activity_at for s in observed.sandboxes if s.last_activity_at is not None}
        return rm.Heartbeat(
            node_id=node_id,
            url=url,
            **info.model_dump(exclude={"capacity", "used", "time"}),
            time=observed_from,
            capacity=info.capacity,
            used=info.used,
            activity=activity,
            sandboxes=observed.sandboxes,
            unmanaged=observed.unmanaged,
        )

    def registration(self, url: str, token: str) -> rm.RegisterRequest:
        info = self.info()
        protocol_min, protocol_max = node_protocol.own_range()
        return rm.RegisterRequest(
            url=url,
            token=token,
            capacity=info.capacity,
            templates=info.templates,
            driver=info.driver,
            isolating=info.isolating,
            runtime=info.runtime,
            space_version=info.space_version,
            protocol_min=protocol_min,
            protocol_max=protocol_max,
        )


def crash_reason(ended: Any, limits: SandboxLimits) -> str | None:
    """Why a sandbox's runtime ended, from the holder's exit record (space.node.helper.holder): the host
    enforcing its memory or task limit, a kill, or an exit code (None: nothing known); ADR 0036."""
    record = ended if isinstance(ended, dict) else {}
    counts = {k: v for k, v in record.items() if isinstance(v, int) and not isinstance(v, bool)}
    if counts.get("oom_kills", 0) > 0:
        return f"killed by the host for exceeding the sandbox's memory limit ({limits.memory_mb} MB)"
    if counts.get("task_limit_hits", 0) > 0:
        return "the host's task limit of the sandbox was reached"
    code = counts.get("exit_code")
    if code in {137, -9}:
        return "killed (SIGKILL)"
    return f"exited with code {code}" if code is not None else None


def public_url(url: str) -> str:
    """A store URL without credentials (an s3:// URL may carry access_key/secret_key in its query)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in {"access_key", "secret_key"}]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, safe=":/")))


def snapshot_info(sandbox_id: str, record: SnapshotRecord) -> rm.SnapshotInfo:
    return rm.SnapshotInfo(
        snapshot_id=record.snapshot_id,
        sandbox_id=sandbox_id,
        kind="full" if record.kind == "full" else "disk",
        created_at=record.created_at,
        image_bytes=record.image_bytes,
    )


def _physical_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MiB)
    except (ValueError, OSError):
        return 0
