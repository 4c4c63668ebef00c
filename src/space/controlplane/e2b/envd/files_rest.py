"""envd's REST endpoints: `GET /files` (download), `POST /files` (upload: raw or multipart) and `/health`.

Invariants:
- Same caller and sandbox resolution as the RPCs (`caller.target_of`): download needs a read-only key,
  upload a member key or the sandbox's envd token; the in-sandbox user is the `username` parameter. A
  request without credentials but with a `signature` is a signed URL (`caller.signed_target`).
- Paths travel to the node as values (SPACE's file calls), never as URL text: `..`, `%2f` or NUL in a path
  reach the daemon as the path they are, inside the sandbox's own root, or are refused (NUL, too long).
- A request body is cut at the control plane's `max_upload_bytes` whatever its framing (Content-Length or
  chunked): 413. A gzip body is inflated as a stream with the same bound on what it inflates to, so a
  gzip bomb costs at most that much and answers 413.
- Multipart: every part named `file` is one file, its filename the destination path (relative paths
  resolve in the sandbox's working directory); `path` names the destination only when there is exactly
  one file. Parent directories are created (by the daemon's write). The answer lists what was written
  (never empty). New files and directories belong to the `username` given, else to the template's
  default user (`user` in `base`): ADR 0057.
- `X-Metadata-<Key>` headers become the written files' extended attributes `user.e2b.<key>` (lowercase),
  replacing the set a file had (an upload without them clears it), as envd does.
- Downloads stream from the node; with `Accept-Encoding: gzip` they are compressed on the fly. A directory
  is 400, a missing file 404.
- Errors are envd's JSON `{"code": <status>, "message": ...}`.
- `/health` answers 204 without a sandbox header; with one, it needs a credential and answers 204 when the
  sandbox is running and 502 otherwise (paused, stopped, missing, another project's), without waking it.
"""

from __future__ import annotations

import asyncio
import mimetypes
import posixpath
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.controlplane.api.deps import Principal, Services
from space.controlplane.e2b.envd.caller import (
    Signed,
    Target,
    principal_for,
    sandbox_id_of,
    signed_target,
    target_of,
)
from space.controlplane.e2b.envd.entries import XATTR_PREFIX
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.e2b.envd.rpc_errors import rest_status
from space.core import errors
from space.core.lifecycle import State

CHUNK = 256 * 1024
METADATA_HEADER = "x-metadata-"
MAX_METADATA_KEYS = 64
MAX_FILES = 1000
MAX_PATH = 4096


def error_response(exc: errors.SpaceError) -> JSONResponse:
    status = rest_status(exc)
    # A refused body may still be arriving (an endless upload): the connection ends with the answer, so
    # the server does not go on reading and discarding it.
    headers = {"Connection": "close"} if isinstance(exc, errors.TooLarge) else None
    return JSONResponse({"code": status, "message": exc.message}, status_code=status, headers=headers)


def _path(value: str | None, field: str = "path") -> str:
    if not value or len(value) > MAX_PATH or "\x00" in value:
        raise errors.InvalidArgument(f"{field} must be a path of 1..{MAX_PATH} characters", field=field)
    return value


def limited_receive(receive: Receive, limit: int) -> Receive:
    """`receive`, refusing (TooLarge) a body longer than `limit` bytes however it is framed."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise errors.TooLarge(f"the upload exceeds {limit} bytes")
        return message

    return bounded


async def inflated(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """A gzip stream inflated piecewise, at most `limit` bytes of output (TooLarge beyond)."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    total = 0
    async for chunk in chunks:
        pending = chunk
        while pending:
            out = inflater.decompress(pending, CHUNK)
            pending = inflater.unconsumed_tail
            total += len(out)
            if total > limit:
                raise errors.TooLarge(f"the upload inflates to more than {limit} bytes")
            if out:
                yield out
            if inflater.eof:
                break
    try:
        tail = inflater.flush()
    except zlib.error as exc:
        raise errors.InvalidArgument("malformed gzip body") from exc
    if total + len(tail) > limit:
        raise errors.TooLarge(f"the upload inflates to more than {limit} bytes")
    if tail:
        yield tail
    if not inflater.eof:
        raise errors.InvalidArgument("truncated gzip body")


