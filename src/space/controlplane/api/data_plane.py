"""Data-plane routes: exec, processes, files and the PTY, each relayed to the sandbox's node (ADR 0020).

Invariants:
- The gateway forwards only the operations below, each to the node route of the same shape (through
  `deps.relay`): the node URL is built from the authorized record's id and fixed words or validated ids,
  the query from typed parameters, the body from a validated model or, for uploads and stdin, the raw
  bytes; of the client's headers only Content-Type goes on. Nothing of the client's path text reaches the
  node, so no encoding (dot segments, %2f, backslashes, overlong UTF-8, NUL) can name another route or
  sandbox there.
- Reading needs a read-only key, anything that changes the sandbox a member key.
- The PTY authenticates like any request before its handshake completes: a refused one answers with the
  real status and error body, never an accepted-then-closed socket.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, WebSocket
from pydantic import ValidationError
from starlette.datastructures import QueryParams

from space.controlplane.api.bodies import PtyParameters
from space.controlplane.api.deps import (
    PTY_PROTOCOL,
    Auth,
    Svc,
    authenticate,
    authorization_of,
    node_of,
    relay,
    running_sandbox,
    services_of,
)
from space.controlplane.api.views import Empty
from space.core import errors
from space.core.ids import parse_process_id, parse_sandbox_id
from space.node.agent import file_models as fm
from space.node.agent import rpc_models as rm
from space.rest import errors as rest_errors

FilePath = Annotated[str, Query(min_length=1, max_length=4096)]
NonNegative = Annotated[int, Query(ge=0)]
FileMode = Annotated[int | None, Query(ge=0, le=0o7777)]
Depth = Annotated[int, Query(ge=1, le=fm.MAX_DEPTH)]
Limit = Annotated[int, Query(ge=1, le=fm.MAX_LIST_ENTRIES)]
XattrName = Annotated[
    str,
    Query(
        min_length=6,
        max_length=fm.MAX_XATTR_NAME_BYTES,
        pattern=fm.XATTR_NAME_PATTERN,
        description='"user.*" only.',
    ),
]

NDJSON = "application/x-ndjson"
#: Answers that are streams, not one JSON document (listed by test_controlplane_openapi).
NDJSON_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"description": "NDJSON events, one per line", "content": {NDJSON: {}}}
}
BYTES_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"description": "The file's bytes (streamed)", "content": {"application/octet-stream": {}}}
}
#: The raw body of an upload or of stdin: read by the relay as a stream, so FastAPI does not declare it.
RAW_BODY: dict[str, Any] = {
    "requestBody": {
        "required": False,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}

router = APIRouter()


def _process(process_id: str) -> str:
    return parse_process_id(process_id, field="process_id")


# -- processes -----------------------------------------------------------------------------------------------
@router.post("/sandboxes/{sandbox_id}/exec", response_model=rm.ExecResponse, responses=NDJSON_ANSWER)
async def exec_(
    sandbox_id: str, body: rm.ExecRequest, request: Request, who: Auth, services: Svc
) -> Response:
    """Run a command; with `stream`, NDJSON events (started, stdout/stderr, exit)."""
    return await relay(request, services, who, sandbox_id, "exec", mutating=True, body=body)


@router.get("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessList)
async def list_processes(sandbox_id: str, request: Request, who: Auth, services: Svc) -> Response:
    return await relay(request, services, who, sandbox_id, "processes", mutating=False)


@router.post("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessStarted, status_code=201)
async def start_process(
    sandbox_id: str, body: rm.ProcessStartRequest, request: Request, who: Auth, services: Svc
) -> Response:
    return await relay(request, services, who, sandbox_id, "processes", mutating=True, body=body)


@router.get(
    "/sandboxes/{sandbox_id}/processes/{process_id}/output", response_model=None, responses=NDJSON_ANSWER
)
async def process_output(
    sandbox_id: str, process_id: str, request: Request, who: Auth, services: Svc, *,
    offset: NonNegative = 0, follow: bool = True,
) -> Response:  # fmt: skip
    """NDJSON: attached {offset, truncated}, stdout/stderr, then exit (end without follow)."""
    return await relay(
        request, services, who, sandbox_id, "processes", _process(process_id), "output", mutating=False,
        params={"offset": offset, "follow": follow},
    )  # fmt: skip


@router.post(
    "/sandboxes/{sandbox_id}/processes/{process_id}/stdin",
    response_model=rm.StdinWritten,
    openapi_extra=RAW_BODY,
)
async def process_stdin(
    sandbox_id: str, process_id: str, request: Request, who: Auth, *, services: Svc, eof: bool = False
) -> Response:
    """The raw body goes to the process's stdin (streamed)."""
    return await relay(
        request, services, who, sandbox_id, "processes", _process(process_id), "stdin", mutating=True,
        params={"eof": eof}, stream_body=True,
    )  # fmt: skip


