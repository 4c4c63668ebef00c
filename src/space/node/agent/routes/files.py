"""File routes of the data plane: read, write, list, stat, mkdir, remove, rename, watch.

Invariants:
- Uploads and downloads are streamed (space.node.agent.streams): no file is held whole in the agent. An
  upload whose client goes away is discarded by the daemon (its temporary file removed) and answers 400.
- A large directory arrives from the daemon in batches, gathered into one answer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request, Response
from starlette.requests import ClientDisconnect

from space.core import errors
from space.node.agent import rpc_models as rm
from space.node.agent import streams
from space.node.agent.routes.deps import PathQuery, Service, json_answer
from space.node.agent.rpc_auth import resource_router
from space.node.agent.streams import bytes_response, finish_call, ndjson_response
from space.protocol import FrameType
from space.protocol import methods as m

router = resource_router()


@router.put("/sandboxes/{sandbox_id}/files", response_model=rm.FileWritten)
async def write_file(
    svc: Service,
    sandbox_id: str,
    path: PathQuery,
    request: Request,
    *,
    mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None,
    append: bool = False,
) -> Response:
    handle, session = await svc.session(sandbox_id)
    params: dict[str, Any] = {"path": path, "append": append}
    if mode is not None:
        params["mode"] = mode
    call = await session.channel.open(m.FILES_WRITE, params)
    try:
        result = await streams.write_body(svc, call, request.stream(), handle.sandbox_id)
    except ClientDisconnect as exc:
        raise errors.InvalidArgument("the client went away before the upload ended") from exc
    return json_answer(rm.FileWritten(size=int(result.get("size", 0))))


@router.get("/sandboxes/{sandbox_id}/files", response_model=None)
async def read_file(
    svc: Service,
    sandbox_id: str,
    path: PathQuery,
    offset: Annotated[int, Query(ge=0)] = 0,
    length: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    handle, session = await svc.session(sandbox_id)
    return await bytes_response(
        streams.read_file(svc, handle.sandbox_id, session, path=path, offset=offset, length=length)
    )


@router.get("/sandboxes/{sandbox_id}/files/list", response_model=rm.FileList)
async def list_files(svc: Service, sandbox_id: str, path: PathQuery) -> rm.FileList:
    _, session = await svc.session(sandbox_id)
    # Not GuestSession.list_dir: a large directory arrives as "entries" event batches before the result.
    call = await session.channel.open(m.FILES_LIST, {"path": path})
    entries: list[dict[str, Any]] = []
    try:
        async for item in call.events():
            if item.kind == FrameType.EVENT and item.event.get("type") == "entries":
                entries.extend(item.event.get("entries", []))
        entries.extend((await call.result()).get("entries", []))
    finally:
        await finish_call(call, svc.settings.cancel_grace_s)
    return rm.FileList(entries=entries)


@router.get("/sandboxes/{sandbox_id}/files/stat")
async def stat_file(svc: Service, sandbox_id: str, path: PathQuery) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    return await session.stat(path)


@router.post("/sandboxes/{sandbox_id}/files/mkdir")
async def make_dir(svc: Service, sandbox_id: str, body: rm.MkdirRequest) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    await session.mkdir(body.path, parents=body.parents, mode=body.mode)
    return {}


@router.delete("/sandboxes/{sandbox_id}/files")
async def remove_file(
    svc: Service, sandbox_id: str, path: PathQuery, recursive: bool = False
) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    await session.remove(path, recursive=recursive)
    return {}


@router.post("/sandboxes/{sandbox_id}/files/rename")
async def rename_file(svc: Service, sandbox_id: str, body: rm.RenameRequest) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    await session.rename(body.src, body.dst)
    return {}


@router.get("/sandboxes/{sandbox_id}/files/watch", response_model=None)
async def watch_files(svc: Service, sandbox_id: str, path: PathQuery, recursive: bool = False) -> Response:
    handle, session = await svc.session(sandbox_id)
    call = await session.watch(path, recursive=recursive)
    return await ndjson_response(streams.watch(svc, handle.sandbox_id, call))
