"""Node-level routes: what the node is and what it runs (no sandbox capability needed).

Invariants:
- These are the only routes without a sandbox scope (space.node.agent.rpc_auth._NODE_LEVEL_ROUTES).
"""

from __future__ import annotations

from space.node.agent import rpc_models as rm
from space.node.agent.routes.deps import Service
from space.node.agent.rpc_auth import resource_router

router = resource_router()


@router.get("/info", response_model=rm.NodeInfo)
async def node_info(
    svc: Service,
) -> rm.NodeInfo:
    return svc.info()


@router.get("/sandboxes", response_model=rm.SandboxList)
async def list_sandboxes(svc: Service, guest: bool = True) -> rm.SandboxList:
    return await svc.observe_all(guest=guest)
