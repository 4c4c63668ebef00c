"""The node agent's RPC app: the routers of space.node.agent.routes over one NodeService, behind the node
token, with the one error model of every HTTP surface.

Invariants:
- Every request (HTTP and WebSocket, known route or not) passes BearerAuth before any route runs, and
  every route its capability check (space.node.agent.rpc_auth).
- Errors have one shape, `{"error": {"code", "message", "details"}}`, and one status map (space.rest.errors,
  shared with the control plane's API); an error after a stream's headers went out is its last NDJSON
  line, `{"type": "error", "error": {...}}` (space.node.agent.streams).
- Kill points (crash injection) around every route exist only in a process armed by SPACE_FAILPOINTS
  (space.node.agent.killpoints, inside BearerAuth); production apps have no such middleware.
- The app's state holds the service (`app.state.service`, which the routes use), the node token
  (`app.state.rpc_token`, the key of the sandbox capabilities) and the metrics history (`app.state.metrics`,
  space.node.agent.metrics: its owner starts and closes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from space.core import tracing
from space.faults import failpoints
from space.node.agent.agent import NodeAgent
from space.node.agent.killpoints import KillPointMiddleware
from space.node.agent.metrics import MetricsSampler
from space.node.agent.routes import cdp, files, metrics, node, processes, pty, sandboxes, snapshots, templates
from space.node.agent.routes import traces as trace_routes
from space.node.agent.rpc_auth import BearerAuth
from space.node.agent.rpc_models import API_PREFIX
from space.node.agent.service import NodeService
from space.node.agent.settings import NodeAgentSettings
from space.node.agent.template_build import TemplateBuilds
from space.rest import errors as rest_errors
from space.rest.request_id import RequestIdMiddleware
from space.rest.tracing import TraceRequests

#: The routers in the order their routes are matched and listed.
ROUTERS = (
    node.router, sandboxes.router, metrics.router, snapshots.router, processes.router, files.router,
    pty.router, cdp.router, templates.router, trace_routes.router,
)  # fmt: skip


#: Requests without an access line: the control plane's periodic reads (node info, the sandbox list).
QUIET_PATHS = r"^/node/v1/(info|sandboxes)$"


def create_app(
    agent: NodeAgent,
    token: str,
    *,
    templates: Sequence[str] = ("python",),
    settings: NodeAgentSettings | None = None,
) -> FastAPI:
    """The node RPC app over `agent`; every route requires `Authorization: Bearer <token>`."""
    svc = NodeService(agent, templates, settings)
    app = FastAPI(
        title="SPACE node agent RPC",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=f"{API_PREFIX}/openapi.json",
    )
    app.state.service = svc
    app.state.rpc_token = token  # the key of the sandbox capabilities (require_capability)
    # The metrics history (ADR 0053): answered from here; sampling starts with `app.state.metrics.start()`
    # (space.node.agent.launch, once the agent has adopted its sandboxes).
    app.state.metrics = MetricsSampler(
        agent, interval_s=svc.settings.metrics_interval_s, keep_s=svc.settings.metrics_keep_s
    )
    # User templates built on this node (ADR 0054): the build sources are read at the first build.
    app.state.template_builds = TemplateBuilds(svc)
    for router in ROUTERS:
        app.include_router(router)

    rest_errors.install(app, surface="node agent")
    if failpoints.armed():  # tests only; added first, so it runs inside BearerAuth
        app.add_middleware(KillPointMiddleware, routes=[r for router in ROUTERS for r in router.routes])
    # A span per call, in the control plane's trace (ADR 0072); inside BearerAuth: only authenticated
    # calls make spans.
    tracing.configure("space-node-agent")
    app.add_middleware(TraceRequests, layer="space.node", roots=False)
    app.add_middleware(BearerAuth, token=token)
    # The control plane's request id (never one made here) names this node's log lines (ADR 0071).
    app.add_middleware(RequestIdMiddleware, issue=False, quiet=QUIET_PATHS)
    return app
