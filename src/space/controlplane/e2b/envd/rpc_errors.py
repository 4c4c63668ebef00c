"""SPACE's typed errors as Connect errors (RPCs) and as envd's REST error bodies (`/files`).

Invariants:
- One table per surface, from `space.core.errors` codes (and, for a guest failure, the daemon's own code):
  every SpaceError becomes a Connect code the E2B SDK maps to the right exception (not found ->
  NotFoundException, already exists -> the SDK's False, ...); anything unknown is `internal`, never a crash.
- A wrong-state sandbox (paused for good, stopped, crashed) is `unavailable` on RPCs and 502 on REST, as
  E2B's proxy answers for a sandbox that is not running; the wrong state of something inside a running
  sandbox (resizing a process without a PTY) is `failed_precondition`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from space.core import errors
from space.core.lifecycle import State

P = ParamSpec("P")
T = TypeVar("T")

_CONNECT_CODES: dict[str, Code] = {
    errors.InvalidArgument.code: Code.INVALID_ARGUMENT,
    errors.RequestInvalid.code: Code.INVALID_ARGUMENT,
    errors.NotFound.code: Code.NOT_FOUND,
    errors.AlreadyExists.code: Code.ALREADY_EXISTS,
    errors.InvalidState.code: Code.UNAVAILABLE,
    errors.Conflict.code: Code.FAILED_PRECONDITION,
    errors.PermissionDenied.code: Code.PERMISSION_DENIED,
    errors.KeyRevoked.code: Code.PERMISSION_DENIED,
    errors.Unauthenticated.code: Code.UNAUTHENTICATED,
    errors.TooLarge.code: Code.RESOURCE_EXHAUSTED,
    errors.ResourceExhausted.code: Code.RESOURCE_EXHAUSTED,
    errors.StorageExhausted.code: Code.RESOURCE_EXHAUSTED,
    errors.Timeout.code: Code.DEADLINE_EXCEEDED,
    errors.Unavailable.code: Code.UNAVAILABLE,
    errors.KeyUnavailable.code: Code.UNAVAILABLE,
    errors.ChannelError.code: Code.UNAVAILABLE,
    errors.RuntimeFailure.code: Code.UNAVAILABLE,
}
#: A guest failure the agent left as a plain GuestError: the daemon's code says what it was.
_GUEST_CODES: dict[str, Code] = {
    "not_found": Code.NOT_FOUND,
    "no_such_process": Code.NOT_FOUND,
    "already_exists": Code.ALREADY_EXISTS,
    "not_a_directory": Code.INVALID_ARGUMENT,
    "is_a_directory": Code.INVALID_ARGUMENT,
    "invalid_argument": Code.INVALID_ARGUMENT,
    "permission_denied": Code.PERMISSION_DENIED,
    "no_space": Code.RESOURCE_EXHAUSTED,
}

_LIFECYCLE_STATES = frozenset(state.value for state in State)

_REST_STATUS: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.FAILED_PRECONDITION: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.DEADLINE_EXCEEDED: 504,
    Code.UNAVAILABLE: 502,
}


def connect_code(exc: errors.SpaceError) -> Code:
    guest_code = exc.details.get("guest_code")
    if isinstance(guest_code, str) and guest_code in _GUEST_CODES:
        return _GUEST_CODES[guest_code]
    if isinstance(exc, errors.InvalidState) and exc.details.get("state") not in _LIFECYCLE_STATES:
        return Code.FAILED_PRECONDITION  # the state of something in the sandbox (a process without a PTY)
    return _CONNECT_CODES.get(exc.code, Code.INTERNAL)


def connect_error(exc: errors.SpaceError) -> ConnectError:
    return ConnectError(connect_code(exc), exc.message)


def rest_status(exc: errors.SpaceError) -> int:
    """The HTTP status envd's REST API answers for `exc` (413 for a too large upload, 507 for a full disk)."""
    if isinstance(exc, errors.TooLarge):
        return 413
    if isinstance(exc, errors.StorageExhausted) or exc.details.get("guest_code") == "no_space":
        return 507
    return _REST_STATUS.get(connect_code(exc), 500)


def translated(handler: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A unary RPC whose SpaceErrors leave as Connect errors."""

    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(*args, **kwargs)
        except errors.SpaceError as exc:
            raise connect_error(exc) from exc

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


def translated_stream(handler: Callable[P, AsyncIterator[T]]) -> Callable[P, AsyncIterator[T]]:
    """A server-streaming RPC whose SpaceErrors (before or during the stream) leave as Connect errors."""

    async def run(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        try:
            async for item in handler(*args, **kwargs):
                yield item
        except errors.SpaceError as exc:
            raise connect_error(exc) from exc

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run
