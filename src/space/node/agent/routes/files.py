"""File routes of the data plane: read, write, list, stat, mkdir, remove, rename, watch, user.* xattrs.

Invariants:
- Uploads and downloads are streamed (space.node.agent.streams): no file is held whole in the agent. An
  upload whose client goes away is discarded by the daemon (its temporary file removed) and answers 400.
- A large directory arrives from the daemon in batches, gathered into one answer; a listing is bounded
  in depth and entries (space.node.agent.file_models), and says when it was cut ("truncated").
- Extended attribute names are user.* only, checked here and again by the daemon; a filesystem that has
  none is a 400 (InvalidArgument, reason "xattrs_not_supported"), never a 502.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Query, Request, Response
from starlette.requests import ClientDisconnect

from space.core import errors
from space.node.agent import file_models as fm
from space.node.agent import rpc_models as rm
from space.node.agent import streams
from space.node.agent.routes.deps import PathQuery, Service, json_answer
from space.node.agent.rpc_auth import resource_router
from space.node.agent.streams import bytes_response, finish_call, ndjson_response
from space.protocol import FrameType
from space.protocol import methods as m

router = resource_router()

Depth = Annotated[int, Query(ge=1, le=fm.MAX_DEPTH)]
Limit = Annotated[int, Query(ge=1, le=fm.MAX_LIST_ENTRIES)]
XattrName = Annotated[
    str, Query(min_length=6, max_length=fm.MAX_XATTR_NAME_BYTES, pattern=fm.XATTR_NAME_PATTERN)
]


@router.put("/sandboxes/{sandbox_id}/files", response_model=rm.FileWritten)
async def write_file(
    svc: Service,
    sandbox_id: str,
    path: PathQuery,
    request: Request,
    *,
    mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None,
    append: bool = False,
    user: Annotated[str | None, Query(pattern=rm.FILE_USER_PATTERN)] = None,
) -> Response:
    handle, session = await svc.session(sandbox_id)
    params: dict[str, Any] = {"path": path, "append": append}
    if mode is not None:
        params["mode"] = mode
    if user is not None:
        params["user"] = user  # who what the write creates belongs to (default: the template's user)
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


@router.get("/sandboxes/{sandbox_id}/files/list", response_model=fm.FileListing)
async def list_files(
    svc: Service, sandbox_id: str, path: PathQuery, *, depth: Depth = 1, limit: Limit = fm.MAX_LIST_ENTRIES,
    xattrs: bool = False,
) -> fm.FileListing:  # fmt: skip
    _, session = await svc.session(sandbox_id)
    # Not GuestSession.list_dir: a large directory arrives as "entries" event batches before the result.
    params = {"path": path, "depth": depth, "limit": limit, "xattrs": xattrs}
    call = await session.channel.open(m.FILES_LIST, params)
    entries: list[dict[str, Any]] = []
    try:
        async for item in call.events():
            if item.kind == FrameType.EVENT and item.event.get("type") == "entries":
                entries.extend(item.event.get("entries", []))
        result = await call.result()
        entries.extend(result.get("entries", []))
    finally:
        await finish_call(call, svc.settings.cancel_grace_s)
    return fm.FileListing(entries=entries, truncated=bool(result.get("truncated", False)))


@router.get("/sandboxes/{sandbox_id}/files/stat")
async def stat_file(
    svc: Service, sandbox_id: str, path: PathQuery, *, follow: bool = False, xattrs: bool = False
) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    answer: dict[str, Any] = await session.channel.call(
        m.FILES_STAT, {"path": path, "follow": follow, "xattrs": xattrs}
    )
    return answer


@router.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=fm.MkdirAnswer)
async def make_dir(svc: Service, sandbox_id: str, body: rm.MkdirRequest) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    params = body.model_dump(exclude_none=True)
    answer: dict[str, Any] = await session.channel.call(m.FILES_MKDIR, params)
    return answer


@router.delete("/sandboxes/{sandbox_id}/files")
async def remove_file(
    svc: Service, sandbox_id: str, path: PathQuery, recursive: bool = False
) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    await session.remove(path, recursive=recursive)
    return {}


@router.post("/sandboxes/{sandbox_id}/files/rename", response_model=fm.EntryAnswer)
async def rename_file(svc: Service, sandbox_id: str, body: fm.MoveRequest) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    params = {"src": body.src, "dst": body.dst, "parents": body.parents}
    answer: dict[str, Any] = await session.channel.call(m.FILES_RENAME, params)
    return answer


# -- extended attributes (user.* only) ---------------------------------------------------------------------
@router.get("/sandboxes/{sandbox_id}/files/xattrs", response_model=fm.XattrList)
async def list_xattrs(svc: Service, sandbox_id: str, path: PathQuery) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    with _typed_refusals():
        answer: dict[str, Any] = await session.channel.call(m.FILES_XATTR_LIST, {"path": path})
    return answer


@router.get("/sandboxes/{sandbox_id}/files/xattrs/value", response_model=fm.XattrValue)
async def get_xattr(svc: Service, sandbox_id: str, path: PathQuery, attribute: XattrName) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    with _typed_refusals():
        answer: dict[str, Any] = await session.channel.call(
            m.FILES_XATTR_GET, {"path": path, "name": _xattr_name(attribute)}
        )
    return answer


@router.put("/sandboxes/{sandbox_id}/files/xattrs")
async def set_xattr(svc: Service, sandbox_id: str, body: fm.XattrSetRequest) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    with _typed_refusals():
        params = {"path": body.path, "name": body.attribute, "value_b64": body.value_b64}
        await session.channel.call(m.FILES_XATTR_SET, params)
    return {}


@router.delete("/sandboxes/{sandbox_id}/files/xattrs")
async def remove_xattr(
    svc: Service, sandbox_id: str, path: PathQuery, attribute: XattrName
) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    with _typed_refusals():
        await session.channel.call(m.FILES_XATTR_REMOVE, {"path": path, "name": _xattr_name(attribute)})
    return {}


def _xattr_name(name: str) -> str:
    try:
        return fm.check_xattr_name(name)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc), field="attribute") from exc


@contextlib.contextmanager
def _typed_refusals() -> Iterator[None]:
    """A filesystem without user attributes is the caller's problem (400 naming it), not a bad gateway."""
    try:
        yield
    except errors.InvalidArgument as exc:
        if exc.details.get("guest_code") != "not_supported":
            raise
        raise errors.InvalidArgument(
            exc.message, guest_code="not_supported", reason="xattrs_not_supported"
        ) from exc


@router.get("/sandboxes/{sandbox_id}/files/watch", response_model=None)
async def watch_files(svc: Service, sandbox_id: str, path: PathQuery, recursive: bool = False) -> Response:
    handle, session = await svc.session(sandbox_id)
    call = await session.watch(path, recursive=recursive)
    return await ndjson_response(streams.watch(svc, handle.sandbox_id, call))
