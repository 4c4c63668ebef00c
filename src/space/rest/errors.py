"""The one error model of every HTTP surface: one status map, one error body, one validation-error shape.

Invariants:
- Every error leaving an HTTP surface is `{"error": {"code", "message", "details"}}` with a stable code;
  the status of each code is decided in `STATUS_BY_CODE` and nowhere else (the API and the node RPC use
  the same map, so a code means the same status wherever a client meets it).
- A malformed request (body, query, path, header) is a `RequestInvalid` (422, code `validation_error`)
  whose details name each bad field (`fields`) and what is wrong with it (`errors`).
- Unexpected exceptions become a 500 `internal` whose message names no internals; they are logged.
- An error whose details carry `retry_after_s` (a rate limit, 429) is answered with `Retry-After` in whole
  seconds (at least 1); a 401 carries `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.core import errors

log = logging.getLogger(__name__)

STATUS_BY_CODE: dict[str, int] = {
    errors.InvalidArgument.code: 400,
    errors.RequestInvalid.code: 422,
    errors.Unauthenticated.code: 401,
    errors.PermissionDenied.code: 403,
    errors.NotFound.code: 404,
    errors.InvalidState.code: 409,
    errors.Conflict.code: 409,
    errors.AlreadyExists.code: 409,
    errors.TooLarge.code: 413,
    # A quota, capacity or rate limit: retrying later may succeed.
    errors.ResourceExhausted.code: 429,
    # A disk bound (storage budget, node reserve, no node with that much disk): 507, not 429, because
    # retrying soon does not help; the details name the numbers (docs/adr/0027-disk-budgets.md).
    errors.StorageExhausted.code: 507,
    errors.Timeout.code: 504,
    errors.Unavailable.code: 503,
    # Something behind this surface failed (the sandbox's daemon, its channel, the isolation runtime, a
    # stored artifact): a bad gateway, not a bug of this server.
    errors.ChannelError.code: 502,
    errors.GuestError.code: 502,
    errors.RuntimeFailure.code: 502,
    errors.ArtifactCorrupt.code: 502,
    # The chosen node's runtime cannot restore this checkpoint (space.core.runtimes): a conflict with the
    # node, not a failure of it; placement then picks another node.
    errors.RuntimeIncompatible.code: 409,
    # What the sandbox's isolation cannot do (a disk snapshot of a microVM): the request conflicts with
    # how the sandbox was made, like a state that refuses it.
    errors.NotSupported.code: 409,
    # A node whose protocol range does not overlap the control plane's (ADR 0071): a conflict between
    # versions, refused at registration; retrying does not help, upgrading one side does.
    errors.IncompatibleProtocol.code: 409,
    errors.Internal.code: 500,
    errors.KeyRevoked.code: 403,
    errors.KeyUnavailable.code: 503,
}

#: Starlette's own HTTP errors (no route, wrong method) in the same shape.
_HTTP_CODES = {401: errors.Unauthenticated.code, 404: errors.NotFound.code, 405: "method_not_allowed"}


def status_for(error: errors.SpaceError) -> int:
    return STATUS_BY_CODE.get(error.code, 500)


def error_body(code: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": dict(details or {})}}


def body_of(error: errors.SpaceError) -> dict[str, Any]:
    return error_body(error.code, error.message, error.details)


def headers_for(error: errors.SpaceError) -> dict[str, str]:
    """`Retry-After` for an error that says when to retry (details["retry_after_s"]); the auth scheme
    for a 401."""
    headers: dict[str, str] = {}
    if error.code == errors.Unauthenticated.code:
        headers["WWW-Authenticate"] = "Bearer"
    raw = error.details.get("retry_after_s")
    if isinstance(raw, int | float) and not isinstance(raw, bool) and not math.isnan(raw):
        headers["Retry-After"] = str(max(1, math.ceil(min(float(raw), 86400.0))))
    return headers


def error_response(error: errors.SpaceError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        body_of(error), status_code=status_for(error), headers={**headers_for(error), **(headers or {})}
    )


def request_invalid(exc: RequestValidationError | ValidationError) -> errors.RequestInvalid:
    """A pydantic/FastAPI validation failure as the one validation-error shape."""
    problems = []
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        # FastAPI prefixes where the value came from; the field's own path is what a caller can fix.
        if loc and loc[0] in {"body", "query", "path", "header"}:
            loc = loc[1:]
        problems.append({"field": ".".join(loc) or "(body)", "problem": str(err.get("msg", "invalid"))})
    fields = list(dict.fromkeys(p["field"] for p in problems))
    message = "; ".join(f"{p['field']}: {p['problem']}" for p in problems) or "invalid request"
    return errors.RequestInvalid(message, fields=fields, errors=problems)


def install(app: FastAPI, *, surface: str) -> None:
    """Answer every failure of `app` in the one shape; `surface` names the server in the 500's message."""

    @app.exception_handler(errors.SpaceError)
    async def _space_error(_request: Request, exc: errors.SpaceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request_invalid(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error in the %s", surface, exc_info=exc)
        return error_response(errors.Internal(f"internal error in the {surface}"))
