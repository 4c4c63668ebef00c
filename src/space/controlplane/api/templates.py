"""Template routes: build, list, read, follow the build log, upload an OCI archive, delete (ADR 0055).

Invariants:
- A project sees its own templates and the built-ins; another project's template, by id, name or
  node-level name, is a 404 exactly like one that does not exist, in every route (template_catalog).
- A build is recorded (`building`) and answered 202 at once; it is driven in the background by the
  TemplateBuilds of this app (`app.state.templates`), which settles the row when the node's stream ends.
- The log route is NDJSON: `{"log", "seq", "at"}` items, oldest first, after `after`, then ONE final
  `{"template": ...}` item with the template as it is then. With `follow`, it waits for new lines until
  the build is settled; it ends when the client goes away (the response is cancelled with it) and holds
  one of the key's stream slots while it lasts (api/limits.py).
- Built-ins are read-only: deleting one, or uploading to one, is PermissionDenied.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Final

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from space.controlplane import template_catalog
from space.controlplane.api.deps import Auth, Principal, Services, Svc
from space.controlplane.store.records import TemplateRecord
from space.controlplane.template_builds import OCI_UPLOAD, TemplateBuilds
from space.controlplane.template_sources import receive_source
from space.core import errors
from space.core.ids import TEMPLATE_NAME_MAX_LENGTH
from space.core.template_states import TemplateStatus

router = APIRouter()

LOG_POLL_S: Final = 0.25
LOG_PAGE: Final = 500
Ref = Annotated[str, Path(max_length=template_catalog.MAX_REF_LENGTH, description="A template's id or name.")]


class BuildTemplate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=TEMPLATE_NAME_MAX_LENGTH)
    spec: dict[str, Any] = Field(
        description="A build spec (docs/api.md#templates): from, steps, user, start_cmd. `from` names a "
        f"built-in, one of the project's ready templates, or {OCI_UPLOAD!r} (then PUT the archive to "
        "/v1/templates/{id}/source)."
    )


class Template(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    node_name: str
    builtin: bool
    status: str
    source: str | None
    spec: dict[str, Any] | None
    size_bytes: int | None
    default_user: str | None
    workdir: str | None
    error: str | None
    log_truncated: bool
    source_upload: str | None = Field(
        description="Where to PUT the OCI archive while the build waits for it."
    )
    created_at: str | None
    updated_at: str | None


class Templates(BaseModel):
    model_config = ConfigDict(extra="forbid")

    templates: list[Template]


class DeletedTemplate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    deleted: bool = Field(
        description="False: it is `deleting`; a node still holds a copy, removed when it answers."
    )


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def template_view(record: TemplateRecord) -> dict[str, Any]:
    awaiting = record.status == TemplateStatus.BUILDING.value and record.source == OCI_UPLOAD
    return {
        "id": record.id,
        "name": record.name,
        "node_name": record.node_name,
        "builtin": record.builtin,
        "status": record.status,
        "source": None if record.builtin else record.source,
        "spec": None if record.builtin else record.spec,
        "size_bytes": record.size_bytes,
        "default_user": record.default_user,
        "workdir": record.workdir,
        "error": record.error,
        "log_truncated": record.log_truncated,
        "source_upload": f"/v1/templates/{record.id}/source" if awaiting else None,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
    }


def builds_of(request: Request) -> TemplateBuilds:
    builds: TemplateBuilds = request.app.state.templates
    return builds


async def find_template(services: Services, who: Principal, ref: str) -> TemplateRecord:
    return await asyncio.to_thread(template_catalog.find, services.store, who.project_id, ref)


async def _own(services: Services, who: Principal, ref: str, to: str) -> TemplateRecord:
    record = await find_template(services, who, ref)
    if record.builtin:
        raise errors.PermissionDenied(f"built-in template {record.name!r} is read-only: it cannot {to}")
    return record


@router.post("/templates", status_code=202, response_model=Template)
async def build_template(body: BuildTemplate, who: Auth, request: Request) -> JSONResponse:
    who.require("member")
    record = await builds_of(request).start(who.project_id, body.name, body.spec)
    return JSONResponse(template_view(record), status_code=202)


@router.get("/templates", response_model=Templates)
async def list_templates(who: Auth, services: Svc) -> dict[str, Any]:
    own = await asyncio.to_thread(services.store.list_templates, who.project_id)
    builtins = [template_catalog.builtin_record(name) for name in template_catalog.builtin_names()]
    return {"templates": [template_view(record) for record in [*builtins, *own]]}


@router.get("/templates/{template}", response_model=Template)
async def get_template(template: Ref, who: Auth, services: Svc) -> dict[str, Any]:
    return template_view(await find_template(services, who, template))


@router.get(
    "/templates/{template}/logs",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-ndjson": {}}, "description": "NDJSON log lines, then the template."}
    },
)
async def template_logs(
    template: Ref,
    who: Auth,
    services: Svc,
    follow: bool = False,
    after: Annotated[int, Query(ge=0, le=2**62)] = 0,
) -> StreamingResponse:
    record = await find_template(services, who, template)
    return StreamingResponse(
        _log_items(services, who.project_id, record, follow, after), media_type="application/x-ndjson"
    )


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, separators=(",", ":")) + "\n").encode()


async def _log_items(
    services: Services, project_id: str, record: TemplateRecord, follow: bool, after: int
) -> AsyncIterator[bytes]:
    cursor, current = after, record
    while not record.builtin:
        settled = current.status != TemplateStatus.BUILDING.value or not follow
        while True:  # everything written so far (after a settled status: everything there is)
            lines = await asyncio.to_thread(
                services.store.template_log, record.id, after=cursor, limit=LOG_PAGE
            )
            for line in lines:
                cursor = line.id
                yield _line({"log": line.line, "seq": line.id, "at": line.at.isoformat()})
            if len(lines) < LOG_PAGE:
                break
        if settled:
            break
        await asyncio.sleep(LOG_POLL_S)
        found = await asyncio.to_thread(services.store.get_template, project_id, record.id)
        if found is None:  # deleted meanwhile
            yield _line({"template": None})
            return
        current = found
    yield _line({"template": template_view(current)})


@router.put("/templates/{template}/source", status_code=202, response_model=Template)
async def upload_source(template: Ref, who: Auth, services: Svc, request: Request) -> JSONResponse:
    who.require("member")
    record = await _own(services, who, template, "take an upload")
    started = await receive_source(builds_of(request), services.reconciler.objects, record, request.stream())
    return JSONResponse(template_view(started), status_code=202)


@router.delete("/templates/{template}", response_model=DeletedTemplate)
async def delete_template(template: Ref, who: Auth, services: Svc, request: Request) -> dict[str, Any]:
    who.require("member")
    record = await _own(services, who, template, "be deleted")
    deleted = await builds_of(request).delete(who.project_id, record)
    return {"id": record.id, "name": record.name, "deleted": deleted}
