"""Project and API key routes.

Invariants:
- Only an organization admin key (no project) creates projects; a project key lists only its own project.
- An admin key makes keys for its own project (an org admin key: for any project of its org); another
  org's project, or another project for a project key, answers like a missing one (404).
- A key's secret is in the answer that creates it and nowhere else (the store keeps a hash).
- A revoked key stops working at once on this replica and within `auth_cache_s` on the others.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Response

from space.controlplane.api.bodies import KeyBody, ProjectBody
from space.controlplane.api.deps import Auth, Svc
from space.controlplane.api.views import CreatedKey, Project, Projects, project_view
from space.core import errors
from space.core.ids import parse_api_key_id

router = APIRouter()


@router.post("/projects", status_code=201, response_model=Project)
async def create_project(body: ProjectBody, who: Auth, services: Svc) -> dict[str, Any]:
    if who.key.project_id is not None or who.role != "admin":
        raise errors.PermissionDenied("only an organization admin key may create projects")
    project = await asyncio.to_thread(services.store.create_project, who.key.org_id, body.name)
    return project_view(project)


@router.get("/projects", response_model=Projects)
async def list_projects(who: Auth, services: Svc) -> dict[str, Any]:
    projects = await asyncio.to_thread(services.store.list_projects, who.key.org_id)
    if who.key.project_id is not None:
        projects = [p for p in projects if p.id == who.key.project_id]
    return {"projects": [project_view(p) for p in projects]}


@router.post("/keys", status_code=201, response_model=CreatedKey)
async def create_key(body: KeyBody, who: Auth, services: Svc) -> dict[str, Any]:
    who.require("admin")
    store = services.store
    project = await asyncio.to_thread(store.get_project_by_name, who.key.org_id, body.project)
    if project is None and body.project.startswith("prj-"):
        project = await asyncio.to_thread(store.get_project, body.project)
    if project is None or project.org_id != who.key.org_id or who.key.project_id not in (None, project.id):
        raise errors.NotFound(f"project {body.project!r} not found")
    record, secret = await asyncio.to_thread(
        store.create_api_key, project.id, who.key.org_id, body.role, shape=body.shape
    )
    return {"id": record.id, "key": secret, "project_id": project.id, "role": record.role}


@router.delete("/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, who: Auth, services: Svc) -> Response:
    who.require("admin")
    parse_api_key_id(key_id, field="key_id")
    await asyncio.to_thread(
        services.store.revoke_key, key_id, org_id=who.key.org_id, project_id=who.key.project_id
    )
    for digest, (cached, _until) in list(services.keys.items()):
        if cached.id == key_id:
            services.keys.pop(digest, None)  # at once here; other replicas within auth_cache_s
    return Response(status_code=204)
