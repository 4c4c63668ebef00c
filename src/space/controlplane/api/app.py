"""The public API gateway (FastAPI): authentication, authorization, desired state, and the data-plane relay.

Invariants:
- Lifecycle routes only *record desired state* (after checking the transition table allows the request,
  so a refused request is a 409 naming the current state) and then wait for the reconciler to settle it;
  they never call a node themselves.
- A key sees only its project's sandboxes: another project's sandbox is a 404 exactly like a missing one.
- Mutations with an `Idempotency-Key` run once per (key id, project id, Idempotency-Key); replays (also
  concurrent ones) get the first answer; the same key with another body is a 409.
- The data plane is relayed to the sandbox's node as a stream in both directions (no whole-file buffering);
  a paused sandbox is resumed first, and every relayed request counts as activity.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from space.controlplane.keys import DataKeys
from space.controlplane.nodes import NodePool
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.retention import purge_expired
from space.controlplane.scheduler import check_admissible
from space.controlplane.snapshots import SnapshotKeeper, report_lost_node_crashes
from space.controlplane.store.records import ApiKeyRecord, SandboxRecord, SnapshotRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.ids import (
    new_sandbox_id,
    parse_api_key_id,
    parse_process_id,
    parse_sandbox_id,
    parse_snapshot_id,
)
from space.core.lifecycle import Event, State, transition
from space.core.retention import SnapshotPolicy
from space.core.settings import SandboxLimits
from space.node.agent import rpc_models as rm
from space.rest import errors as rest_errors

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 120.0
MAX_UPLOAD_BYTES = 8 << 30
SMALL_BODY_BYTES = 64 << 10


# -- request bodies ------------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EgressSpec(_Body):
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    credentials: list[str] = Field(default_factory=list)


class CreateSandbox(_Body):
    template: str = "python"
    env: dict[str, str] = Field(default_factory=dict)
    limits: SandboxLimits | None = None
    idle_timeout_s: int | None = Field(default=None, gt=0)
    ttl_s: int | None = Field(default=None, gt=0)
    wait: bool = True
    allow: list[str] = Field(default_factory=list)
    credentials: list[str] = Field(default_factory=list)
    egress: EgressSpec | None = None  # issue 5: {"allow", "deny", "credentials"}; merged with the two above
    snapshot_policy: SnapshotPolicy | None = None  # issue 4: scheduled snapshots + retention


class PatchSandbox(_Body):
    # Explicit null removes the policy; an absent field leaves it as it is.
    snapshot_policy: SnapshotPolicy | None = None


class ForkBody(_Body):
    count: int = Field(default=1, ge=1, le=100)


class RollbackBody(_Body):
    snapshot_id: str


class SnapshotBody(_Body):
    full: bool = False


class ProjectBody(_Body):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class KeyBody(_Body):
    project: str
    role: Literal["admin", "member", "read-only"] = "member"


# -- principals ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Principal:
    key: ApiKeyRecord
    project_id: str

    @property
    def role(self) -> str:
        return self.key.role

    def require(self, needed: Literal["read-only", "member", "admin"]) -> None:
        order = {"read-only": 0, "member": 1, "admin": 2}
        if order[self.role] < order[needed]:
            raise errors.PermissionDenied(f"a {self.role} key may not do this (needs {needed})")


NODE_LOST_AFTER_S = 15.0
IDEMPOTENCY_STALE_S = 3.0  # an in-progress request not heard of for this long died with its process
AUTH_CACHE_S = 5.0  # a revoked key keeps working at most this long on other replicas
RUNNING_CACHE_S = 1.0  # how long a data-plane request trusts that a sandbox it saw running still is
ACTIVITY_DEBOUNCE_S = 1.0


@dataclass
class Services:
    store: Store
    nodes: NodePool
    reconciler: Reconciler
    snapshots: SnapshotKeeper
    node_token: str
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    # Hot-path caches of the data plane: the database is the truth, these only save round trips.
    keys: dict[str, tuple[ApiKeyRecord, float]] = field(default_factory=dict)
    projects: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    running: dict[tuple[str, str], tuple[SandboxRecord, float]] = field(default_factory=dict)
    activity: dict[str, float] = field(default_factory=dict)

    def forget(self, sandbox_id: str) -> None:
        for cache_key in [k for k in self.running if k[1] == sandbox_id]:
            self.running.pop(cache_key, None)


def sandbox_view(sb: SandboxRecord) -> dict[str, Any]:
    return {
        "id": sb.id,
        "project_id": sb.project_id,
        "template": sb.template,
        "state": sb.state.value,
        "desired_state": sb.desired_state.value,
        "generation": sb.generation,
        "node_id": sb.node_id,
        "env": sb.env,
        "limits": sb.limits.model_dump(),
        "idle_timeout_s": sb.idle_timeout_s,
        "ttl_s": sb.ttl_s,
        "created_at": sb.created_at.isoformat(),
        "updated_at": sb.updated_at.isoformat(),
        "last_activity_at": sb.last_activity_at.isoformat(),
        "error": sb.error,
        "forked_from": sb.forked_from,
        # Issue 4: what happened to the sandbox that the user should be able to see.
        "notice": sb.notice,
        "crash_count": sb.crash_count,
        "recovered_at": sb.recovered_at.isoformat() if sb.recovered_at else None,
        "recovered_from": sb.recovered_from,
        "suspended_snapshot_id": sb.suspended_snapshot_id if sb.state == State.SUSPENDED else None,
        "snapshot_policy": sb.snapshot_policy,
    }


def snapshot_view(snap: SnapshotRecord, exclusive_bytes: int | None = None) -> dict[str, Any]:
    locations = snap.locations
    return {
        "id": snap.id,
        "sandbox_id": snap.sandbox_id,
        "kind": snap.kind,
        "state": snap.state,
        "created_at": snap.created_at.isoformat(),
        "size_bytes": snap.size_bytes,
        "exclusive_bytes": exclusive_bytes if exclusive_bytes is not None else snap.exclusive_bytes,
        # "location" (one word, kept for older clients) and "locations" (every place a copy is).
        "location": "node" if snap.node_id else ("objectstore" if locations else "none"),
        "locations": locations,
        "node_id": snap.node_id,
        "restorable": snap.restorable,
        "uploaded_at": snap.uploaded_at.isoformat() if snap.uploaded_at else None,
        "origin": snap.origin,
        "error": snap.error,
    }


def create_app(
    store: Store,
    *,
    node_token: str,
    run_reconciler: bool = True,
    data_dir: pathlib.Path | None = None,
    store_url: str | None = None,
    data_keys: DataKeys | None = None,
) -> FastAPI:
    """`store_url`: the object store shared with the nodes (suspend/restore and uploads; None: suspend is
    refused). `data_keys`: wraps per-artifact keys (None: the default, one local key per org under
    `data_dir`/keys; without data_dir, artifacts are not encrypted)."""
    registry = CollectorRegistry()
    nodes = NodePool(store, node_token)  # per node: a control pool and a tenant-fair data pool (ADR 0025)
    objects = None
    if store_url is not None:
        from space.objectstore.base import open_store

        objects = open_store(store_url)
    if data_keys is None and data_dir is not None:
        from space.controlplane.keys import OrgDataKeys

        data_keys = OrgDataKeys.local(store, data_dir / "keys")
    reconciler = Reconciler(store, nodes, objects=objects, store_url=store_url, data_keys=data_keys)
    services = Services(
        store=store,
        nodes=nodes,
        reconciler=reconciler,
        snapshots=SnapshotKeeper(reconciler),
        node_token=node_token,
        registry=registry,
        requests=Counter("space_api_requests", "API requests", ["route", "status"], registry=registry),
        latency=Histogram("space_api_latency_seconds", "API latency", ["route"], registry=registry),
    )

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background: list[asyncio.Task[None]] = []
        if run_reconciler:
            services.reconciler.start()
            background.append(asyncio.create_task(_housekeeping(services), name="housekeeping"))
        yield
        for task in background:
            task.cancel()
        await services.reconciler.stop()
        await services.nodes.aclose()

    app = FastAPI(title="SPACE", version="1", lifespan=lifespan)  # type: ignore[arg-type]
    app.state.services = services
    rest_errors.install(app, surface="control plane API")

    @app.middleware("http")
    async def _metrics(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        services.requests.labels(name, str(response.status_code)).inc()
        services.latency.labels(name).observe(time.perf_counter() - started)
        return response

    @app.get("/healthz", include_in_schema=False)
    async def _health() -> dict[str, Any]:
        await asyncio.to_thread(store.ping)
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def _metrics_route(authorization: Annotated[str | None, Header()] = None) -> Response:
        # Route names, statuses and rates of every tenant: for the operator (an org admin key), no one else.
        key = await authenticate_key(services, authorization)
        if key.project_id is not None or key.role != "admin":
            raise errors.PermissionDenied("only an organization admin key may read /metrics")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(_public_router(services), prefix="/v1")
    from space.controlplane.api import node_routes  # (imports this module)

    app.include_router(node_routes.router(services), prefix="/v1/nodes")
    from space.controlplane.api import credentials as credentials_api  # issue 5 (imports this module)

    app.include_router(credentials_api.install(services, data_dir))
    from space.controlplane.api import limits  # (imports this module) outermost: before any body is read

    app.add_middleware(limits.RequestLimits, services=services)
    return app


async def _housekeeping(services: Services) -> None:
    """Idle sandboxes get paused and lost nodes marked every second; orphans on nodes are collected in a
    loop of their own, so a hung node cannot hold up the rest."""

    async def every(period: float, work: Callable[[], Awaitable[object]], what: str) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping: %s failed", what)

    await asyncio.gather(
        every(1.0, lambda: _pause_idle(services), "pausing idle sandboxes"),
        every(
            1.0, lambda: asyncio.to_thread(services.store.mark_lost, NODE_LOST_AFTER_S), "marking lost nodes"
        ),
        every(5.0, services.reconciler.collect_orphans, "collecting orphans"),
        every(1.0, services.snapshots.run_policies, "taking scheduled snapshots"),
        every(2.0, services.snapshots.collect, "removing deleted snapshots"),
        every(300.0, services.snapshots.sweep_objects, "removing artifacts nothing refers to"),
        every(1.0, lambda: report_lost_node_crashes(services.reconciler), "recovering lost nodes' sandboxes"),
        every(600.0, lambda: purge_expired(services.store), "deleting expired idempotency and audit rows"),
    )


async def _pause_idle(services: Services) -> None:
    store = services.store
    now = store.now()
    for node in await asyncio.to_thread(store.list_nodes, "ready"):
        for sb in await asyncio.to_thread(store.list_sandboxes_on_node, node.id):
            idle = (now - sb.last_activity_at).total_seconds()
            if (
                sb.idle_timeout_s
                and sb.state == State.RUNNING
                and sb.desired_state == State.RUNNING
                and idle > sb.idle_timeout_s
            ):
                services.forget(sb.id)
                with contextlib.suppress(errors.Conflict, errors.InvalidState):
                    await asyncio.to_thread(store.set_desired, sb.id, State.PAUSED, sb.generation)
                services.reconciler.poke()


# -- authentication ------------------------------------------------------------------------------------------
def _services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def principal(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_space_project: Annotated[str | None, Header()] = None,
) -> Principal:
    return await authenticate(_services(request), authorization, x_space_project)


async def authenticate_key(services: Services, authorization: str | None) -> ApiKeyRecord:
    """The API key of an `Authorization: Bearer <key>` header (Unauthenticated: none, unknown, revoked)."""
    if not authorization or not authorization.startswith("Bearer "):
        raise errors.Unauthenticated("missing API key (Authorization: Bearer <key>)")
    secret = authorization.removeprefix("Bearer ").strip()
    digest = hashlib.sha256(secret.encode()).hexdigest()
    cached = services.keys.get(digest)
    now = time.monotonic()
    if cached is not None and cached[1] > now:
        return cached[0]
    found = await asyncio.to_thread(services.store.authenticate, secret)
    if found is None:
        services.keys.pop(digest, None)
        raise errors.Unauthenticated("unknown or revoked API key")
    services.keys[digest] = (found, now + AUTH_CACHE_S)
    return found


async def authenticate(
    services: Services, authorization: str | None, x_space_project: str | None
) -> Principal:
    """The principal of a request's headers (HTTP and WebSocket alike)."""
    key = await authenticate_key(services, authorization)
    now = time.monotonic()
    project_id = key.project_id
    name = x_space_project or "default"
    resolved = services.projects.get((key.org_id, name)) if project_id is None else None
    if resolved is not None and resolved[1] > now:
        project_id = resolved[0]
    if project_id is None:
        # An org-level key acts in the project named by X-Space-Project, else the org's "default" project.
        project = await asyncio.to_thread(services.store.get_project_by_name, key.org_id, name)
        if project is None and name.startswith("prj-"):
            project = await asyncio.to_thread(services.store.get_project, name)
            if project is not None and project.org_id != key.org_id:
                project = None
        if project is None:
            raise errors.NotFound(f"project {name!r} not found")
        project_id = project.id
        services.projects[(key.org_id, name)] = (project_id, now + AUTH_CACHE_S)
    return Principal(key, project_id)