async def _guarded_inflate(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    try:
        async for out in inflated(chunks, limit):
            yield out
    except zlib.error as exc:
        raise errors.InvalidArgument(f"malformed gzip body: {exc}") from exc


async def _file_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(CHUNK):
        yield chunk


def metadata_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """E2B's `X-Metadata-<Key>: <value>` upload headers as {key (lowercase): value}."""
    found = {
        name.lower().removeprefix(METADATA_HEADER): value
        for name, value in headers.items()
        if name.lower().startswith(METADATA_HEADER)
    }
    if len(found) > MAX_METADATA_KEYS or any(not key or len(key) > 200 for key in found):
        raise errors.InvalidArgument(
            f"at most {MAX_METADATA_KEYS} metadata headers, keys of 1..200 characters"
        )
    return found


async def _write(
    target: Target, path: str, data: AsyncIterator[bytes], metadata: dict[str, str]
) -> dict[str, Any]:
    """One node call for the file: the daemon makes the parent directories and replaces a regular file by
    a new one (a new inode, so the old file's `user.e2b.*` metadata goes with it and each upload's set
    replaces the last). What it creates belongs to the caller's `username` (else to the template's default
    user, as envd's default user). A relative path is stat'ed for the absolute path the answer names."""
    await target.node.write_file(target.sandbox_id, path, data, user=target.user)
    if path.startswith("/"):
        absolute = "/" + posixpath.normpath(path).lstrip("/")
    else:
        absolute = str((await target.node.stat(target.sandbox_id, path)).get("path", path))
    for key, value in metadata.items():
        await target.node.set_xattr(target.sandbox_id, absolute, XATTR_PREFIX + key, value.encode())
    written: dict[str, Any] = {"path": absolute, "name": posixpath.basename(absolute), "type": "file"}
    if metadata:
        written["metadata"] = metadata
    return written


async def _files_target(
    request: Request, services: Services, limits: EnvdLimits, *, mutating: bool
) -> Target:
    """The caller's sandbox: by credentials and E2b-Sandbox-Id, or by the signature of a signed URL."""
    query = request.query_params
    credentials = ("x-access-token", "x-api-key", "authorization")
    signature = query.get("signature")
    if signature is not None and not any(request.headers.get(name) for name in credentials):
        signed = Signed(
            path=query.get("path", ""), operation="write" if mutating else "read", user=query.get("username"),
            signature=signature, expiration=query.get("signature_expiration"),
        )  # fmt: skip
        return await signed_target(services, limits, request.headers, signed, mutating=mutating)
    user = query.get("username")
    return await target_of(services, limits, request.headers, mutating=mutating, query_user=user)


async def _upload(request: Request, services: Services, limits: EnvdLimits) -> Response:
    query_path = request.query_params.get("path")
    target = await _files_target(request, services, limits, mutating=True)
    async with limits.stream(target.who):
        return await _upload_to(request, services, target, query_path)


async def _upload_to(
    request: Request, services: Services, target: Target, query_path: str | None
) -> Response:
    content_type = request.headers.get("content-type", "")
    limit = services.settings.max_upload_bytes
    if content_type.startswith("multipart/form-data"):
        written = await _upload_multipart(request, target, query_path)
    else:
        path = _path(query_path)
        body: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").strip().lower() == "gzip":
            body = _guarded_inflate(body, limit)
        elif request.headers.get("content-encoding", "identity").strip().lower() != "identity":
            raise errors.InvalidArgument("only gzip or identity content encodings are accepted")
        written = [await _write(target, path, body, metadata_headers(request.headers))]
    return JSONResponse(written)


async def _upload_multipart(request: Request, target: Target, query_path: str | None) -> list[dict[str, Any]]:
    metadata = metadata_headers(request.headers)
    async with request.form(max_files=MAX_FILES, max_fields=MAX_FILES) as form:
        files = [part for name, part in form.multi_items() if name == "file" and isinstance(part, UploadFile)]
        if not files:
            raise errors.InvalidArgument("no file part in the multipart body", field="file")
        written = []
        for upload in files:
            destination = query_path if query_path and len(files) == 1 else upload.filename
            path = _path(destination, "filename")
            written.append(await _write(target, path, _file_chunks(upload), metadata))
    return written


async def _first_and_rest(chunks: AsyncIterator[bytes]) -> tuple[bytes, AsyncIterator[bytes]]:
    """The first chunk awaited (so an error is still a status), and the stream from it on."""
    first = await anext(chunks, b"")

    async def rest() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return first, rest()


async def _gzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    deflater = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    async for chunk in chunks:
        out = deflater.compress(chunk)
        if out:
            yield out
    yield deflater.flush()


async def _held(limits: EnvdLimits, who: Principal, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks`, holding one of the caller's stream slots until they end (or the client goes away)."""
    async with limits.stream(who):
        async for chunk in chunks:
            yield chunk


async def _download(request: Request, services: Services, limits: EnvdLimits) -> Response:
    path = _path(request.query_params.get("path"))
    target = await _files_target(request, services, limits, mutating=False)
    # One node call: the daemon refuses a directory (400) or a missing file (404) before the first chunk,
    # which is awaited before the answer's headers go out.
    chunks = _held(limits, target.who, target.node.read_file_stream(target.sandbox_id, path))
    _first, body = await _first_and_rest(chunks)
    name = posixpath.basename(posixpath.normpath(path))
    headers = {"Content-Disposition": f"inline; filename*=UTF-8''{_quoted(name)}"}
    media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if "gzip" in request.headers.get("accept-encoding", "").lower():
        headers["Content-Encoding"] = "gzip"
        return StreamingResponse(_gzipped(body), media_type=media_type, headers=headers)
    return StreamingResponse(body, media_type=media_type, headers=headers)


def _quoted(name: str) -> str:
    return quote(name, safe="")


async def _health(request: Request, services: Services, limits: EnvdLimits) -> Response:
    if request.headers.get("e2b-sandbox-id") is None:
        return Response(status_code=204)
    sandbox_id = sandbox_id_of(request.headers)
    who = await principal_for(services, request.headers, sandbox_id)
    limits.admit(who)
    state = await _sandbox_state(services, who.project_id, sandbox_id)
    if state != State.RUNNING:
        return JSONResponse({"code": 502, "message": "The sandbox was not found"}, status_code=502)
    return Response(status_code=204)


async def _sandbox_state(services: Services, project_id: str, sandbox_id: str) -> State | None:
    """The sandbox's state when it is meant to run (None: missing, another project's, or wished else)."""
    sb = await asyncio.to_thread(services.store.get_sandbox, project_id, sandbox_id)
    if sb is None or sb.desired_state != State.RUNNING:
        return None
    return sb.state


def rest_app(services: Services, limits: EnvdLimits) -> ASGIApp:
    """`/files` and `/health` (anything else: 404 in envd's shape)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await _route(request, services, limits, scope, receive)
        except errors.SpaceError as exc:
            response = error_response(exc)
        except HTTPException as exc:  # Starlette's multipart parser: a malformed body
            response = JSONResponse({"code": 400, "message": str(exc.detail)}, status_code=400)
        await response(scope, receive, send)

    return app


async def _route(
    request: Request, services: Services, limits: EnvdLimits, scope: Scope, receive: Receive
) -> Response:
    path, method = scope["path"], scope["method"]
    if path == "/health" and method in ("GET", "HEAD"):
        return await _health(request, services, limits)
    if path == "/files" and method == "GET":
        return await _download(request, services, limits)
    if path == "/files" and method == "POST":
        limit = services.settings.max_upload_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise errors.TooLarge(f"the upload of {length} bytes exceeds {limit}")
        bounded = Request(scope, limited_receive(receive, limit))
        return await _upload(bounded, services, limits)
    if path in ("/files", "/health"):
        return JSONResponse({"code": 405, "message": "method not allowed"}, status_code=405)
    return JSONResponse({"code": 404, "message": "not found"}, status_code=404)
