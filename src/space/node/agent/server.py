"""The node agent's RPC service: lifecycle verbs for the reconciler and the data plane for the gateway.

    python -m space.node.agent.server --data-dir D --listen 127.0.0.1:PORT [--rpc-token-file F] \
        [--control-plane URL [--bootstrap-token-file F] [--advertise-url URL]] [--driver runsc|fake] \
        [--no-prepare]

Invariants:
- Every request (HTTP and WebSocket, known route or not) carries `Authorization: Bearer <node token>`,
  compared in constant time, before any route runs; anything else is a typed 401. The node token is this
  node's own RPC token (space.node.agent.identity; ADR 0021), never the cluster's bootstrap token.
- Every route scoped to a sandbox (its path names `{sandbox_id}`; for POST /sandboxes/restore the body's
  `sandbox_id`) also needs exactly one `X-Space-Capability` for that very sandbox, unexpired, made with the
  node token (space.core.capability); anything else is a typed 403 before the route runs. Only the routes in
  `_NODE_LEVEL_ROUTES` go without one, and a route that is neither is refused (fail closed).
- Lifecycle verbs are idempotent in their outcome so a reconciler may repeat any call after a crash:
  PUT creates the sandbox with the id the control plane chose or returns it as it is (201 vs 200); an
  action whose target state already holds answers 200 with the state; DELETE of an absent sandbox is a 200
  that also removes anything the driver still keeps under that id. A request the lifecycle table refuses is
  a 409 whose details name the current state.
- A data-plane request to a paused sandbox resumes it first; one arriving while a lifecycle step is in
  flight waits for that step to settle. Every data-plane request (and every item it streams) records the
  sandbox's activity time, reported as `last_activity_at`.
- Bodies are streamed both ways: uploads go from `request.stream()` to the daemon frame by frame (the
  channel's write buffer bounds what is held), downloads are read from the daemon in READ_WINDOW pieces, so
  no file is ever held whole in this process.
- Streams (NDJSON, PTY) that end early — client gone, error — cancel their daemon call (a foreground process
  is detached, not killed; a PTY's process gets SIGHUP), so no call is left open in the channel.
- Errors have one shape, `{"error": {"code", "message", "details"}}`, and one status map (space.rest.errors,
  shared with the control plane's API); an error after a stream's headers went out is its last NDJSON
  line, `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import pathlib
import signal
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Annotated, Any

import anyio
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from space.core import errors
from space.core.capability import CAPABILITY_HEADER
from space.core.capability import verify as verify_capability
from space.core.ids import parse_sandbox_id, parse_snapshot_id
from space.core.lifecycle import IN_PROGRESS_STATES, Event, State
from space.core.settings import DiskReserve, SandboxLimits
from space.crypto.envelope import DataKey
from space.node.agent import rpc_models as rm
from space.node.agent.agent import NodeAgent, SandboxHandle, SnapshotRecord
from space.node.agent.channel import Call
from space.node.agent.egress_wiring import EgressRequest, EgressSettings, EgressWiring
from space.node.agent.egress_wiring import install as egress_install
from space.node.agent.egress_wiring import load_settings as load_egress_settings
from space.node.agent.guest import GuestSession
from space.node.agent.identity import (
    NodeIdentity,
    default_identity_file,
    default_rpc_token_file,
    load_or_create_rpc_token,
    read_private,
)
from space.node.drivers.base import RuntimeState, SandboxSpec
from space.objectstore.base import ObjectStore
from space.protocol import Channel, FrameType
from space.protocol import methods as m
from space.rest import errors as rest_errors

log = logging.getLogger("space.node.rpc")

API_PREFIX = "/node/v1"
NDJSON = "application/x-ndjson"
MiB = 1 << 20
#: A download asks the daemon for at most this much at a time: the channel has no per-call flow control,
#: so this bounds what a slow HTTP reader can make this process buffer.
READ_WINDOW = 4 * MiB
GUEST_INFO_TIMEOUT_S = 2.0
#: How long a data-plane request waits for an in-flight lifecycle step (pause, checkpoint...) to settle.
SETTLE_TIMEOUT_S = 120.0
#: How long an abandoned stream waits for the daemon to confirm the cancel before forgetting the call.
CANCEL_GRACE_S = 5.0
HEARTBEAT_INTERVAL_S = 2.0
#: After a PTY client vanished: how long to wait for its process to end after each SIGHUP.
PTY_HANGUP_GRACE_S = (0.5, 1.0, 2.0)
IDEMPOTENCY_MEMORY = 1024

_ACTION_TARGET: dict[str, State] = {
    "pause": State.PAUSED,
    "resume": State.RUNNING,
    "stop": State.STOPPED,
    "start": State.RUNNING,
}
# NodeInfo's disk fields (MiB) <- agent.disk_space() keys (bytes).
_DISK_FIELDS = {"disk_mb": "total_bytes", "disk_free_mb": "free_bytes", "disk_reserve_mb": "reserve_bytes"}
# States in which a sandbox holds no CPU or memory on this node (stopped keeps only its disk).
_IDLE_STATES = frozenset({State.PENDING, State.STOPPED, State.SUSPENDED, State.DELETED, State.FAILED})


def _ndjson_line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, separators=(",", ":")).encode() + b"\n"


# -- authentication ------------------------------------------------------------------------------------------
class BearerAuth:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would buffer streamed bodies)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("the node token must not be empty")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                supplied = value
        if hmac.compare_digest(supplied, self._expected):
            await self.app(scope, receive, send)
            return
        response = rest_errors.error_response(errors.Unauthenticated("a valid node token is required"))
        if scope["type"] == "http":
            await response(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await WebSocket(scope, receive, send).send_denial_response(response)
        else:
            await WebSocket(scope, receive, send).close(code=4401, reason="unauthenticated")


#: Routes that act on the node as a whole (the token suffices); every other route is scoped to a sandbox.
_NODE_LEVEL_ROUTES = frozenset({("GET", f"{API_PREFIX}/info"), ("GET", f"{API_PREFIX}/sandboxes")})
#: Routes scoped to the sandbox their JSON body names (no `{sandbox_id}` in the path).
_BODY_SCOPED_ROUTES = frozenset({("POST", f"{API_PREFIX}/sandboxes/restore")})


def capability_scope(method: str, route_path: str) -> str:
    """How a route is authorized beyond the token: "node", "path" ({sandbox_id}) or "body" (the body's
    sandbox_id); anything else is a route nobody classified, which the dependency refuses."""
    if (method, route_path) in _NODE_LEVEL_ROUTES:
        return "node"
    if "{sandbox_id}" in route_path:
        return "path"
    if (method, route_path) in _BODY_SCOPED_ROUTES:
        return "body"
    return "unclassified"


async def require_capability(connection: HTTPConnection) -> None:
    """Router-level dependency: a sandbox-scoped call carries a capability for that sandbox (see the
    module docstring). The key is the node token the app was made with (app.state.rpc_token)."""
    route = connection.scope.get("route")
    route_path = str(getattr(route, "path", ""))
    method = connection.scope.get("method", "GET") if connection.scope["type"] == "http" else "GET"
    scope = capability_scope(method, route_path)
    if scope == "node":
        return
    if scope == "path":
        sandbox_id = connection.path_params.get("sandbox_id")
    elif scope == "body" and isinstance(connection, Request):
        try:
            body = await connection.json()
        except ValueError as exc:
            raise errors.InvalidArgument("the body is not JSON") from exc
        sandbox_id = body.get("sandbox_id") if isinstance(body, dict) else None
    else:
        log.error("route %s %s is not classified for capabilities: refused", method, route_path)
        raise errors.PermissionDenied("this route is not open to sandbox-scoped calls")
    if not isinstance(sandbox_id, str):
        raise errors.PermissionDenied("this call names no sandbox")
    parse_sandbox_id(sandbox_id)  # a malformed id names no sandbox: 400, as the routes would answer
    supplied = connection.headers.getlist(CAPABILITY_HEADER)
    if len(supplied) > 1:
        raise errors.PermissionDenied(f"more than one {CAPABILITY_HEADER}")
    verify_capability(
        connection.app.state.rpc_token, supplied[0] if supplied else None, sandbox_id=sandbox_id,
        now=time.time(),
    )  # fmt: skip


# -- the service the routes share ----------------------------------------------------------------------------
async def _finish(call: Call) -> None:
    """Make sure an abandoned call ends in the daemon and leaves the channel's table.

    Shielded: it runs while the surrounding request is being cancelled (client disconnect), and a cancel
    frame that never goes out would leave the daemon streaming into a call nobody reads."""
    with anyio.CancelScope(shield=True):
        if not call.done:
            await call.cancel()
        with contextlib.suppress(errors.SpaceError, TimeoutError):
            await asyncio.wait_for(call.result(), CANCEL_GRACE_S)


def _command_params(body: rm._Command) -> dict[str, Any]:
    params: dict[str, Any] = {"cmd": body.cmd} if body.cmd is not None else {"argv": list(body.argv or [])}
    if body.env:
        params["env"] = dict(body.env)
    for key in ("cwd", "user", "timeout"):
        value = getattr(body, key)
        if value is not None:
            params[key] = value
    return params


class _Replays:
    """In-memory Idempotency-Key memory for the non-idempotent verbs (snapshot, fork): the same key with the
    same body runs once (concurrent repeats wait for it); another body is a conflict. Lost on restart."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[str, asyncio.Task[Any]]] = OrderedDict()

    async def run(self, key: str | None, scope: str, body: Any, work: Callable[[], Awaitable[Any]]) -> Any:
        if key is None:
            return await work()
        if len(key) > 128:
            raise errors.InvalidArgument("Idempotency-Key is at most 128 characters", field="Idempotency-Key")
        full_key = f"{scope}\0{key}"
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
        entry = self._entries.get(full_key)
        if entry is not None:
            if entry[0] != digest:
                raise errors.Conflict("Idempotency-Key reused with another body", field="Idempotency-Key")
            return await asyncio.shield(entry[1])
        task: asyncio.Task[Any] = asyncio.ensure_future(work())
        self._entries[full_key] = (digest, task)
        while len(self._entries) > IDEMPOTENCY_MEMORY:
            self._entries.popitem(last=False)
        try:
            return await asyncio.shield(task)
        except BaseException:
            # A failed attempt is not remembered: the caller's retry runs the work again.
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._entries.pop(full_key, None)
            raise


