"""Errors the SDK raises: the typed classes of space.core.errors, plus two of its own.

Invariants:
- Every error the SDK raises on purpose is a space.core.errors.SpaceError, so `except NotFound` works the same
  in the server and in a client.
- An API error body `{"error": {"code", "message", "details"}}` becomes the class of its `code` through
  space.core.errors.error_from_dict (InvalidState keeps `.state`); a body without that shape is classified
  by its HTTP status.
- HTTP 429 is always RateLimited (a ResourceExhausted); a connection failure or timeout is TransportError
  (an Unavailable), never a raw httpx exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from space.core.errors import (
    Conflict,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SpaceError,
    Timeout,
    TooLarge,
    Unauthenticated,
    Unavailable,
    error_from_dict,
)

__all__ = [
    "ConfigurationError",
    "RateLimited",
    "TransportError",
    "error_from_response",
]


class RateLimited(ResourceExhausted):
    """HTTP 429: too many requests; `retry_after` is the server's hint in seconds, if it gave one."""

    def __init__(self, message: str, *, retry_after: float | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after = retry_after


class TransportError(Unavailable):
    """The server could not be reached or did not answer in time (connection refused, reset, timeout)."""

    code = "transport_error"


class ConfigurationError(InvalidArgument):
    """The client has no server address (no SPACE_URL, no config file, no url=)."""

    code = "configuration_error"


_STATUS_CODES: Mapping[int, type[SpaceError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InvalidArgument,
    503: Unavailable,
    504: Timeout,
    507: ResourceExhausted,
}


def _retry_after(headers: Mapping[str, str]) -> float | None:
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def _wire_error(status: int, body: bytes) -> dict[str, Any]:
    """The `{"code", "message", "details"}` of an error answer, whatever shape its body has."""
    payload: Any = None
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict) and "code" in inner:
            return dict(inner)
        detail = payload.get("detail")
        if detail is not None:
            message = detail if isinstance(detail, str) else json.dumps(detail)
            return {"code": _STATUS_CODES.get(status, Internal).code, "message": message}
    text = body[:300].decode("utf-8", errors="replace").strip()
    return {
        "code": _STATUS_CODES.get(status, Internal).code,
        "message": f"HTTP {status}" + (f": {text}" if text else ""),
    }


def error_from_response(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> SpaceError:
    """The typed error for an HTTP answer with status >= 400 (`body` already read)."""
    wire = _wire_error(status, body)
    code = str(wire.get("code", "internal"))
    message = str(wire.get("message", f"HTTP {status}"))
    raw_details = wire.get("details")
    details: dict[str, Any] = dict(raw_details) if isinstance(raw_details, dict) else {}
    error: SpaceError
    if status == 429:
        error = RateLimited(message, retry_after=_retry_after(headers or {}), **_safe(details))
        error.code = code
        return error
    if code == "validation_error":
        error = InvalidArgument(message, **_safe(details))
        error.code = code
        return error
    try:
        return error_from_dict({"code": code, "message": message, "details": details})
    except TypeError:
        # details that collide with a class's own keyword arguments: keep the code, drop nothing silently
        error = _STATUS_CODES.get(status, SpaceError)(message, details=details)
        error.code = code
        return error


def _safe(details: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in details.items() if k not in {"message", "retry_after"}}