@router.post("/sandboxes/{sandbox_id}/processes/{process_id}/signal", response_model=Empty)
async def process_signal(
    sandbox_id: str, process_id: str, body: rm.SignalRequest, request: Request, *, who: Auth, services: Svc
) -> Response:
    return await relay(
        request, services, who, sandbox_id, "processes", _process(process_id), "signal", mutating=True,
        body=body,
    )  # fmt: skip


@router.post("/sandboxes/{sandbox_id}/processes/{process_id}/resize", response_model=Empty)
async def process_resize(
    sandbox_id: str, process_id: str, body: rm.ResizeRequest, request: Request, *, who: Auth, services: Svc
) -> Response:
    """Set a PTY process's terminal size; a process without a PTY is a 409 (state "no_terminal")."""
    return await relay(
        request, services, who, sandbox_id, "processes", _process(process_id), "resize", mutating=True,
        body=body,
    )  # fmt: skip


# -- files ---------------------------------------------------------------------------------------------------
@router.get("/sandboxes/{sandbox_id}/files", response_model=None, responses=BYTES_ANSWER)
async def read_file(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, services: Svc, *, offset: NonNegative = 0,
    length: Annotated[int | None, Query(ge=0)] = None,
) -> Response:  # fmt: skip
    """The file's bytes (streamed)."""
    params: dict[str, Any] = {"path": path, "offset": offset, "length": length}
    return await relay(request, services, who, sandbox_id, "files", mutating=False, params=params)


@router.put("/sandboxes/{sandbox_id}/files", response_model=rm.FileWritten, openapi_extra=RAW_BODY)
async def write_file(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, services: Svc, *, mode: FileMode = None,
    append: bool = False, user: Annotated[str | None, Query(pattern=rm.FILE_USER_PATTERN)] = None,
) -> Response:  # fmt: skip
    """The raw body becomes the file (streamed). A file or directory the write creates belongs to `user`
    (a name or uid in the sandbox), else to the template's default user (`user` in `base`, root in
    `python`); overwriting keeps a file's owner."""
    params: dict[str, Any] = {"path": path, "mode": mode, "append": append, "user": user}
    return await relay(
        request, services, who, sandbox_id, "files", mutating=True, params=params, stream_body=True
    )


@router.delete("/sandboxes/{sandbox_id}/files", response_model=Empty)
async def remove_file(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, *, services: Svc, recursive: bool = False
) -> Response:
    params: dict[str, Any] = {"path": path, "recursive": recursive}
    return await relay(request, services, who, sandbox_id, "files", mutating=True, params=params)


@router.get("/sandboxes/{sandbox_id}/files/list", response_model=fm.FileListing)
async def list_files(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, services: Svc, *, depth: Depth = 1,
    limit: Limit = fm.MAX_LIST_ENTRIES, xattrs: bool = False,
) -> Response:  # fmt: skip
    """Entries below `path` up to `depth` levels (pre-order, by name; never through a symlink);
    `truncated` when `limit` cut the listing. With `xattrs`, each entry has its user.* attributes."""
    params = {"path": path, "depth": depth, "limit": limit, "xattrs": xattrs}
    return await relay(request, services, who, sandbox_id, "files", "list", mutating=False, params=params)


@router.get("/sandboxes/{sandbox_id}/files/stat", response_model=fm.FileEntry)
async def stat_file(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, services: Svc, *, follow: bool = False,
    xattrs: bool = False,
) -> Response:  # fmt: skip
    """The path itself (lstat); with `follow`, what a symlink leads to (`broken` when it cannot)."""
    params = {"path": path, "follow": follow, "xattrs": xattrs}
    return await relay(request, services, who, sandbox_id, "files", "stat", mutating=False, params=params)


@router.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=fm.MkdirAnswer)
async def make_dir(
    sandbox_id: str, body: rm.MkdirRequest, request: Request, who: Auth, services: Svc
) -> Response:
    """`created` is false when the directory was already there (with `parents`)."""
    return await relay(request, services, who, sandbox_id, "files", "mkdir", mutating=True, body=body)


@router.post("/sandboxes/{sandbox_id}/files/rename", response_model=fm.EntryAnswer)
async def rename_file(
    sandbox_id: str, body: fm.MoveRequest, request: Request, who: Auth, services: Svc
) -> Response:
    return await relay(request, services, who, sandbox_id, "files", "rename", mutating=True, body=body)


