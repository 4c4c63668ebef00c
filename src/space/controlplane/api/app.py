"""The public API gateway (FastAPI): `create_app` wires the services, the routers, the limits and the jobs.

The routers, one per resource: sandboxes.py, snapshots.py, data_plane.py (exec, processes, files, PTY),
projects.py (projects and keys), credentials.py, egress.py, byok.py (tenant keys), node_routes.py (the
node-facing routes). What they share (principal, store access, idempotency, the relay) is deps.py; the
bodies are bodies.py and views.py; the periodic jobs are jobs.py. docs/adr/0030-api-routers-and-settings.md.

Invariants:
- Request limits (api/limits.py) are the outermost layer: a public request is authenticated and its body
  bounded before any route reads it.
- `/healthz` needs nothing and answers the replica's SPACE version (ADR 0079); `/metrics` (route names,
  statuses and rates of every tenant) needs an org admin key; every other public route is under /v1 and
  in the OpenAPI document, the node-facing ones are not.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.controlplane import console
from space.controlplane.api import (
    byok,
    cdp,
    code,
    credentials,
    data_plane,
    egress,
    events,
    jobs,
    limits,
    node_admin,
    node_routes,
    overview,
    projects,
    sandbox_metrics,
    sandboxes,
    snapshots,
    templates,
    traces,
)
from space.controlplane.api.deps import Services, authenticate_key
from space.controlplane.api.mcp_endpoint import McpEndpoint
from space.controlplane.credentials.service import CredentialService
from space.controlplane.keys import DataKeys, OrgDataKeys
from space.controlplane.node_pools import PoolSettings
from space.controlplane.nodes import NodePool
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.scheduler import freshness_bound
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.snapshots import SnapshotKeeper
from space.controlplane.store.store import Store
from space.controlplane.template_builds import TemplateBuilds
from space.core import errors, tracing, versions
from space.rest import errors as rest_errors
from space.rest.request_id import RequestIdMiddleware
from space.rest.tracing import TraceRequests

#: Requests without an access line: health checks, scrapes and the nodes' heartbeats (every 2 s per node).
QUIET_PATHS = r"^/(healthz|metrics)$|^/v1/nodes/[^/]+/heartbeat$"


def create_app(
    store: Store,
    *,
    node_token: str,
    run_reconciler: bool = True,
    data_dir: pathlib.Path | None = None,
    store_url: str | None = None,
    data_keys: DataKeys | None = None,
    settings: ControlPlaneSettings | None = None,
) -> FastAPI:
    """`store_url`: the object store shared with the nodes (suspend/restore and uploads; None: suspend is
    refused). `data_keys`: wraps per-artifact keys (None: the default, one local key per org under
    `data_dir`/keys; without data_dir, artifacts are not encrypted). `settings`: default, the
    environment's."""
    services = _services(
        store, node_token, data_dir=data_dir, store_url=store_url, data_keys=data_keys, settings=settings
    )

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background: list[asyncio.Task[None]] = []
        if run_reconciler:
            services.reconciler.start()
            background.append(asyncio.create_task(jobs.housekeeping(services), name="housekeeping"))
            # Settles template builds a dead control plane left, finishes deletions (ADR 0055).
            background.append(asyncio.create_task(builds.run_forever(), name="template sweep"))
        async with mcp.running():  # the MCP SDK's session manager (ADR 0049)
            yield
        for task in background:
            task.cancel()
        await builds.aclose()
        await services.reconciler.stop()
        await services.nodes.aclose()

    mcp = McpEndpoint(services)
    app = FastAPI(title="SPACE", version="1", lifespan=lifespan)  # type: ignore[arg-type]
    mcp.mount(app)  # /mcp: SPACE's tools over streamable HTTP, acting with the caller's key (ADR 0049)
    app.state.services = services
    app.state.space_version = versions.space_version()  # what /healthz reports (ADR 0079)
    builds = TemplateBuilds(
        store,
        services.nodes.client,
        owner=services.reconciler.owner,
        fresh_s=freshness_bound(services.settings.node_lost_after_s),
        objects=services.reconciler.objects,
    )
    app.state.templates = builds  # template builds driven by this process (ADR 0055)
    rest_errors.install(app, surface="control plane API")
    app.add_middleware(_Metrics, services=services)
    # A span per request, in the caller's trace (ADR 0072); inside the limits: refused floods make none.
    # Health, metrics, node heartbeats and the console's files are no operations: they never fill the ring.
    tracing.configure("space-controlplane")
    untraced = ("/healthz", "/metrics", "/v1/nodes", "/console", "/openapi.json", "/docs", "/redoc")
    app.add_middleware(TraceRequests, layer="space.controlplane", skip=untraced)
    app.add_api_route("/healthz", _health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", _metrics_route, methods=["GET"], include_in_schema=False)
    for public in (sandboxes.router, snapshots.router, events.router, projects.router, data_plane.router):
        app.include_router(public, prefix="/v1")
    app.include_router(sandbox_metrics.router, prefix="/v1")  # ADR 0053
    app.include_router(templates.router, prefix="/v1")  # ADR 0055
    app.include_router(code.router, prefix="/v1")  # run_code in the sandbox's kernel (ADR 0058)
    app.include_router(cdp.router, prefix="/v1")  # Chromium's DevTools in a browser sandbox (ADR 0064)
    app.include_router(overview.router, prefix="/v1")  # whoami, sandbox updates, nodes (ADR 0061)
    app.include_router(node_admin.router, prefix="/v1")  # cordon, drain, remove nodes (ADR 0065)
    app.include_router(traces.router, prefix="/v1")  # a sandbox's recent operations, traced (ADR 0072)
    console.mount(app)  # the web console's static files at /console/ (ADR 0061)
    app.include_router(node_routes.router, prefix="/v1/nodes")
    for router in (credentials.router, egress.router, byok.router):
        app.include_router(router)
    # Outermost: before any body is read.
    app.add_middleware(limits.RequestLimits, services=services)
    # Around even that: a refused request's answer and log lines name its request id too (ADR 0071).
    app.add_middleware(RequestIdMiddleware, issue=True, quiet=QUIET_PATHS)
    return app


def _services(
    store: Store,
    node_token: str,
    *,
    data_dir: pathlib.Path | None,
    store_url: str | None,
    data_keys: DataKeys | None,
    settings: ControlPlaneSettings | None,
) -> Services:
    settings = settings or ControlPlaneSettings.from_env()
    nodes = NodePool(store, node_token, pools=PoolSettings.of(settings))  # control and data pools (ADR 0025)
    objects = None
    if store_url is not None:
        from space.objectstore.backends import open_store

        objects = open_store(store_url)
    if data_keys is None and data_dir is not None:
        data_keys = OrgDataKeys.local(store, data_dir / "keys")
    reconciler = Reconciler(
        store, nodes, objects=objects, store_url=store_url, data_keys=data_keys,
        node_fresh_s=freshness_bound(settings.node_lost_after_s),
    )  # fmt: skip
    registry = CollectorRegistry()
    services = Services(
        store=store, nodes=nodes, reconciler=reconciler, snapshots=SnapshotKeeper(reconciler),
        node_token=node_token, registry=registry,
        requests=Counter("space_api_requests", "API requests", ["route", "status"], registry=registry),
        latency=Histogram("space_api_latency_seconds", "API latency", ["route"], registry=registry),
        settings=settings, credential_service=_credential_service(store, data_dir),
    )  # fmt: skip
    byok.add_kms(services, settings.kms_url)
    return services


def _credential_service(store: Store, data_dir: pathlib.Path | None) -> CredentialService | None:
    """The credential service, its vault master key in `data_dir` (default: next to a SQLite database);
    None without either (credential routes then answer 503)."""
    if data_dir is None:
        database = store.engine.url.database
        if store.dialect == "sqlite" and database and database != ":memory:":
            data_dir = pathlib.Path(database).resolve().parent
    return CredentialService.open(store, data_dir) if data_dir is not None else None


class _Metrics:
    """Counts every request and times it to its response's start, by route. A pure ASGI middleware:
    Starlette's BaseHTTPMiddleware runs each request in a task group behind memory streams, which costs
    every request, and more so every streamed chunk (ADR 0044)."""

    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The router put the matched route into this very scope.
                name = getattr(scope.get("route"), "path", "unmatched")
                self.services.requests.labels(name, str(message["status"])).inc()
                self.services.latency.labels(name).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, counted)


async def _health(request: Request) -> dict[str, Any]:
    services: Services = request.app.state.services
    await asyncio.to_thread(services.store.ping)
    return {"status": "ok", "version": request.app.state.space_version}


async def _metrics_route(request: Request, authorization: Annotated[str | None, Header()] = None) -> Response:
    # Route names, statuses and rates of every tenant: for the operator (an org admin key), no one else.
    services: Services = request.app.state.services
    key = await authenticate_key(services, authorization)
    if key.project_id is not None or key.role != "admin":
        raise errors.PermissionDenied("only an organization admin key may read /metrics")
    return Response(generate_latest(services.registry), media_type=CONTENT_TYPE_LATEST)