Auth = Annotated[Principal, Depends(principal)]


async def _sandbox(services: Services, who: Principal, sandbox_id: str) -> SandboxRecord:
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    sb = await asyncio.to_thread(services.store.get_sandbox, who.project_id, sandbox_id)
    if sb is None or sb.state == State.DELETED:
        raise errors.NotFound(f"sandbox {sandbox_id} not found")
    return sb


async def _wait_settled(
    services: Services, sandbox_id: str, timeout: float = WAIT_TIMEOUT_S
) -> SandboxRecord:
    """Until the reconciler has made state == desired_state (or gave up)."""
    services.reconciler.poke()
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        sb = await asyncio.to_thread(services.store.load_sandbox, sandbox_id)
        if sb is None:
            raise errors.NotFound(f"sandbox {sandbox_id} not found")
        if sb.state == sb.desired_state:
            return sb
        if sb.state == State.FAILED or sb.error_permanent:
            if (sb.error or "").startswith(f"{errors.KeyRevoked.code}:"):
                # The tenant revoked its key on purpose (issue 5): 403 key_revoked, not a runtime failure.
                raise errors.KeyRevoked(
                    f"sandbox {sandbox_id} could not reach '{sb.desired_state}': {sb.error}",
                    state=sb.state.value,
                )
            if (sb.error or "").startswith(f"{errors.ArtifactCorrupt.code}:"):
                # A stored snapshot failed verification (issue 4): 502 artifact_corrupt, nothing booted.
                raise errors.ArtifactCorrupt(
                    f"sandbox {sandbox_id} could not reach '{sb.desired_state}': {sb.error}",
                    state=sb.state.value,
                )
            raise errors.RuntimeFailure(
                f"sandbox {sandbox_id} could not reach '{sb.desired_state}': {sb.error}", state=sb.state.value
            )
        if time.monotonic() > deadline:
            raise errors.Timeout(f"sandbox {sandbox_id} did not reach '{sb.desired_state}' in {timeout:.0f}s")
        # Woken at once when this process's reconciler moves a sandbox; the timeout covers the work of other
        # replicas, which only the database tells about.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(services.reconciler.changed.wait(), delay)
        delay = min(delay * 1.5, 0.1)


