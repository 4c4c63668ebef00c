"""What a caller sees at a glance (the web console's reads, docs/adr/0061-web-console.md): who its key is,
its project's sandboxes as they change (a Server-Sent Events stream), and the cluster's nodes.

Invariants:
- The update stream shows exactly what `GET /v1/sandboxes` would (the key's project, every state but
  deleted, the newest MAX_PAGE), as Sandbox views: it reads the database (the truth for every replica)
  every POLL_S, sooner when this process's reconciler moved a sandbox (never within MIN_GAP_S of the
  last read), and sends only what
  changed. It holds one of the key's streams, ends when the key is revoked (checked every AUTH_RECHECK_S),
  and says something at least every KEEPALIVE_S so that a dead client is noticed.
- The nodes list is for organisation admin keys only (nodes are the operator's machines, shared by every
  project), and never carries a node's address or token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from space.controlplane.api.deps import Auth, Principal, Services, Svc, authenticate, require_org_admin
from space.controlplane.api.node_admin import Nodes, list_views
from space.controlplane.api.views import _View, sandbox_view
from space.controlplane.store.sandbox_listing import MAX_PAGE, SandboxQuery
from space.core import errors

router = APIRouter()

POLL_S = 1.0
#: The least time between two reads of one stream (a busy reconciler wakes it often).
MIN_GAP_S = 0.2
KEEPALIVE_S = 15.0
AUTH_RECHECK_S = 30.0
SSE_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-Sent Events: `snapshot` {sandboxes}, then `sandbox` (a Sandbox that changed "
        "or appeared) and `removed` {id}",
        "content": {"text/event-stream": {}},
    }
}


class WhoAmI(_View):
    key_id: str
    key_prefix: str
    role: Literal["read-only", "member", "admin"]
    org_id: str
    project_id: str = Field(description="The project the key acts in (an org key: X-Space-Project's).")
    org_key: bool = Field(description="An organisation-wide key (not bound to one project).")


@router.get("/whoami", response_model=WhoAmI)
async def whoami(who: Auth) -> dict[str, Any]:
    key = who.key
    return {
        "key_id": key.id,
        "key_prefix": key.prefix,
        "role": key.role,
        "org_id": key.org_id,
        "project_id": who.project_id,
        "org_key": key.project_id is None,
    }


@router.get("/cluster/nodes", response_model=Nodes)
async def list_nodes(who: Auth, services: Svc) -> dict[str, Any]:
    require_org_admin(who, "list the cluster's nodes")
    return {"nodes": await list_views(services)}  # one view for the console and `space node list`


@router.get("/sandbox-updates", response_model=None, responses=SSE_ANSWER)
async def sandbox_updates(request: Request, who: Auth, services: Svc) -> StreamingResponse:
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        _updates(services, who, request), media_type="text/event-stream", headers=headers
    )


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _current(services: Services, who: Principal) -> dict[str, dict[str, Any]]:
    query = SandboxQuery(limit=MAX_PAGE)
    page = await asyncio.to_thread(services.store.page_sandboxes, who.project_id, query)
    return {sb.id: sandbox_view(sb) for sb in page.sandboxes}


async def _still_valid(services: Services, request: Request) -> bool:
    try:
        await authenticate(
            services, request.headers.get("authorization"), request.headers.get("x-space-project")
        )
    except errors.SpaceError:
        return False
    return True


async def _updates(services: Services, who: Principal, request: Request) -> AsyncIterator[bytes]:
    seen = await _current(services, who)
    yield _event("snapshot", {"sandboxes": list(seen.values())})
    said = checked = time.monotonic()
    while True:
        with contextlib.suppress(TimeoutError):
            # A fresh Event each time: the reconciler replaces it after setting it.
            await asyncio.wait_for(services.reconciler.changed.wait(), POLL_S)
        await asyncio.sleep(MIN_GAP_S)
        now = time.monotonic()
        if now - checked > AUTH_RECHECK_S:
            checked = now
            if not await _still_valid(services, request):
                yield _event("ended", {"reason": "the API key is no longer valid"})
                return
        current = await _current(services, who)
        for sandbox_id, view in current.items():
            if seen.get(sandbox_id) != view:
                yield _event("sandbox", view)
                said = now
        for sandbox_id in seen.keys() - current.keys():
            yield _event("removed", {"id": sandbox_id})
            said = now
        seen = current
        if now - said > KEEPALIVE_S:
            yield b": keep-alive\n\n"
            said = now
