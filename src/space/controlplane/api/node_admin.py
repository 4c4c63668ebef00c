"""The operator's node routes (docs/adr/0065-node-operations.md): list, show, cordon, uncordon, drain and
remove the cluster's nodes, under /v1/cluster/nodes.

Invariants:
- Organisation admin keys only (nodes are the operator's machines, shared by every project): any other
  key is a 403, before the node is even looked up. An unknown node is a 404; a request its admin state
  does not allow is a 409 naming that state (space.core.node_states, the one table).
- A view never carries a node's address, token or the drain's bookkeeping (the reserved `space.` labels,
  which name other organisations' sandboxes): it shows the admin state and how many sandboxes the drain
  is still moving instead.
- A drain only records the wish; the drain round (space.controlplane.node_drain, a housekeeping job of
  every replica) and the reconciler move the sandboxes, so the request answers at once and a control
  plane that dies mid-drain leaves nothing half done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from space.controlplane.api.deps import Auth, Services, Svc, require_org_admin
from space.controlplane.api.views import _View
from space.controlplane.store.records import NodeRecord
from space.core import errors, node_states
from space.core.node_states import NodeAdminEvent

# Not in the tenants' OpenAPI document: operator routes on the operator's machines, not a tenant's
# resources (the list, GET /v1/cluster/nodes, is there for the web console). docs/api.md documents them.
router = APIRouter(tags=["nodes"], include_in_schema=False)
_MAX_NODE_ID = 64


class NodeView(_View):
    id: str
    status: str = Field(description="Liveness from heartbeats: ready, lost, offline (or draining, legacy).")
    admin: str = Field(description="The operator's hold: active, cordoned, draining or drained.")
    capacity: dict[str, Any]
    used: dict[str, Any]
    templates: list[str]
    pools: dict[str, int] | None = Field(description="Ready pooled sandboxes per template (null: unknown).")
    labels: dict[str, str]
    version: str | None = Field(description="The node's runtime version, as it reports it (null: unknown).")
    space_version: str | None = Field(description="The SPACE release the node's agent runs (null: unknown).")
    sandboxes: int = Field(description="Sandboxes recorded on the node (any state but deleted).")
    moving: int = Field(description="Sandboxes a drain of this node is still moving.")
    last_heartbeat_at: str
    registered_at: str


class Nodes(_View):
    nodes: list[NodeView]


class Removed(_View):
    id: str
    removed: bool


def node_view(node: NodeRecord, sandboxes: int) -> dict[str, Any]:
    labels = node.labels or {}
    return {
        "id": node.id,
        "status": node.status,
        "admin": node_states.of_labels(labels).value,
        "capacity": node.capacity,
        "used": node.used,
        "templates": node.templates,
        "pools": node.pools,
        "labels": {k: v for k, v in labels.items() if not k.startswith(node_states.RESERVED_PREFIX)},
        "version": (node.runtime or {}).get("runtime_version"),
        "space_version": node.space_version,
        "sandboxes": sandboxes,
        "moving": len(node_states.drain_entries(labels)),
        "last_heartbeat_at": node.last_heartbeat_at.isoformat(),
        "registered_at": node.registered_at.isoformat(),
    }


async def list_views(services: Services) -> list[dict[str, Any]]:
    nodes = await asyncio.to_thread(services.store.list_nodes, None)
    counts = await asyncio.to_thread(services.store.sandboxes_per_node)
    return [node_view(node, counts.get(node.id, 0)) for node in nodes]


async def _view(services: Services, node_id: str) -> dict[str, Any]:
    node = await asyncio.to_thread(services.store.get_node, node_id)
    if node is None:
        raise errors.NotFound(f"node {node_id} not found")
    counts = await asyncio.to_thread(services.store.sandboxes_per_node)
    return node_view(node, counts.get(node.id, 0))


def _known(node_id: str) -> str:
    if not 0 < len(node_id) <= _MAX_NODE_ID:
        raise errors.NotFound("node not found")
    return node_id


async def _apply(who: Any, services: Services, node_id: str, event: NodeAdminEvent) -> dict[str, Any]:
    require_org_admin(who, f"{event.value} a node")
    await asyncio.to_thread(services.store.node_admin_event, _known(node_id), event)
    if event is NodeAdminEvent.DRAIN:
        services.reconciler.poke()
    return await _view(services, node_id)


@router.get("/cluster/nodes/{node_id}", response_model=NodeView)
async def show_node(node_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    require_org_admin(who, "see the cluster's nodes")
    return await _view(services, _known(node_id))


@router.post("/cluster/nodes/{node_id}/cordon", response_model=NodeView)
async def cordon(node_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    """No new sandbox is placed on the node; its sandboxes stay. Kept across its restarts."""
    return await _apply(who, services, node_id, NodeAdminEvent.CORDON)


@router.post("/cluster/nodes/{node_id}/uncordon", response_model=NodeView)
async def uncordon(node_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    """The node takes new sandboxes again (a drain under way ends: what it moved gets its wish back)."""
    return await _apply(who, services, node_id, NodeAdminEvent.UNCORDON)


@router.post("/cluster/nodes/{node_id}/drain", response_model=NodeView)
async def drain(node_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    """Cordon, then move every sandbox off the node (suspended to object storage, restored on another
    node with room, else left suspended until one has room); `admin` becomes `drained` when it is empty."""
    return await _apply(who, services, node_id, NodeAdminEvent.DRAIN)


@router.delete("/cluster/nodes/{node_id}", response_model=Removed)
async def remove(node_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    """Forget a drained (or empty and cordoned, lost or offline) node: its record and identity go, so its
    agent's next call is refused; a node still holding sandboxes is a 409."""
    require_org_admin(who, "remove a node")
    await asyncio.to_thread(services.store.node_admin_event, _known(node_id), NodeAdminEvent.REMOVE)
    return {"id": node_id, "removed": True}
