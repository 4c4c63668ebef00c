"""E2B's error shape on the control API: every failure is `{"code": <HTTP status>, "message": str}`
(E2B's `Error` schema; its SDK reads both keys and fails with a KeyError on a body without them).

Invariants:
- The status of a SPACE error comes from SPACE's one status map (`space.rest.errors.status_for`); only
  the body is E2B's, with SPACE's typed code as the optional `error_code`. Two statuses differ on
  purpose, where E2B's clients expect them: a malformed body or query (SPACE's 422 `request_invalid`) is a
  400, and an unknown route is a 404 in this shape too.
- A failure nobody expected is a 500 with a fixed message (logged, never echoed).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.core import errors
from space.rest import errors as rest_errors

log = logging.getLogger(__name__)


class NotSupported(errors.SpaceError):
    """A part of E2B's API that SPACE does not offer (yet): 501 on the E2B front only."""

    code = "not_supported"


#: SPACE codes whose E2B status differs from SPACE's own (module invariants).
_E2B_STATUS = {
    errors.RequestInvalid.code: 400,
    errors.InvalidArgument.code: 400,
    NotSupported.code: 501,
}


def e2b_status(error: errors.SpaceError) -> int:
    return _E2B_STATUS.get(error.code, rest_errors.status_for(error))


def e2b_body(status: int, message: str, code: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"code": status, "message": message}
    if code is not None:
        body["error_code"] = code
    return body


def e2b_error_response(error: errors.SpaceError) -> JSONResponse:
    status = e2b_status(error)
    headers = rest_errors.headers_for(error)
    headers.pop("WWW-Authenticate", None)  # E2B's scheme is the X-API-Key header, not a bearer challenge
    return JSONResponse(e2b_body(status, error.message, error.code), status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Answer every failure of `app` in E2B's shape."""

    @app.exception_handler(errors.SpaceError)
    async def _space_error(_request: Request, exc: errors.SpaceError) -> JSONResponse:
        return e2b_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return e2b_error_response(rest_errors.request_invalid(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(e2b_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error in the E2B control API", exc_info=exc)
        return JSONResponse(e2b_body(500, "internal error in the E2B control API"), status_code=500)
