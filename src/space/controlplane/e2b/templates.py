"""E2B's template lookup (`GET /templates/aliases/{alias}`: `Template.exists`, `Template.alias_exists`).

Invariants:
- An alias is what SPACE's own create takes (space.controlplane.template_catalog, ADR 0055): a built-in
  (`python`, `base`, ...: answered public), or one of the caller's project's templates by name or id
  (answered not public); anything else, another project's template included, is a 404 (E2B's SDK: "does
  not exist"). E2B's `base` is SPACE's `base` (views.space_template).
- A snapshot of the caller's project that a create's `templateID` would start from (its id, or a name the
  project gave a ready full snapshot: snapshots.snapshot_source, which a create asks first too) exists as
  a template (not public); another project's snapshot is a 404 like any unknown name.
- Template building and deletion of templates are not served here (docs/e2b.md: SPACE's `/v1/templates` and
  `space template` build them); deleting a snapshot goes through `DELETE /templates/{id}` (snapshots.py).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path

from space.controlplane import template_catalog
from space.controlplane.api.deps import Principal, Services, Svc
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.snapshots import snapshot_source
from space.controlplane.e2b.views import space_template
from space.controlplane.store.records import SnapshotRecord
from space.core import errors

router = APIRouter()


@router.get("/templates/aliases/{alias}")
async def template_alias(
    alias: Annotated[str, Path(max_length=256)], who: E2bAuth, services: Svc
) -> dict[str, Any]:
    if (snap := await _snapshot(services, who, alias)) is not None:
        return {"templateID": snap.id, "public": False}
    try:
        found = await asyncio.to_thread(
            template_catalog.find, services.store, who.project_id, space_template(alias)
        )
    except errors.InvalidArgument as exc:  # no template can have such a name
        raise errors.NotFound(f"template {alias[:80]!r} not found") from exc
    return {"templateID": found.id, "public": found.builtin}


async def _snapshot(services: Services, who: Principal, alias: str) -> SnapshotRecord | None:
    try:
        return await snapshot_source(services, who, alias)
    except errors.NotFound:  # an id of no snapshot of the caller's: no template either
        return None