# -- idempotency ---------------------------------------------------------------------------------------------
async def _idempotent(
    services: Services,
    who: Principal,
    key: str | None,
    request_fingerprint: str,
    work: Callable[[], Awaitable[tuple[int, Any]]],
) -> JSONResponse:
    if not key:
        status, body = await work()
        return JSONResponse(body, status_code=status)
    scope = _idempotency_scope(who)
    digest = hashlib.sha256(request_fingerprint.encode()).hexdigest()
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        begun = await asyncio.to_thread(
            services.store.begin_idempotent, scope, key, digest, stale_after_s=IDEMPOTENCY_STALE_S
        )
        if begun.outcome == "replay":
            return JSONResponse(begun.body, status_code=int(begun.status_code or 200))
        if begun.outcome == "new":
            break
        if time.monotonic() > deadline:
            raise errors.Conflict("a request with this Idempotency-Key is still in progress", key=key)
        await asyncio.sleep(0.05)  # a concurrent twin is working: wait for its answer
    keeper = asyncio.create_task(_keep_claimed(services, scope, key))
    try:
        status, body = await work()
    except errors.SpaceError as exc:
        status, body = rest_errors.status_for(exc), rest_errors.body_of(exc)
        if status >= 500:
            await asyncio.to_thread(services.store.abandon_idempotent, scope, key)
            raise
    except BaseException:
        await asyncio.to_thread(services.store.abandon_idempotent, scope, key)
        raise
    finally:
        keeper.cancel()
    await asyncio.to_thread(services.store.finish_idempotent, scope, key, status, body)
    return JSONResponse(body, status_code=status)


