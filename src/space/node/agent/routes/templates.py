"""Node-level template routes (docs/adr/0054-template-build.md): `POST /node/v1/templates/{name}/build`
(body: a TemplateBuildSpec; answer: an NDJSON stream), `DELETE /node/v1/templates/{name}`,
`GET /node/v1/templates`. The work is space.node.agent.template_build's.

Invariants:
- Node-level: the node token suffices (space.node.agent.rpc_auth._NODE_LEVEL_ROUTES), as for the other
  routes that act on the node as a whole; the control plane alone holds that token.
- The build body is read with a bound (MAX_BODY_BYTES: TooLarge past it, before it is parsed), then parsed
  by space.core.template_spec; every refusal of the request (name, spec, base, 409s) is a plain HTTP error
  because the stream's first item is awaited before the headers go out.
- Every NDJSON line of the stream is bounded (log lines are cut by the build's LogSink; the last item is
  `{"done": ...}` or `{"error": ...}`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from space.core import errors
from space.core.template_spec import MAX_SPEC_BYTES
from space.node.agent.rpc_auth import resource_router
from space.node.agent.template_build import TemplateBuilds

router = resource_router()

NDJSON = "application/x-ndjson"
#: A spec's bound plus room for JSON whitespace.
MAX_BODY_BYTES = MAX_SPEC_BYTES + (64 << 10)


class TemplateHeld(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    builtin: bool
    metadata: dict[str, Any]


class TemplateList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    templates: list[TemplateHeld]


class TemplateDeleted(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    deleted: bool


def builds_of(request: Request) -> TemplateBuilds:
    return cast(TemplateBuilds, request.app.state.template_builds)


async def _bounded_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise errors.TooLarge(f"a build spec is at most {MAX_BODY_BYTES} bytes", limit=MAX_BODY_BYTES)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise errors.TooLarge(f"a build spec is at most {MAX_BODY_BYTES} bytes", limit=MAX_BODY_BYTES)
    try:
        return json.loads(body)
    except ValueError as exc:
        raise errors.InvalidArgument("the body is not JSON", field="spec") from exc


def _line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, separators=(",", ":")).encode() + b"\n"


@router.post("/templates/{name}/build")
async def build_template(request: Request, name: str) -> Response:
    """Build user template `name` from the spec in the body; streams `{"log"}` items, then `{"done"}` or
    `{"error"}`."""
    builds = builds_of(request)
    data = await _bounded_json(request)
    run = await builds.begin(name, data)
    items = builds.stream(run)
    first = await anext(items)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _line(first)
            async for item in items:
                yield _line(item)
        finally:
            await _close(items)

    return StreamingResponse(body(), media_type=NDJSON, headers={"Cache-Control": "no-store"})


async def _close(items: AsyncGenerator[dict[str, Any], None]) -> None:
    await items.aclose()


@router.delete("/templates/{name}", response_model=TemplateDeleted)
async def delete_template(request: Request, name: str) -> TemplateDeleted:
    """Delete user template `name` (built-ins are refused; sandboxes made from it keep working)."""
    return TemplateDeleted.model_validate(await builds_of(request).delete(name))


@router.get("/templates", response_model=TemplateList)
async def list_templates(request: Request) -> TemplateList:
    """Every complete template this node holds, built-in and user, with its metadata."""
    return TemplateList(templates=[TemplateHeld.model_validate(t) for t in await builds_of(request).held()])
