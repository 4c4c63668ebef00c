"""The one map from typed errors to HTTP statuses, and the error body every response uses.

Invariants:
- Every error leaving the API is `{"error": {"code", "message", "details"}}` with a stable code.
- The status of each error class is decided here and nowhere else.
- Unexpected exceptions become a 500 `internal` whose message names no internals; they are logged.
- An error whose details carry `retry_after_s` (e.g. a rate limit, 429) is answered with a `Retry-After`
  header of that many whole seconds (at least 1): the client knows when trying again can succeed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.core import errors

log = logging.getLogger(__name__)

STATUS_BY_CODE: dict[str, int] = {
    errors.InvalidArgument.code: 400,
    "validation_error": 422,  # relayed from a node's own request validation
    errors.Unauthenticated.code: 401,
    errors.PermissionDenied.code: 403,
    errors.NotFound.code: 404,
    errors.InvalidState.code: 409,
    errors.Conflict.code: 409,
    errors.AlreadyExists.code: 409,
    errors.TooLarge.code: 413,
    errors.ResourceExhausted.code: 429,
    # A disk bound (storage budget, node reserve, no node with that much disk): 507, not 429, because
    # retrying soon does not help; the details name the numbers (docs/adr/0027-disk-budgets.md).
    errors.StorageExhausted.code: 507,
    errors.Timeout.code: 504,
    errors.Unavailable.code: 503,
    errors.ChannelError.code: 502,
    errors.GuestError.code: 502,
    errors.RuntimeFailure.code: 502,
    errors.Internal.code: 500,
    errors.ArtifactCorrupt.code: 502,
    errors.KeyRevoked.code: 403,
    errors.KeyUnavailable.code: 503,
}


def status_for(exc: errors.SpaceError) -> int:
    return STATUS_BY_CODE.get(exc.code, 500)


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def retry_after_header(exc: errors.SpaceError) -> dict[str, str]:
    """`Retry-After` for an error that says when to retry (details["retry_after_s"]), else nothing."""
    raw = exc.details.get("retry_after_s")
    if not isinstance(raw, int | float) or isinstance(raw, bool) or math.isnan(raw):
        return {}
    return {"Retry-After": str(max(1, math.ceil(min(float(raw), 86400.0))))}


def error_response(exc: errors.SpaceError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(exc.code, exc.message, exc.details),
        status_code=status_for(exc),
        headers={**retry_after_header(exc), **(headers or {})},
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(errors.SpaceError)
    async def _space_error(_request: Request, exc: errors.SpaceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = [
            ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
            for err in exc.errors()
        ]
        message = "; ".join(
            f"{field or '(body)'}: {err.get('msg', 'invalid')}"
            for field, err in zip(fields, exc.errors(), strict=True)
        )
        return JSONResponse(error_body("validation_error", message, {"fields": fields}), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthenticated"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal", "internal error"), status_code=500)
