"""E2B's template lookup (`GET /templates/aliases/{alias}`: `Template.exists`, `Template.alias_exists`).

Invariants:
- A built-in template (`python`, `base`: every node builds them from its base) always exists; another
  exists when a ready node holds it (what the nodes report in their heartbeats). E2B's `base` is SPACE's
  `base` (views.space_template). SPACE's templates are shared by every project, so an existing one is
  answered as public; anything else is a 404 (E2B's SDK: "does not exist").
- Template building and deletion of templates are not served here (docs/e2b.md); deleting a snapshot goes
  through `DELETE /templates/{id}` (snapshots.py).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path

from space.controlplane.api.deps import Svc
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.views import space_template
from space.core import errors
from space.node.volumes.templates import BUILTIN_TEMPLATES

router = APIRouter()


@router.get("/templates/aliases/{alias}")
async def template_alias(
    alias: Annotated[str, Path(max_length=256)], who: E2bAuth, services: Svc
) -> dict[str, Any]:
    name = space_template(alias)
    nodes = await asyncio.to_thread(services.store.list_nodes, "ready")
    if name not in BUILTIN_TEMPLATES and not any(name in node.templates for node in nodes):
        raise errors.NotFound(f"template {alias[:80]!r} not found")
    return {"templateID": name, "public": True}