def _idempotency_scope(who: Principal) -> str:
    """Whose Idempotency-Keys these are: the API key AND the project it acts in. An org key acts in any
    project (X-Space-Project); scoped by key alone, its key "k" in project B would replay (or, for a create,
    derive the id of) what the same key did in project A (ADR 0020)."""
    return f"{who.key.id}/{who.project_id}"


def _derived_sandbox_id(scope: str, key: str) -> str:
    digest = hashlib.sha256(f"{scope}\0{key}".encode()).digest()[:16]
    return "sb-" + base64.b32encode(digest).decode().lower().rstrip("=")


async def _keep_claimed(services: Services, scope: str, key: str) -> None:
    """Refresh an in-progress idempotency record while its request works, so that the record of a request
    whose process died goes stale quickly and a retry takes it over (IDEMPOTENCY_STALE_S)."""
    while True:
        await asyncio.sleep(IDEMPOTENCY_STALE_S / 3)
        with contextlib.suppress(errors.SpaceError):
            await asyncio.to_thread(services.store.touch_idempotent, scope, key)


IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=128)]


# -- public routes -------------------------------------------------------------------------------------------
def _public_router(services: Services) -> APIRouter:
    r = APIRouter()
    store = services.store

    @r.post("/sandboxes", status_code=201)
    async def create_sandbox(body: CreateSandbox, who: Auth, idem: IdempotencyKey = None) -> JSONResponse:
        who.require("member")
        # A disk no node can hold is refused now, not left waiting for a node forever (ADR 0027).
        await asyncio.to_thread(check_admissible, store, body.limits or SandboxLimits())
        egress = body.egress or EgressSpec()
        allow, bound = [*body.allow, *egress.allow], [*body.credentials, *egress.credentials]

        # With an Idempotency-Key the id is derived from it: a retry that takes over the key of a request
        # that died mid-way finds the sandbox that request recorded instead of making a second one.
        sandbox_id = _derived_sandbox_id(_idempotency_scope(who), idem) if idem else None
        if sandbox_id is None and (allow or egress.deny or bound):
            sandbox_id = new_sandbox_id()  # its egress policy is recorded before the sandbox (issue 5)

        async def work() -> tuple[int, Any]:
            env = body.env
            if sandbox_id is not None and (allow or egress.deny or bound):
                from space.controlplane.api import credentials as credentials_api

                env = await credentials_api.prepare_create(
                    services, who, sandbox_id=sandbox_id, allow=allow, deny=egress.deny, credentials=bound,
                    env=body.env,
                )  # fmt: skip
            try:
                sb = await asyncio.to_thread(
                    store.create_sandbox,
                    who.project_id,
                    body.template,
                    env,
                    body.limits,
                    idle_timeout_s=body.idle_timeout_s,
                    ttl_s=body.ttl_s,
                    sandbox_id=sandbox_id,
                    snapshot_policy=(
                        body.snapshot_policy.model_dump(mode="json") if body.snapshot_policy else None
                    ),
                )
            except errors.AlreadyExists:
                assert sandbox_id is not None
                sb = await _sandbox(services, who, sandbox_id)
            if body.wait:
                sb = await _wait_settled(services, sb.id)
            else:
                services.reconciler.poke()
            return 201, sandbox_view(sb)

        return await _idempotent(services, who, idem, f"POST /sandboxes {body.model_dump_json()}", work)

    @r.get("/sandboxes")
    async def list_sandboxes(who: Auth) -> dict[str, Any]:
        rows = await asyncio.to_thread(store.list_sandboxes, who.project_id)
        return {"sandboxes": [sandbox_view(sb) for sb in rows]}

    @r.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str, who: Auth) -> dict[str, Any]:
        return sandbox_view(await _sandbox(services, who, sandbox_id))

    @r.patch("/sandboxes/{sandbox_id}")
    async def patch_sandbox(sandbox_id: str, body: PatchSandbox, who: Auth) -> dict[str, Any]:
        who.require("member")
        sb = await _sandbox(services, who, sandbox_id)
        if "snapshot_policy" in body.model_fields_set:
            policy = body.snapshot_policy.model_dump(mode="json") if body.snapshot_policy else None
            sb = await asyncio.to_thread(store.update_observed, sb.id, snapshot_policy=policy)
        return sandbox_view(sb)

    @r.delete("/sandboxes/{sandbox_id}", status_code=202)
    async def delete_sandbox(
        sandbox_id: str, who: Auth, idem: IdempotencyKey = None, wait: bool = True
    ) -> JSONResponse:
        who.require("member")
        parse_sandbox_id(sandbox_id, field="sandbox_id")

        async def work() -> tuple[int, Any]:
            # Looked up inside: a replay of a finished DELETE must get its first answer, not a 404.
            sb = await _sandbox(services, who, sandbox_id)
            services.forget(sb.id)
            updated = await asyncio.to_thread(store.set_desired, sb.id, State.DELETED)
            if wait:
                updated = await _wait_settled(services, sb.id)
            services.reconciler.poke()
            return 202, sandbox_view(updated)

        return await _idempotent(services, who, idem, f"DELETE /sandboxes/{sandbox_id}", work)

    @r.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def create_snapshot(sandbox_id: str, body: SnapshotBody, who: Auth) -> dict[str, Any]:
        who.require("member")
        sb = await _running(services, who, sandbox_id)
        return snapshot_view(await _take_snapshot(services, sb, full=body.full))

    @r.get("/sandboxes/{sandbox_id}/snapshots")
    async def list_snapshots(sandbox_id: str, who: Auth) -> dict[str, Any]:
        sb = await _sandbox(services, who, sandbox_id)
        rows = await asyncio.to_thread(store.list_snapshots, sb.id)
        # Exclusive bytes grow as the sandbox diverges from a snapshot: ask the node for today's figure
        # (the recorded one is the fallback when the node is slow or away).
        live: dict[str, int] = {}
        if sb.node_id is not None and any(s.node_id == sb.node_id for s in rows):
            with contextlib.suppress(errors.SpaceError, TimeoutError):
                infos = await asyncio.wait_for(services.nodes.client(sb.node_id).list_snapshots(sb.id), 3.0)
                for info in infos:
                    value = getattr(info, "exclusive_bytes", None)
                    if isinstance(value, int):
                        live[info.snapshot_id] = value
        return {"snapshots": [snapshot_view(s, live.get(s.id)) for s in rows]}

    @r.post("/sandboxes/{sandbox_id}/rollback")
    async def rollback(sandbox_id: str, body: RollbackBody, who: Auth) -> dict[str, Any]:
        who.require("member")
        parse_snapshot_id(body.snapshot_id, field="snapshot_id")
        sb = await _sandbox(services, who, sandbox_id)
        snap = await asyncio.to_thread(store.get_snapshot, body.snapshot_id, project_id=who.project_id)
        if snap is None or snap.sandbox_id != sb.id:
            raise errors.NotFound(f"snapshot {body.snapshot_id} of sandbox {sandbox_id} not found")
        services.forget(sb.id)
        sb = await asyncio.to_thread(store.transition, sb.id, sb.state, sb.generation, Event.ROLLBACK)
        try:
            await services.nodes.client(_node_id(sb)).rollback(sb.id, snap.id)
        except errors.SpaceError:
            await asyncio.to_thread(store.transition, sb.id, sb.state, sb.generation, Event.FAIL)
            raise
        sb = await asyncio.to_thread(store.transition, sb.id, sb.state, sb.generation, Event.ROLLED_BACK)
        if sb.desired_state != State.RUNNING:
            sb = await asyncio.to_thread(store.set_desired, sb.id, State.RUNNING)
        return sandbox_view(sb)

    @r.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, body: ForkBody, who: Auth, idem: IdempotencyKey = None) -> JSONResponse:
        who.require("member")
        sb = await _running(services, who, sandbox_id)

        async def work() -> tuple[int, Any]:
            # One checkpoint now; every child starts from it. The children are records the reconciler
            # brings up (FORK -> creating -> running) on the parent's node, like any other create.
            snap = await _take_snapshot(services, sb, full=True)
            children = []
            for _ in range(body.count):
                children.append(
                    await asyncio.to_thread(
                        store.create_sandbox,
                        who.project_id,
                        sb.template,
                        sb.env,
                        sb.limits,
                        idle_timeout_s=sb.idle_timeout_s,
                        ttl_s=sb.ttl_s,
                        forked_from=sb.id,
                        fork_snapshot_id=snap.id,
                    )
                )
            settled = [await _wait_settled(services, child.id) for child in children]
            return 201, {"sandboxes": [sandbox_view(child) for child in settled]}

        return await _idempotent(services, who, idem, f"POST /sandboxes/{sandbox_id}/fork {body.count}", work)

    @r.post("/projects", status_code=201)
    async def create_project(body: ProjectBody, who: Auth) -> dict[str, Any]:
        if who.key.project_id is not None or who.role != "admin":
            raise errors.PermissionDenied("only an organization admin key may create projects")
        project = await asyncio.to_thread(store.create_project, who.key.org_id, body.name)
        return {"id": project.id, "name": project.name, "org_id": project.org_id}

    @r.get("/projects")
    async def list_projects(who: Auth) -> dict[str, Any]:
        projects = await asyncio.to_thread(store.list_projects, who.key.org_id)
        if who.key.project_id is not None:
            projects = [p for p in projects if p.id == who.key.project_id]
        return {"projects": [{"id": p.id, "name": p.name, "org_id": p.org_id} for p in projects]}

    @r.post("/keys", status_code=201)
    async def create_key(body: KeyBody, who: Auth) -> dict[str, Any]:
        who.require("admin")
        project = await asyncio.to_thread(store.get_project_by_name, who.key.org_id, body.project)
        if project is None and body.project.startswith("prj-"):
            project = await asyncio.to_thread(store.get_project, body.project)
        if project is None or project.org_id != who.key.org_id:
            raise errors.NotFound(f"project {body.project!r} not found")
        if who.key.project_id not in (None, project.id):
            raise errors.NotFound(f"project {body.project!r} not found")
        record, secret = await asyncio.to_thread(store.create_api_key, project.id, who.key.org_id, body.role)
        return {"id": record.id, "key": secret, "project_id": project.id, "role": record.role}

    @r.delete("/keys/{key_id}", status_code=204)
    async def revoke_key(key_id: str, who: Auth) -> Response:
        who.require("admin")
        parse_api_key_id(key_id, field="key_id")
        await asyncio.to_thread(
            store.revoke_key, key_id, org_id=who.key.org_id, project_id=who.key.project_id
        )
        for digest, (cached, _until) in list(services.keys.items()):
            if cached.id == key_id:
                services.keys.pop(digest, None)  # at once here; other replicas within AUTH_CACHE_S
        return Response(status_code=204)

    _data_plane_routes(r, services)
    # One typed route per action (no /{action} catch-all): the OpenAPI document lists each of them.
    lifecycle_targets: dict[str, tuple[Event, State]] = {
        "pause": (Event.PAUSE, State.PAUSED),
        "resume": (Event.RESUME, State.RUNNING),
        "stop": (Event.STOP, State.STOPPED),
        "start": (Event.START, State.RUNNING),
        "suspend": (Event.SUSPEND, State.SUSPENDED),
        "restore": (Event.RESTORE, State.RUNNING),
    }

    def lifecycle_route(action: str, event: Event, target: State) -> None:
        async def lifecycle_action(
            sandbox_id: str, who: Auth, idem: IdempotencyKey = None, wait: bool = True
        ) -> JSONResponse:
            who.require("member")
            if action == "suspend" and services.reconciler.objects is None:
                raise errors.InvalidArgument(
                    "suspend needs object storage: start the control plane with --store-url", action=action
                )
            parse_sandbox_id(sandbox_id, field="sandbox_id")

            async def work() -> tuple[int, Any]:
                sb = await _sandbox(services, who, sandbox_id)
                current = await asyncio.to_thread(store.load_sandbox, sb.id)
                assert current is not None
                if current.desired_state != target or (current.error_permanent and current.state != target):
                    # The table decides on the state the user sees; an already-wished request is a no-op,
                    # unless the last attempt gave up (e.g. a corrupt snapshot): asking again retries.
                    transition(current.state, event)
                    services.forget(sb.id)
                    current = await asyncio.to_thread(store.set_desired, sb.id, target, current.generation)
                if wait:
                    return 200, sandbox_view(await _wait_settled(services, sb.id))
                services.reconciler.poke()
                return 202, sandbox_view(current)

            return await _idempotent(services, who, idem, f"POST /sandboxes/{sandbox_id}/{action}", work)

        r.add_api_route(
            f"/sandboxes/{{sandbox_id}}/{action}", lifecycle_action, methods=["POST"],
            name=f"{action}_sandbox", response_model=None,
        )  # fmt: skip

    for action, (event, target) in lifecycle_targets.items():
        lifecycle_route(action, event, target)

    return r