class NodeService:
    """What the routes do, over one NodeAgent (usable without HTTP, e.g. for the heartbeat)."""

    def __init__(self, agent: NodeAgent, templates: Sequence[str] = ("python",)) -> None:
        self.agent = agent
        self.templates = list(templates)
        self.activity: dict[str, float] = {}
        self.replays = _Replays()
        self.egress_policies: dict[str, dict[str, Any]] = {}  # sandbox id -> last pushed policy (issue 5)
        #: The node's egress gateway wiring (network = "sandbox"; space.node.agent.egress_wiring), else None.
        self.egress: EgressWiring | None = None
        #: Node id + per-node secret from this node's latest registration (ADR 0019; memory only).
        self.identity = NodeIdentity()

    @property
    def node_id(self) -> str | None:
        """As the control plane registered this node (None before the first registration)."""
        return self.identity.node_id

    # -- activity, settling, auto-resume ------------------------------------------------------------------
    def touch(self, sandbox_id: str) -> None:
        self.activity[sandbox_id] = time.time()

    async def settle(self, handle: SandboxHandle, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Wait until no lifecycle step holds the sandbox (every step runs under its lock)."""
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
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
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
            return await channel.call(m.SYS_INFO, timeout=GUEST_INFO_TIMEOUT_S)
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
            snapshots=[_snapshot_info(handle.sandbox_id, r) for r in handle.snapshots.values()],
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
        unmanaged = sorted(set(runtimes or {}) - {h.sandbox_id for h in handles})
        return rm.SandboxList(sandboxes=list(observed), unmanaged=unmanaged)

    def info(self) -> rm.NodeInfo:
        used_cpus = 0.0
        used_memory = 0
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
        )

    async def heartbeat(self, node_id: str, url: str) -> rm.Heartbeat:
        observed = await self.observe_all(guest=False)
        await self.agent.disk_space()
        info = self.info()
        activity = {s.id: s.last_activity_at for s in observed.sandboxes if s.last_activity_at is not None}
        return rm.Heartbeat(
            node_id=node_id,
            url=url,
            **info.model_dump(exclude={"capacity", "used"}),
            capacity=info.capacity,
            used=info.used,
            activity=activity,
            sandboxes=observed.sandboxes,
            unmanaged=observed.unmanaged,
        )

    def registration(self, url: str, token: str) -> rm.RegisterRequest:
        info = self.info()
        return rm.RegisterRequest(
            url=url,
            token=token,
            capacity=info.capacity,
            templates=info.templates,
            driver=info.driver,
            isolating=info.isolating,
        )

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, body: rm.CreateSandboxRequest) -> tuple[rm.SandboxObserved, bool]:
        sandbox_id = parse_sandbox_id(sandbox_id)
        for attempt in range(2):
            existing = self.agent.sandboxes.get(sandbox_id)
            if existing is not None:
                await self.settle(existing)
                return await self.observe_one(existing), False
            if self.egress is not None and body.egress is not None:
                self.egress.remember(sandbox_id, _egress_request(body.egress), body.egress.credentials)
            try:
                handle = await self.agent.create(
                    body.template, limits=body.limits, env=body.env, sandbox_id=sandbox_id
                )
            except errors.AlreadyExists:
                # Either a concurrent PUT registered it (the loop returns it), or the driver still held
                # files of a half-done earlier attempt, which the failed create just destroyed: retry once.
                if attempt == 1:
                    raise
                continue
            return await self.observe_one(handle), True
        raise errors.Internal("unreachable")  # pragma: no cover

    async def act(self, sandbox_id: str, action: str) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        target = _ACTION_TARGET[action]
        operation: Callable[[str], Awaitable[None]] = getattr(self.agent, action)
        await self.settle(handle)
        self._registered(handle)
        if handle.state != target:
            try:
                await operation(handle.sandbox_id)
            except errors.InvalidState:
                # A concurrent identical request may have got there first; that is success, not a 409.
                if handle.state != target:
                    raise
        if action in {"resume", "start"}:
            self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def delete(self, sandbox_id: str) -> rm.DeleteResult:
        sandbox_id = parse_sandbox_id(sandbox_id)
        handle = self.agent.sandboxes.get(sandbox_id)
        existed = handle is not None
        if handle is None:
            # Unknown to the agent; the driver may still hold leftovers of a half-done step under this id.
            await self.agent.driver.destroy(sandbox_id)
        else:
            try:
                await self.agent.delete(sandbox_id)
            except (errors.InvalidState, errors.NotFound):
                if sandbox_id in self.agent.sandboxes:  # not a concurrent delete that won: a real refusal
                    raise
        self.activity.pop(sandbox_id, None)
        return rm.DeleteResult(id=sandbox_id, existed=existed)

    async def snapshot(self, sandbox_id: str, full: bool) -> rm.SnapshotInfo:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        record = await (self.agent.checkpoint if full else self.agent.disk_snapshot)(handle.sandbox_id)
        return _snapshot_info(handle.sandbox_id, record)

    async def snapshots(self, sandbox_id: str) -> rm.SnapshotList:
        handle = self.agent.get(sandbox_id)
        records = sorted(handle.snapshots.values(), key=lambda r: r.created_at)
        listed = []
        for record in records:
            info = _snapshot_info(handle.sandbox_id, record)
            try:
                usage = await self.agent.snapshot_usage(handle.sandbox_id, record.snapshot_id)
                info.exclusive_bytes = usage.get("exclusive_bytes")
            except errors.SpaceError as exc:
                log.debug("usage of snapshot %s unavailable: %s", record.snapshot_id, exc)
            listed.append(info)
        return rm.SnapshotList(snapshots=listed)

    # -- suspend / restore / recover ---------------------------------------------------------------------
    def store_for(self, url: str) -> ObjectStore:
        """The node's configured object store, if `url` names it: a node writes only where it was told to."""
        store = self.agent.store
        if store is None:
            raise errors.InvalidArgument("this node has no object store configured", field="store_url")
        if url != store.url:
            raise errors.InvalidArgument(
                "store_url is not this node's object store", field="store_url", expected=public_url(store.url)
            )
        return store

    async def suspend(self, sandbox_id: str, body: rm.SuspendRequest) -> rm.TransferResult:
        store = self.store_for(body.store_url)
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        result = await self.agent.suspend(
            handle.sandbox_id, store=store, prefix=body.prefix, snapshot_id=body.snapshot_id,
            data_key=_data_key(body.data_key),
        )  # fmt: skip
        return rm.TransferResult.model_validate(result)

    async def upload(self, sandbox_id: str, snapshot_id: str, body: rm.UploadRequest) -> rm.TransferResult:
        store = self.store_for(body.store_url)
        handle = self.agent.get(sandbox_id)
        result = await self.agent.upload_snapshot(
            handle.sandbox_id, parse_snapshot_id(snapshot_id), store=store, prefix=body.prefix,
            data_key=_data_key(body.data_key),
        )  # fmt: skip
        return rm.TransferResult.model_validate(result)

    async def restore(self, body: rm.RestoreRequest) -> rm.SandboxObserved:
        store = self.store_for(body.store_url)
        spec = SandboxSpec(
            sandbox_id=body.sandbox_id, template=body.template,
            limits=body.limits or SandboxLimits(), env=dict(body.env),
        )  # fmt: skip
        key = base64.b64decode(body.data_key_b64) if body.data_key_b64 is not None else None
        if self.egress is not None and body.egress is not None:
            self.egress.remember(body.sandbox_id, _egress_request(body.egress), body.egress.credentials)
        handle = await self.agent.restore_from_store(
            body.sandbox_id, store=store, prefix=body.prefix, data_key=key, spec=spec
        )
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def recover(self, sandbox_id: str, body: rm.RecoverRequest) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        if handle.state == State.RUNNING:
            return await self.observe_one(handle)  # already recovered (a repeated request)
        await self.agent.recover_from_checkpoint(handle.sandbox_id, body.snapshot_id)
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        await self.agent.rollback(handle.sandbox_id, snapshot_id)
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def fork(self, sandbox_id: str, body: rm.ForkRequest) -> list[rm.SandboxObserved]:
        parent = self.agent.get(sandbox_id)
        await self.settle(parent)
        if body.child_ids is None:
            children = await self.agent.fork(
                parent.sandbox_id, snapshot_id=body.snapshot_id, count=body.count
            )
        else:
            children = await self._fork_with_ids(parent, body.snapshot_id, body.child_ids)
        return list(await asyncio.gather(*(self.observe_one(child) for child in children)))

    async def _fork_with_ids(
        self, parent: SandboxHandle, snapshot_id: str | None, child_ids: list[str]
    ) -> list[SandboxHandle]:
        """NodeAgent.fork with the children's ids chosen by the caller; children that already exist are
        returned as they are, so a repeated request converges. (Belongs in NodeAgent; kept here because the
        agent picks child ids itself.)"""
        missing = [cid for cid in child_ids if cid not in self.agent.sandboxes]
        if missing:
            if snapshot_id is None:
                snapshot_id = (await self.agent.checkpoint(parent.sandbox_id)).snapshot_id
            record = parent.snapshots.get(snapshot_id)
            if record is None or record.kind != "full":
                raise errors.InvalidArgument(
                    f"{snapshot_id} is not a full checkpoint of {parent.sandbox_id}", field="snapshot_id"
                )
            source = snapshot_id
            await asyncio.gather(*(self._fork_child(parent, source, cid) for cid in missing))
        return [self.agent.get(cid) for cid in child_ids]

    async def _fork_child(self, parent: SandboxHandle, snapshot_id: str, child_id: str) -> None:
        if child_id in self.agent.sandboxes:
            return
        spec = SandboxSpec(
            sandbox_id=child_id,
            template=parent.spec.template,
            limits=parent.spec.limits,
            env=dict(parent.spec.env),
        )
        child = SandboxHandle(child_id, spec, State.PENDING, time.time())
        self.agent.sandboxes[child_id] = child
        driver = self.agent.driver

        async def effect() -> None:
            child.channel = await driver.restore(
                child_id, snapshot_id, source_sandbox_id=parent.sandbox_id, limits=spec.limits
            )
            await GuestSession(child.channel).reseed()

        async with child.lock:
            try:
                await self.agent._step(child, Event.FORK, Event.CREATED, effect)
            except BaseException:
                with contextlib.suppress(Exception):
                    await driver.destroy(child_id)
                self.agent.sandboxes.pop(child_id, None)
                raise

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        handle = self.agent.get(sandbox_id)
        snapshot_id = parse_snapshot_id(snapshot_id)
        if snapshot_id not in handle.snapshots:
            return  # already gone: a repeated delete converges
        with contextlib.suppress(errors.NotFound):
            await self.agent.delete_snapshot(handle.sandbox_id, snapshot_id)

    # -- data plane: streams -----------------------------------------------------------------------------
    async def relay(self, sandbox_id: str, call: Call) -> AsyncGenerator[dict[str, Any], None]:
        """A process call (start or attach) as exec-stream events; cancels the call if abandoned."""
        try:
            async for item in call.events():
                self.touch(sandbox_id)
                if item.kind == FrameType.DATA and item.channel in (Channel.STDOUT, Channel.STDERR):
                    kind = "stderr" if item.channel == Channel.STDERR else "stdout"
                    yield {"type": kind, "data_b64": base64.b64encode(item.data).decode()}
                elif item.kind == FrameType.EVENT:
                    yield dict(item.event)
            result = await call.result()
            self.touch(sandbox_id)
            if "exit_code" in result or "signal" in result or "timed_out" in result:
                yield {
                    "type": "exit",
                    "exit_code": result.get("exit_code"),
                    "signal": result.get("signal"),
                    "timed_out": bool(result.get("timed_out", False)),
                    "process_id": result.get("process_id"),
                    "offset": result.get("offset"),
                }
            else:  # attach with follow=false: what was buffered has been sent
                yield {"type": "end", "offset": result.get("offset"), "running": result.get("running")}
        finally:
            await _finish(call)

    async def watch(self, sandbox_id: str, call: Call) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for item in call.events():
                if item.kind == FrameType.EVENT:
                    self.touch(sandbox_id)
                    yield dict(item.event)
            await call.result()
        finally:
            await _finish(call)

    async def read_file(
        self, sandbox_id: str, session: GuestSession, path: str, offset: int, length: int | None
    ) -> AsyncGenerator[bytes, None]:
        position, remaining = offset, length
        while remaining is None or remaining > 0:
            want = READ_WINDOW if remaining is None else min(READ_WINDOW, remaining)
            call = await session.channel.open(
                m.FILES_READ, {"path": path, "offset": position, "length": want}
            )
            got = 0
            try:
                async for item in call.events():
                    if item.kind == FrameType.DATA and item.data:
                        got += len(item.data)
                        self.touch(sandbox_id)
                        yield item.data
                await call.result()
            finally:
                await _finish(call)
            position += got
            if remaining is not None:
                remaining -= got
            if got < want:
                return

    async def write_body(self, call: Call, body: AsyncIterator[bytes], sandbox_id: str) -> dict[str, Any]:
        """Stream a request body into a call (files.write, process.input) and return its result."""
        try:
            try:
                async for chunk in body:
                    if call.done:
                        break  # the daemon already refused (disk full, process gone): stop sending
                    if chunk:
                        await call.send(chunk)
                        self.touch(sandbox_id)
                if not call.done:
                    await call.send_eof()
            except errors.ChannelError:
                if not call.done:
                    raise
            return await call.result()
        finally:
            # Client disconnect or any failure before EOF: cancel, so files.write discards its temp file.
            await _finish(call)


def _egress_request(body: rm.EgressBody) -> EgressRequest:
    wanted = EgressRequest(allow=body.allow, deny=body.deny, version=body.version)
    wanted.policy()  # InvalidArgument (400) for a malformed entry, before anything is created
    return wanted


def public_url(url: str) -> str:
    """A store URL without credentials (an s3:// URL may carry access_key/secret_key in its query)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in {"access_key", "secret_key"}]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, safe=":/")))


def _data_key(body: rm.DataKeyBody | None) -> DataKey | None:
    if body is None:
        return None
    return DataKey(
        key_id=body.key_id,
        wrapped=base64.b64decode(body.wrapped_b64),
        plaintext=base64.b64decode(body.plaintext_b64),
    )


def _snapshot_info(sandbox_id: str, record: SnapshotRecord) -> rm.SnapshotInfo:
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


async def _ndjson(events: AsyncGenerator[dict[str, Any], None]) -> Response:
    """An NDJSON response whose first item is awaited before the headers go out, so an error that happens
    at once (unknown process, stopped sandbox) is a normal HTTP error with its status."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return Response(b"", media_type=NDJSON)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _ndjson_line(first)
            async for item in events:
                yield _ndjson_line(item)
        except errors.SpaceError as exc:
            yield _ndjson_line({"type": "error", **rest_errors.body_of(exc)})
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()

    return StreamingResponse(body(), media_type=NDJSON, headers={"Cache-Control": "no-store"})


async def _bytes_response(chunks: AsyncGenerator[bytes, None]) -> Response:
    """Raw bytes streamed; the first chunk is awaited first so e.g. a missing file is a 404, not an empty
    200. An error later aborts the connection (the chunked body never ends), which the client detects."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        return Response(b"", media_type="application/octet-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    return StreamingResponse(body(), media_type="application/octet-stream")


# -- routes --------------------------------------------------------------------------------------------------
# Module level: FastAPI resolves the (string) annotations of the route functions in this module's globals.
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
PathQuery = Annotated[str, Query(min_length=1)]


def _routes(svc: NodeService) -> APIRouter:
    r = APIRouter(prefix=API_PREFIX, dependencies=[Depends(require_capability)])

    # node
    @r.get("/info", response_model=rm.NodeInfo)
    async def node_info() -> rm.NodeInfo:
        return svc.info()

    @r.get("/sandboxes", response_model=rm.SandboxList)
    async def list_sandboxes(guest: bool = True) -> rm.SandboxList:
        return await svc.observe_all(guest=guest)

    # lifecycle
    @r.get("/sandboxes/{sandbox_id}", response_model=rm.SandboxObserved)
    async def get_sandbox(sandbox_id: str) -> rm.SandboxObserved:
        return await svc.observe_one(svc.agent.get(sandbox_id))

    @r.put("/sandboxes/{sandbox_id}", response_model=rm.SandboxObserved, status_code=201)
    async def put_sandbox(
        sandbox_id: str, body: rm.CreateSandboxRequest, response: Response
    ) -> rm.SandboxObserved:
        observed, created = await svc.create(sandbox_id, body)
        response.status_code = 201 if created else 200
        return observed

    def action_route(action: str) -> None:
        async def run_action(sandbox_id: str) -> rm.SandboxObserved:
            return await svc.act(sandbox_id, action)

        r.add_api_route(
            f"/sandboxes/{{sandbox_id}}/{action}",
            run_action,
            methods=["POST"],
            response_model=rm.SandboxObserved,
            name=f"{action}_sandbox",
        )

    for action in _ACTION_TARGET:
        action_route(action)

    @r.delete("/sandboxes/{sandbox_id}", response_model=rm.DeleteResult)
    async def delete_sandbox(sandbox_id: str) -> rm.DeleteResult:
        return await svc.delete(sandbox_id)

    @r.post("/sandboxes/{sandbox_id}/snapshots", response_model=rm.SnapshotInfo, status_code=201)
    async def create_snapshot(
        sandbox_id: str, body: rm.SnapshotRequest, idempotency_key: IdempotencyKey = None
    ) -> rm.SnapshotInfo:
        result: rm.SnapshotInfo = await svc.replays.run(
            idempotency_key, f"snapshot:{sandbox_id}", body.model_dump(),
            lambda: svc.snapshot(sandbox_id, body.full),
        )  # fmt: skip
        return result

    @r.get("/sandboxes/{sandbox_id}/snapshots", response_model=rm.SnapshotList)
    async def list_snapshots(sandbox_id: str) -> rm.SnapshotList:
        return await svc.snapshots(sandbox_id)

    # suspend / restore / recover (object storage; docs/adr/0012-suspend-restore-on-nodes.md)
    @r.post("/sandboxes/restore", response_model=rm.SandboxObserved)
    async def restore_sandbox(body: rm.RestoreRequest) -> rm.SandboxObserved:
        return await svc.restore(body)

    @r.post("/sandboxes/{sandbox_id}/suspend", response_model=rm.TransferResult)
    async def suspend_sandbox(sandbox_id: str, body: rm.SuspendRequest) -> rm.TransferResult:
        return await svc.suspend(sandbox_id, body)

    @r.post("/sandboxes/{sandbox_id}/snapshots/{snapshot_id}/upload", response_model=rm.TransferResult)
    async def upload_snapshot(sandbox_id: str, snapshot_id: str, body: rm.UploadRequest) -> rm.TransferResult:
        return await svc.upload(sandbox_id, snapshot_id, body)

    @r.post("/sandboxes/{sandbox_id}/recover", response_model=rm.SandboxObserved)
    async def recover_sandbox(sandbox_id: str, body: rm.RecoverRequest) -> rm.SandboxObserved:
        return await svc.recover(sandbox_id, body)

    @r.delete("/sandboxes/{sandbox_id}/snapshots/{snapshot_id}")
    async def delete_snapshot(sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
        await svc.delete_snapshot(sandbox_id, snapshot_id)
        return {}

    @r.post("/sandboxes/{sandbox_id}/rollback", response_model=rm.SandboxObserved)
    async def rollback(sandbox_id: str, body: rm.RollbackRequest) -> rm.SandboxObserved:
        return await svc.rollback(sandbox_id, body.snapshot_id)

    @r.post("/sandboxes/{sandbox_id}/fork", response_model=rm.SandboxList, status_code=201)
    async def fork(
        sandbox_id: str, body: rm.ForkRequest, idempotency_key: IdempotencyKey = None
    ) -> rm.SandboxList:
        children: list[rm.SandboxObserved] = await svc.replays.run(
            idempotency_key, f"fork:{sandbox_id}", body.model_dump(), lambda: svc.fork(sandbox_id, body)
        )
        return rm.SandboxList(sandboxes=children)

    # egress policy pushed by the control plane at run time (issue 5)
    @r.put("/sandboxes/{sandbox_id}/egress")
    async def set_egress(sandbox_id: str, request: Request) -> dict[str, Any]:
        """Record the sandbox's new policy (newer versions only) and hand it to the node's egress gateway
        (space.node.agent.egress_wiring: in force at once, the sandbox's cached credentials dropped)."""
        handle = svc.agent.get(sandbox_id)  # NotFound for a sandbox this node does not run
        body = await request.json()
        policy, names = dict(body.get("policy") or {}), [str(n) for n in body.get("credentials") or []]
        if svc.egress is not None:
            try:
                wanted = EgressRequest.model_validate(
                    {"allow": policy.get("allow") or [], "deny": policy.get("deny") or [],
                     "version": int(policy.get("version") or 0),
                     "private_networks": policy.get("private_networks")}
                )  # fmt: skip
            except (ValidationError, TypeError, ValueError) as exc:
                raise errors.InvalidArgument(f"egress policy: {exc}", field="policy") from exc
            return await svc.egress.apply(handle.sandbox_id, wanted, names)
        policies = svc.egress_policies
        known = policies.get(handle.sandbox_id)
        if known is not None and int(known["policy"].get("version", 0)) > int(policy.get("version", 0)):
            return {"applied": False, "reason": "stale", "version": known["policy"].get("version")}
        policies[handle.sandbox_id] = {"policy": policy, "credentials": names}
        reason = "no egress gateway on this node"
        return {"applied": False, "reason": reason, "version": policy.get("version")}

    # data plane: processes
    @r.post("/sandboxes/{sandbox_id}/exec", response_model=None)
    async def exec_command(sandbox_id: str, body: rm.ExecRequest) -> Response | rm.ExecResponse:
        handle, session = await svc.session(sandbox_id)
        if body.stream:
            params = _command_params(body)
            stdin = body.stdin
            params["stdin"] = stdin is not None
            call = await session.channel.open(m.PROCESS_START, params)
            if stdin is not None:
                try:
                    if stdin:
                        await call.send(stdin)
                    await call.send_eof()
                except BaseException:
                    await _finish(call)
                    raise
            return await _ndjson(svc.relay(handle.sandbox_id, call))
        result = await session.exec(
            body.command, env=body.env or None, cwd=body.cwd, user=body.user, timeout=body.timeout,
            stdin=body.stdin, max_output=body.max_output_bytes,
        )  # fmt: skip
        svc.touch(handle.sandbox_id)
        return rm.ExecResponse(
            exit_code=result.exit_code,
            stdout_b64=base64.b64encode(result.stdout).decode(),
            stderr_b64=base64.b64encode(result.stderr).decode(),
            stdout=result.stdout.decode("utf-8", "replace"),
            stderr=result.stderr.decode("utf-8", "replace"),
            process_id=result.process_id,
            timed_out=result.timed_out,
            signal=result.signal,
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
        )

    @r.post("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessStarted, status_code=201)
    async def start_process(sandbox_id: str, body: rm.ProcessStartRequest) -> rm.ProcessStarted:
        _, session = await svc.session(sandbox_id)
        started = await session.start_background(
            body.command, env=body.env or None, cwd=body.cwd, user=body.user, timeout=body.timeout,
            tag=body.tag, pty=(body.pty.rows, body.pty.cols) if body.pty else None, stdin=body.stdin,
        )  # fmt: skip
        return rm.ProcessStarted.model_validate(started)

    @r.get("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessList)
    async def list_processes(sandbox_id: str) -> rm.ProcessList:
        _, session = await svc.session(sandbox_id)
        return rm.ProcessList(processes=await session.processes())

    @r.get("/sandboxes/{sandbox_id}/processes/{process_id}/output", response_model=None)
    async def process_output(
        sandbox_id: str, process_id: str, offset: Annotated[int, Query(ge=0)] = 0, follow: bool = True
    ) -> Response:
        handle, session = await svc.session(sandbox_id)
        call = await session.channel.open(
            m.PROCESS_ATTACH, {"process_id": process_id, "offset": offset, "follow": follow}
        )
        return await _ndjson(svc.relay(handle.sandbox_id, call))

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", response_model=rm.StdinWritten)
    async def process_stdin(
        sandbox_id: str, process_id: str, request: Request, eof: bool = False
    ) -> rm.StdinWritten:
        handle, session = await svc.session(sandbox_id)
        call = await session.channel.open(m.PROCESS_INPUT, {"process_id": process_id, "eof": eof})
        result = await svc.write_body(call, request.stream(), handle.sandbox_id)
        return rm.StdinWritten(written=int(result.get("written", 0)))

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/signal")
    async def process_signal(sandbox_id: str, process_id: str, body: rm.SignalRequest) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        await session.signal(process_id, body.signal)
        return {}

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/resize")
    async def process_resize(sandbox_id: str, process_id: str, body: rm.ResizeRequest) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        await session.resize(process_id, body.rows, body.cols)
        return {}

    # data plane: files
    @r.put("/sandboxes/{sandbox_id}/files", response_model=rm.FileWritten)
    async def write_file(
        sandbox_id: str,
        path: PathQuery,
        request: Request,
        mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None,
        append: bool = False,
    ) -> rm.FileWritten:
        handle, session = await svc.session(sandbox_id)
        params: dict[str, Any] = {"path": path, "append": append}
        if mode is not None:
            params["mode"] = mode
        call = await session.channel.open(m.FILES_WRITE, params)
        try:
            result = await svc.write_body(call, request.stream(), handle.sandbox_id)
        except ClientDisconnect as exc:
            raise errors.InvalidArgument("the client went away before the upload ended") from exc
        return rm.FileWritten(size=int(result.get("size", 0)))

    @r.get("/sandboxes/{sandbox_id}/files", response_model=None)
    async def read_file(
        sandbox_id: str,
        path: PathQuery,
        offset: Annotated[int, Query(ge=0)] = 0,
        length: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        handle, session = await svc.session(sandbox_id)
        return await _bytes_response(svc.read_file(handle.sandbox_id, session, path, offset, length))

    @r.get("/sandboxes/{sandbox_id}/files/list", response_model=rm.FileList)
    async def list_files(sandbox_id: str, path: PathQuery) -> rm.FileList:
        _, session = await svc.session(sandbox_id)
        # Not GuestSession.list_dir: a large directory arrives as "entries" event batches before the result.
        call = await session.channel.open(m.FILES_LIST, {"path": path})
        entries: list[dict[str, Any]] = []
        try:
            async for item in call.events():
                if item.kind == FrameType.EVENT and item.event.get("type") == "entries":
                    entries.extend(item.event.get("entries", []))
            entries.extend((await call.result()).get("entries", []))
        finally:
            await _finish(call)
        return rm.FileList(entries=entries)

    @r.get("/sandboxes/{sandbox_id}/files/stat")
    async def stat_file(sandbox_id: str, path: PathQuery) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        return await session.stat(path)

    @r.post("/sandboxes/{sandbox_id}/files/mkdir")
    async def make_dir(sandbox_id: str, body: rm.MkdirRequest) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        await session.mkdir(body.path, parents=body.parents, mode=body.mode)
        return {}

    @r.delete("/sandboxes/{sandbox_id}/files")
    async def remove_file(sandbox_id: str, path: PathQuery, recursive: bool = False) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        await session.remove(path, recursive=recursive)
        return {}

    @r.post("/sandboxes/{sandbox_id}/files/rename")
    async def rename_file(sandbox_id: str, body: rm.RenameRequest) -> dict[str, Any]:
        _, session = await svc.session(sandbox_id)
        await session.rename(body.src, body.dst)
        return {}

    @r.get("/sandboxes/{sandbox_id}/files/watch", response_model=None)
    async def watch_files(sandbox_id: str, path: PathQuery, recursive: bool = False) -> Response:
        handle, session = await svc.session(sandbox_id)
        call = await session.watch(path, recursive=recursive)
        return await _ndjson(svc.watch(handle.sandbox_id, call))

    @r.websocket("/sandboxes/{sandbox_id}/pty")
    async def pty(
        websocket: WebSocket, sandbox_id: str, rows: int = 24, cols: int = 80, cmd: str = "/bin/bash"
    ) -> None:
        await _pty(svc, websocket, sandbox_id, rows=rows, cols=cols, cmd=cmd)

    return r


async def _pty(
    svc: NodeService, websocket: WebSocket, sandbox_id: str, *, rows: int, cols: int, cmd: str
) -> None:
    """A terminal: client binary frames are its input, its output goes back as binary frames; a client text
    frame {"resize": [rows, cols]} resizes it. The server also sends text frames {"type": "started", ...}
    and {"type": "exit", ...} (or {"type": "error", "error": {...}}) and then closes (4000 + status on
    error). A client that goes away hangs up the terminal (SIGHUP to its process group)."""
    await websocket.accept()
    try:
        size = rm.PtySize(rows=rows, cols=cols)
        handle, session = await svc.session(sandbox_id)
        call = await session.channel.open(
            m.PROCESS_START, {"cmd": cmd, "pty": size.model_dump(), "stdin": True}
        )
    except (errors.SpaceError, ValidationError) as exc:
        error = rest_errors.request_invalid(exc) if isinstance(exc, ValidationError) else exc
        with contextlib.suppress(Exception):
            await websocket.send_text(json.dumps(rest_errors.body_of(error) | {"type": "error"}))
            await websocket.close(code=4000 + rest_errors.status_for(error), reason=error.code)
        return

    started = asyncio.Event()
    process_id = ""

    async def output() -> None:
        nonlocal process_id
        async for item in call.events():
            svc.touch(handle.sandbox_id)
            if item.kind == FrameType.DATA and item.channel in (Channel.STDOUT, Channel.STDERR):
                await websocket.send_bytes(item.data)
            elif item.kind == FrameType.EVENT:
                if item.event.get("type") == "started":
                    process_id = str(item.event.get("process_id", ""))
                    started.set()
                await websocket.send_text(json.dumps(item.event))
        result = await call.result()
        await websocket.send_text(json.dumps({"type": "exit", **result}))

    async def input_() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            svc.touch(handle.sandbox_id)
            if message.get("bytes"):
                await call.send(message["bytes"])
            elif message.get("text"):
                try:
                    request = json.loads(message["text"])
                    new_rows, new_cols = request["resize"]
                    resize = rm.ResizeRequest(rows=new_rows, cols=new_cols)
                except (ValueError, KeyError, TypeError, ValidationError):
                    await websocket.send_text(
                        json.dumps({"type": "warning", "message": 'expected {"resize": [rows, cols]}'})
                    )
                    continue
                await started.wait()
                await session.resize(process_id, resize.rows, resize.cols)

    out_task = asyncio.create_task(output())
    in_task = asyncio.create_task(input_())
    close_code = 1000
    try:
        await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
        failure = out_task.exception() if out_task.done() else None
        if isinstance(failure, errors.SpaceError):
            close_code = 4000 + rest_errors.status_for(failure)
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(rest_errors.body_of(failure) | {"type": "error"}))
        elif failure is not None and not in_task.done():
            # Not the client going away (that ends in_task, and sends then fail): a bug worth a log line.
            log.error("pty of %s failed", sandbox_id, exc_info=failure)
            close_code = 1011
        if not call.done and process_id:
            # The client hung up while the process runs: so does the terminal, as a closed one would. A
            # shell still setting itself up can miss the first SIGHUP, so it is repeated; a process that
            # ignores SIGHUP on purpose keeps running (detached, listed, attachable by id).
            for grace in PTY_HANGUP_GRACE_S:
                with contextlib.suppress(errors.SpaceError):
                    await session.signal(process_id, "SIGHUP")
                with contextlib.suppress(TimeoutError, errors.SpaceError):
                    await asyncio.wait_for(call.result(), grace)
                if call.done:
                    break
    finally:
        for task in (in_task, out_task):
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(in_task, out_task, return_exceptions=True)
            await _finish(call)
            with contextlib.suppress(Exception):
                await websocket.close(code=close_code)


# -- the app -------------------------------------------------------------------------------------------------
def create_app(agent: NodeAgent, token: str, *, templates: Sequence[str] = ("python",)) -> FastAPI:
    """The node RPC app over `agent`; every route requires `Authorization: Bearer <token>`."""
    svc = NodeService(agent, templates)
    app = FastAPI(
        title="SPACE node agent RPC",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=f"{API_PREFIX}/openapi.json",
    )
    app.state.service = svc
    app.state.rpc_token = token  # the key of the sandbox capabilities (require_capability)
    app.include_router(_routes(svc))

    rest_errors.install(app, surface="node agent")
    app.add_middleware(BearerAuth, token=token)
    return app


# -- entry point ---------------------------------------------------------------------------------------------
def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError("--listen is HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def default_store_url(data_dir: pathlib.Path) -> str:
    """A one-machine node's store: a directory next to its btrfs image (create it for the agent user with
    space.node.local.ensure_local_store)."""
    return (data_dir / "objects").as_uri()


def _build_agent(data_dir: pathlib.Path, driver: str, store_url: str | None = None) -> NodeAgent:
    if driver == "fake":
        from space.node.drivers.fake import FakeDriver
        from space.objectstore.base import open_store

        log.warning("--driver fake: sandboxes are host processes WITHOUT ISOLATION (development only)")
        return NodeAgent(FakeDriver(data_dir), store=open_store(store_url) if store_url else None)
    from space.node.local import connect_agent

    return connect_agent(data_dir, store_url=store_url)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT/SIGTERM once it has stopped, which would end the process before
    `serve()` closes the agent; this server only stops, and `serve()` returns normally."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(
    data_dir: pathlib.Path,
    listen: tuple[str, int],
    *,
    rpc_token_file: pathlib.Path | None = None,
    bootstrap_token_file: pathlib.Path | None = None,
    identity_file: pathlib.Path | None = None,
    control_plane: str | None = None,
    advertise_url: str | None = None,
    driver: str = "runsc",
    templates: Sequence[str] = ("python",),
    prepare: bool = True,
    log_level: str = "info",
    store_url: str | None = None,
    egress: EgressSettings | None = None,
    disk_reserve: DiskReserve | None = None,
) -> None:
    """Run the node agent's RPC until SIGINT/SIGTERM; sandboxes keep running when it stops (runsc). On a
    node whose sandboxes get a network, the agent runs the node's egress gateway (`egress`: its settings;
    default: state in DATA_DIR/egress, fixed ports, the system resolver and trust store).

    The RPC accepts only this node's own token (`rpc_token_file`, default DATA_DIR/identity/rpc.token, made
    at the first start); the bootstrap token (`bootstrap_token_file`) only enrols a node that has no
    identity (`identity_file`, default DATA_DIR/identity/node.json) the control plane accepts (ADR 0021)."""
    try:
        agent = _build_agent(data_dir, driver, store_url)
    except errors.Unavailable as exc:
        # e.g. the default store directory cannot be created by this user: serve without suspend/restore
        # rather than not at all (those requests then answer 400 naming the missing store).
        log.warning("object store %s unusable (%s): suspend/restore disabled on this node", store_url, exc)
        agent = _build_agent(data_dir, driver, None)
    if disk_reserve is not None:
        agent.disk_reserve = disk_reserve  # ADR 0027
    if prepare:
        await agent.prepare(tuple(templates), progress=lambda line: log.info("prepare: %s", line))
    # After prepare: on a runsc node the helper's node.prepare made the identity directory for this user.
    rpc_token = load_or_create_rpc_token(rpc_token_file or default_rpc_token_file(data_dir))
    app = create_app(agent, rpc_token, templates=templates)
    service: NodeService = app.state.service
    bootstrap_token: str | None = None
    if control_plane:
        service.identity = NodeIdentity.load(identity_file or default_identity_file(data_dir))
        if bootstrap_token_file is not None:
            bootstrap_token = read_private(bootstrap_token_file) or None
        if bootstrap_token is not None and hmac.compare_digest(bootstrap_token.encode(), rpc_token.encode()):
            raise errors.InvalidArgument(
                "the node's RPC token must not be the bootstrap token: every holder of that one could call "
                "this node (give --rpc-token-file its own file, or leave it out to have one made)",
                field="rpc_token",
            )
        if not service.identity.enrolled and bootstrap_token is None:
            log.warning("this node has no identity yet and no --bootstrap-token-file: it cannot enrol")
    # Before recover(): adopted sandboxes get their egress policies as they are reconnected.
    service.egress = await egress_install(
        agent, egress or EgressSettings(state_dir=data_dir / "egress"), control_plane=control_plane,
        identity=service.identity,
    )  # fmt: skip
    adopted = await agent.recover()
    if adopted:
        log.info("adopted %d sandboxes already on this node: %s", len(adopted), ", ".join(adopted))
    host, port = listen
    server = _Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off")
    )
    reporter: asyncio.Task[None] | None = None
    if control_plane:
        from space.node.agent.registration import report_to_control_plane

        url = advertise_url or f"http://{host}:{port}"
        reporter = asyncio.create_task(
            report_to_control_plane(service, control_plane, bootstrap_token, url, rpc_token)
        )
    try:
        await server.serve()
    finally:
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        await agent.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m space.node.agent.server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 7070), help="HOST:PORT")
    parser.add_argument(
        "--rpc-token-file", type=pathlib.Path,
        help="this node's own RPC secret, required on every RPC call (mode 0600); created with a random "
        "token if absent (default DATA_DIR/identity/rpc.token); sent to the control plane at registration",
    )  # fmt: skip
    parser.add_argument(
        "--bootstrap-token-file", type=pathlib.Path,
        help="the cluster's bootstrap token or a single-use enrolment token (mode 0600): used only to enrol "
        "a node without an identity; never accepted on the RPC",
    )  # fmt: skip
    parser.add_argument(
        "--identity-file",
        type=pathlib.Path,
        help="where the node keeps its node id and identity (default DATA_DIR/identity/node.json)",
    )
    parser.add_argument("--control-plane", help="base URL of the control plane to register with")
    parser.add_argument(
        "--advertise-url", help="the URL the control plane should call (default http://LISTEN)"
    )
    parser.add_argument("--driver", choices=["runsc", "fake"], default="runsc")
    parser.add_argument("--templates", default="python", help="comma-separated templates to prepare")
    parser.add_argument("--no-prepare", action="store_true", help="skip node/template preparation")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--store-url", default=os.environ.get("SPACE_STORE_URL"),
        help="object store for templates and suspended sandboxes (file:///dir or s3://bucket/prefix?...); "
        "default $SPACE_STORE_URL, else file://DATA_DIR/objects",
    )  # fmt: skip
    parser.add_argument(
        "--egress-config", type=pathlib.Path,
        help="JSON operator settings of the node's egress gateway (network = sandbox): ports, hosts (a "
        "static name -> addresses map instead of the system resolver), trust_store, allow_networks; see "
        "space.node.agent.egress_wiring.load_settings",
    )  # fmt: skip
    parser.add_argument(
        "--disk-reserve", default=os.environ.get("SPACE_DISK_RESERVE", "5,2048"), metavar="PERCENT,MB",
        help="free space the node keeps: creates, snapshots, checkpoints and imports are refused when they "
        "would leave less than min(PERCENT of the disk, MB) (default 5,2048; ADR 0027)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        percent, mb = args.disk_reserve.split(",")
        disk_reserve = DiskReserve(percent=float(percent), mb=int(mb))
    except ValueError:  # pydantic's ValidationError is a ValueError
        parser.error("--disk-reserve is PERCENT,MB: a percentage from 0 to 50 and a whole number of MB")
    os.umask(0o077)  # the agent's object-store parts, CA key, policies: its own only (ADR 0022)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    data_dir = args.data_dir.resolve()
    from space.node.rlimits import raise_fd_limit  # descriptors per sandbox channel, stream and connection

    raise_fd_limit()
    # uvicorn handles SIGINT/SIGTERM inside serve(); SIGPIPE must not kill us when a client vanishes.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    asyncio.run(
        serve(
            data_dir, args.listen, rpc_token_file=args.rpc_token_file,
            bootstrap_token_file=args.bootstrap_token_file, identity_file=args.identity_file,
            control_plane=args.control_plane, advertise_url=args.advertise_url, driver=args.driver,
            templates=tuple(t for t in args.templates.split(",") if t), prepare=not args.no_prepare,
            log_level=args.log_level,
            store_url=args.store_url or default_store_url(data_dir),
            egress=load_egress_settings(data_dir / "egress", args.egress_config),
            disk_reserve=disk_reserve,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