@router.get("/sandboxes/{sandbox_id}/files/xattrs", response_model=fm.XattrList)
async def list_xattrs(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, services: Svc
) -> Response:
    """The user.* extended attributes of `path` (values in base64)."""
    params = {"path": path}
    return await relay(request, services, who, sandbox_id, "files", "xattrs", mutating=False, params=params)


@router.get("/sandboxes/{sandbox_id}/files/xattrs/value", response_model=fm.XattrValue)
async def get_xattr(
    sandbox_id: str, path: FilePath, attribute: XattrName, request: Request, *, who: Auth, services: Svc
) -> Response:
    params = {"path": path, "attribute": attribute}
    return await relay(
        request, services, who, sandbox_id, "files", "xattrs", "value", mutating=False, params=params
    )


@router.put("/sandboxes/{sandbox_id}/files/xattrs", response_model=Empty)
async def set_xattr(
    sandbox_id: str, body: fm.XattrSetRequest, request: Request, who: Auth, services: Svc
) -> Response:
    return await relay(request, services, who, sandbox_id, "files", "xattrs", mutating=True, body=body)


@router.delete("/sandboxes/{sandbox_id}/files/xattrs", response_model=Empty)
async def remove_xattr(
    sandbox_id: str, path: FilePath, attribute: XattrName, request: Request, *, who: Auth, services: Svc
) -> Response:
    params = {"path": path, "attribute": attribute}
    return await relay(request, services, who, sandbox_id, "files", "xattrs", mutating=True, params=params)


@router.get("/sandboxes/{sandbox_id}/files/watch", response_model=None, responses=NDJSON_ANSWER)
async def watch_files(
    sandbox_id: str, path: FilePath, request: Request, who: Auth, *, services: Svc, recursive: bool = False
) -> Response:
    """NDJSON: {"type": "watching"} once in place, then {"type": "changes", "changes": [...]}."""
    params: dict[str, Any] = {"path": path, "recursive": recursive}
    return await relay(request, services, who, sandbox_id, "files", "watch", mutating=False, params=params)


# -- PTY -----------------------------------------------------------------------------------------------------
@router.websocket("/sandboxes/{sandbox_id}/pty")
async def pty(websocket: WebSocket, sandbox_id: str) -> None:
    """PTY over WebSocket: authenticate like any request, then pump frames both ways to the node."""
    services = services_of(websocket)
    try:
        who = await authenticate(
            services,
            authorization_of(websocket.headers, websocket=True),
            websocket.headers.get("x-space-project"),
        )
        who.require("member")
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        terminal = pty_parameters(websocket.query_params)
        sb = await running_sandbox(services, who, sandbox_id)
    except errors.SpaceError as exc:
        # Refused before the handshake completes: the client sees the real status and error body.
        await websocket.send_denial_response(rest_errors.error_response(exc))
        return
    # A browser that sent its key as a subprotocol is answered with the PTY's own (ADR 0061).
    chosen = PTY_PROTOCOL if PTY_PROTOCOL in websocket.scope.get("subprotocols", []) else None
    await websocket.accept(subprotocol=chosen)
    node = services.nodes.client(node_of(sb))
    async with node.pty(sb.id, rows=terminal.rows, cols=terminal.cols, cmd=terminal.cmd) as upstream:
        await relay_websocket(websocket, upstream)


def pty_parameters(query: QueryParams) -> PtyParameters:
    """The PTY's query (rows, cols, cmd), typed: anything else, or a repeated one, is invalid."""
    names = list(query.keys())
    if len(names) != len(set(names)):
        raise errors.InvalidArgument("a PTY query parameter is repeated", field="query")
    try:
        return PtyParameters.model_validate(dict(query))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise errors.InvalidArgument(f"invalid PTY parameters: {problems}", field="query") from exc


async def relay_websocket(websocket: WebSocket, upstream: Any, *, keep_close_code: bool = False) -> None:
    """Messages both ways between a client and a node's WebSocket until either side ends (the PTY, CDP).
    `keep_close_code`: the node's application close code (4000-4999, e.g. CDP's 4409: no browser) reaches
    the client; otherwise the client's close is a normal one."""
    from websockets.exceptions import ConnectionClosed

    async def client_to_node() -> None:
        while True:
            message = await websocket.receive()
            if message.get("type") == "websocket.disconnect":
                await upstream.close()
                return
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    async def node_to_client() -> None:
        try:
            async for data in upstream:
                if isinstance(data, bytes):
                    await websocket.send_bytes(data)
                else:
                    await websocket.send_text(data)
        except ConnectionClosed:
            pass
        code = upstream.close_code if keep_close_code else None
        await websocket.close(code=code if code is not None and 4000 <= code < 5000 else 1000)

    tasks = [asyncio.create_task(client_to_node()), asyncio.create_task(node_to_client())]
    _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