async def _take_snapshot(services: Services, sb: SandboxRecord, *, full: bool) -> SnapshotRecord:
    info = await services.nodes.client(_node_id(sb)).create_snapshot(sb.id, full=full)
    snap = await asyncio.to_thread(
        services.store.create_snapshot, sb.id, "full" if full else "disk", node_id=sb.node_id,
        snapshot_id=info.snapshot_id, origin="user", exclusive_bytes=getattr(info, "exclusive_bytes", None),
    )  # fmt: skip
    return await asyncio.to_thread(services.store.mark_snapshot_ready, snap.id, size_bytes=info.image_bytes)


def _node_id(sb: SandboxRecord) -> str:
    if sb.node_id is None:
        raise errors.InvalidState(
            f"sandbox {sb.id} is not on a node (state '{sb.state}')", state=sb.state.value
        )
    return sb.node_id


async def _running(services: Services, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The sandbox, running: a paused one is resumed first (transparently), others are refused by state."""
    cached = services.running.get((who.project_id, sandbox_id))
    if cached is not None and cached[1] > time.monotonic():
        return cached[0]
    sb = await _sandbox(services, who, sandbox_id)
    if sb.state == State.RUNNING and sb.desired_state == State.RUNNING:
        services.running[(who.project_id, sandbox_id)] = (sb, time.monotonic() + RUNNING_CACHE_S)
        return sb
    if sb.state in {State.PAUSED, State.PAUSING, State.RESUMING} or (
        sb.state == State.RUNNING and sb.desired_state == State.PAUSED
    ):
        if sb.desired_state != State.RUNNING:
            await asyncio.to_thread(services.store.set_desired, sb.id, State.RUNNING)
        return await _wait_settled(services, sb.id)
    if sb.state in {State.PENDING, State.CREATING, State.STARTING} and sb.desired_state == State.RUNNING:
        return await _wait_settled(services, sb.id)
    if sb.state in {State.SUSPENDED, State.RESTORING, State.RECOVERING} and not sb.error_permanent:
        # Like a paused sandbox, a suspended one comes back on first use (on any node).
        if sb.desired_state != State.RUNNING:
            await asyncio.to_thread(services.store.set_desired, sb.id, State.RUNNING)
        return await _wait_settled(services, sb.id)
    raise errors.InvalidState(f"sandbox {sandbox_id} is '{sb.state}', not running", state=sb.state.value)


# -- data plane relay ----------------------------------------------------------------------------------------
# The gateway forwards only the operations below, each to the node route of the same shape: the node URL is
# built by NodeClient.proxy_stream from the authorized record's id and fixed words or validated ids (one
# quoted segment each), the query from typed parameters, the body from a validated model or, for uploads
# and stdin, the raw bytes; of the client's headers only Content-Type goes on. Nothing of the client's path
# text reaches the node, so no encoding (dot segments, %2f, backslashes, overlong UTF-8, NUL) can name
# another route or sandbox there. ADR 0020.
FilePath = Annotated[str, Query(min_length=1, max_length=4096)]
NonNegative = Annotated[int, Query(ge=0)]
FileMode = Annotated[int | None, Query(ge=0, le=0o7777)]
RELAYED_HEADERS = ("content-type",)


def _json_bytes(body: BaseModel) -> bytes:
    """A validated body as the node receives it: only what the client set (the node fills defaults)."""
    return body.model_dump_json(exclude_unset=True).encode()


def _data_plane_routes(r: APIRouter, services: Services) -> None:
    async def relay(
        request: Request,
        who: Principal,
        sandbox_id: str,
        *segments: str,
        mutating: bool,
        params: dict[str, Any] | None = None,
        body: bytes | None = None,
        stream_body: bool = False,
    ) -> Response:
        who.require("member" if mutating else "read-only")
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        sb = await _running(services, who, sandbox_id)
        now = time.monotonic()
        if now - services.activity.get(sb.id, 0.0) > ACTIVITY_DEBOUNCE_S:
            services.activity[sb.id] = now
            await asyncio.to_thread(services.store.record_activity, sb.id)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_UPLOAD_BYTES:
            raise errors.TooLarge(f"upload of {length} bytes exceeds {MAX_UPLOAD_BYTES}")
        node = services.nodes.client(_node_id(sb))
        headers = {k: v for k, v in request.headers.items() if k.lower() in RELAYED_HEADERS}
        content: bytes | AsyncIterator[bytes] | None = body
        if body is not None:
            headers["content-type"] = "application/json"
        elif stream_body:
            small = length is not None and length.isdigit() and int(length) <= SMALL_BODY_BYTES
            # Small bodies are passed whole: streaming them costs more than they weigh. Uploads stream.
            content = await request.body() if small else _limited(request.stream())
        upstream = await node.proxy_stream(
            request.method, sb.id, *segments, params=params, content=content, headers=headers
        )
        if (upstream.media_type or "").startswith("application/json"):
            # A plain JSON answer (not NDJSON or a file): relay it whole, without chunked framing.
            answer = b"".join([chunk async for chunk in upstream.body()])
            return Response(answer, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(
            upstream.body(),
            status_code=upstream.status_code,
            media_type=upstream.media_type,
            background=None,
        )

    async def _limited(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        total = 0
        async for chunk in chunks:
            total += len(chunk)
            if total > MAX_UPLOAD_BYTES:
                raise errors.TooLarge(f"upload exceeds {MAX_UPLOAD_BYTES} bytes")
            yield chunk

    def process(process_id: str) -> str:
        return parse_process_id(process_id, field="process_id")

    # processes ---------------------------------------------------------------------------------------------
    @r.post("/sandboxes/{sandbox_id}/exec", response_model=None)
    async def exec_(sandbox_id: str, body: rm.ExecRequest, request: Request, who: Auth) -> Response:
        """Run a command; with `stream`, NDJSON events (started, stdout/stderr, exit)."""
        return await relay(request, who, sandbox_id, "exec", mutating=True, body=_json_bytes(body))

    @r.get("/sandboxes/{sandbox_id}/processes", response_model=None)
    async def list_processes(sandbox_id: str, request: Request, who: Auth) -> Response:
        return await relay(request, who, sandbox_id, "processes", mutating=False)

    @r.post("/sandboxes/{sandbox_id}/processes", response_model=None, status_code=201)
    async def start_process(
        sandbox_id: str, body: rm.ProcessStartRequest, request: Request, who: Auth
    ) -> Response:
        return await relay(request, who, sandbox_id, "processes", mutating=True, body=_json_bytes(body))

    @r.get("/sandboxes/{sandbox_id}/processes/{process_id}/output", response_model=None)
    async def process_output(
        sandbox_id: str, process_id: str, request: Request, who: Auth, *, offset: NonNegative = 0,
        follow: bool = True,
    ) -> Response:  # fmt: skip
        """NDJSON: attached {offset, truncated}, stdout/stderr, then exit (end without follow)."""
        return await relay(
            request, who, sandbox_id, "processes", process(process_id), "output", mutating=False,
            params={"offset": offset, "follow": follow},
        )  # fmt: skip

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", response_model=None)
    async def process_stdin(
        sandbox_id: str, process_id: str, request: Request, who: Auth, eof: bool = False
    ) -> Response:
        """The raw body goes to the process's stdin (streamed)."""
        return await relay(
            request, who, sandbox_id, "processes", process(process_id), "stdin", mutating=True,
            params={"eof": eof}, stream_body=True,
        )  # fmt: skip

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/signal", response_model=None)
    async def process_signal(
        sandbox_id: str, process_id: str, body: rm.SignalRequest, request: Request, who: Auth
    ) -> Response:
        return await relay(
            request, who, sandbox_id, "processes", process(process_id), "signal", mutating=True,
            body=_json_bytes(body),
        )  # fmt: skip

    @r.post("/sandboxes/{sandbox_id}/processes/{process_id}/resize", response_model=None)
    async def process_resize(
        sandbox_id: str, process_id: str, body: rm.ResizeRequest, request: Request, who: Auth
    ) -> Response:
        return await relay(
            request, who, sandbox_id, "processes", process(process_id), "resize", mutating=True,
            body=_json_bytes(body),
        )  # fmt: skip

    # files -------------------------------------------------------------------------------------------------
    @r.get("/sandboxes/{sandbox_id}/files", response_model=None)
    async def read_file(
        sandbox_id: str, path: FilePath, request: Request, who: Auth, *, offset: NonNegative = 0,
        length: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:  # fmt: skip
        """The file's bytes (streamed)."""
        params: dict[str, Any] = {"path": path, "offset": offset, "length": length}
        return await relay(request, who, sandbox_id, "files", mutating=False, params=params)

    @r.put("/sandboxes/{sandbox_id}/files", response_model=None)
    async def write_file(
        sandbox_id: str, path: FilePath, request: Request, who: Auth, *, mode: FileMode = None,
        append: bool = False,
    ) -> Response:  # fmt: skip
        """The raw body becomes the file (streamed)."""
        params: dict[str, Any] = {"path": path, "mode": mode, "append": append}
        return await relay(request, who, sandbox_id, "files", mutating=True, params=params, stream_body=True)

    @r.delete("/sandboxes/{sandbox_id}/files", response_model=None)
    async def remove_file(
        sandbox_id: str, path: FilePath, request: Request, who: Auth, recursive: bool = False
    ) -> Response:
        params: dict[str, Any] = {"path": path, "recursive": recursive}
        return await relay(request, who, sandbox_id, "files", mutating=True, params=params)

    @r.get("/sandboxes/{sandbox_id}/files/list", response_model=None)
    async def list_files(sandbox_id: str, path: FilePath, request: Request, who: Auth) -> Response:
        return await relay(request, who, sandbox_id, "files", "list", mutating=False, params={"path": path})

    @r.get("/sandboxes/{sandbox_id}/files/stat", response_model=None)
    async def stat_file(sandbox_id: str, path: FilePath, request: Request, who: Auth) -> Response:
        return await relay(request, who, sandbox_id, "files", "stat", mutating=False, params={"path": path})

    @r.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=None)
    async def make_dir(sandbox_id: str, body: rm.MkdirRequest, request: Request, who: Auth) -> Response:
        return await relay(request, who, sandbox_id, "files", "mkdir", mutating=True, body=_json_bytes(body))

    @r.post("/sandboxes/{sandbox_id}/files/rename", response_model=None)
    async def rename_file(sandbox_id: str, body: rm.RenameRequest, request: Request, who: Auth) -> Response:
        return await relay(request, who, sandbox_id, "files", "rename", mutating=True, body=_json_bytes(body))

    @r.get("/sandboxes/{sandbox_id}/files/watch", response_model=None)
    async def watch_files(
        sandbox_id: str, path: FilePath, request: Request, who: Auth, recursive: bool = False
    ) -> Response:
        """NDJSON: {"type": "watching"} once in place, then {"type": "changes", "changes": [...]}."""
        params: dict[str, Any] = {"path": path, "recursive": recursive}
        return await relay(request, who, sandbox_id, "files", "watch", mutating=False, params=params)

    @r.websocket("/sandboxes/{sandbox_id}/pty")
    async def pty(websocket: WebSocket, sandbox_id: str) -> None:
        await _relay_pty(websocket, services, sandbox_id)


class PtyParameters(_Body):
    rows: int = Field(default=24, ge=1, le=1000)
    cols: int = Field(default=80, ge=1, le=1000)
    cmd: str = Field(default="/bin/bash", min_length=1, max_length=4096)


def _pty_parameters(query: Any) -> PtyParameters:
    """The PTY's query (rows, cols, cmd), typed: anything else, or a repeated one, is invalid."""
    names = list(query.keys())
    if len(names) != len(set(names)):
        raise errors.InvalidArgument("a PTY query parameter is repeated", field="query")
    try:
        return PtyParameters.model_validate(dict(query))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise errors.InvalidArgument(f"invalid PTY parameters: {problems}", field="query") from exc


async def _relay_pty(websocket: WebSocket, services: Services, sandbox_id: str) -> None:
    """PTY over WebSocket: authenticate like any request, then pump frames both ways to the node."""
    from websockets.exceptions import ConnectionClosed

    auth = websocket.headers.get("authorization")
    try:
        who = await authenticate(services, auth, websocket.headers.get("x-space-project"))
        who.require("member")
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        terminal = _pty_parameters(websocket.query_params)
        sb = await _running(services, who, sandbox_id)
    except errors.SpaceError as exc:
        # Refused before the handshake completes: the client sees the real status and error body.
        await websocket.send_denial_response(rest_errors.error_response(exc))
        return
    await websocket.accept()
    node = services.nodes.client(_node_id(sb))
    async with node.pty(sb.id, rows=terminal.rows, cols=terminal.cols, cmd=terminal.cmd) as upstream:

        async def client_to_node() -> None:
            while True:
                message = await websocket.receive()
                if message.get("type") == "websocket.disconnect":
                    await upstream.close()
                    return
                if message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
                elif message.get("text") is not None:
                    await upstream.send(message["text"])

        async def node_to_client() -> None:
            try:
                async for data in upstream:
                    if isinstance(data, bytes):
                        await websocket.send_bytes(data)
                    else:
                        await websocket.send_text(data)
            except ConnectionClosed:
                pass
            await websocket.close()

        tasks = [asyncio.create_task(client_to_node()), asyncio.create_task(node_to_client())]
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
