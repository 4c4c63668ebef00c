"""The typed error hierarchy of SPACE (pure: no I/O).

Invariants:
- Every error a user can see is a SpaceError with a stable machine-readable `code` and a human `message`.
- The HTTP status of each class is decided in exactly one place (space.rest.errors, shared by every HTTP
  surface), never here; this module only classifies.
- Lower layers translate their own failures into these classes at their boundary (`raise ... from exc`).
"""

from __future__ import annotations

from typing import Any


class SpaceError(Exception):
    """Base of every error SPACE reports on purpose."""

    code = "internal"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class InvalidArgument(SpaceError):
    """The request itself is wrong: a malformed id, a path outside the sandbox, a bad limit."""

    code = "invalid_argument"


class RequestInvalid(InvalidArgument):
    """The request does not match its schema (body, query, path or header); `details` name each field."""

    code = "validation_error"


class NotFound(SpaceError):
    code = "not_found"


class AlreadyExists(SpaceError):
    code = "already_exists"


class InvalidState(SpaceError):
    """The lifecycle table does not allow this event in the current state."""

    code = "invalid_state"

    def __init__(self, message: str, *, state: str, event: str | None = None, **details: Any) -> None:
        super().__init__(message, state=state, event=event, **details)
        self.state = state
        self.event = event


class Conflict(SpaceError):
    """A concurrent change won (compare-and-swap lost); retrying may succeed."""

    code = "conflict"


class PermissionDenied(SpaceError):
    code = "permission_denied"


class Unauthenticated(SpaceError):
    code = "unauthenticated"


class TooLarge(SpaceError):
    code = "too_large"


class ResourceExhausted(SpaceError):
    """A quota or capacity limit was hit (disk full, no node with room, rate limit)."""

    code = "resource_exhausted"


class StorageExhausted(ResourceExhausted):
    """A disk bound was hit: a sandbox's storage budget, a node's free-space reserve, or a disk no node can
    hold (HTTP 507; `details` name the numbers: used/budget or free/reserve, in bytes)."""

    code = "storage_exhausted"


class Timeout(SpaceError):
    code = "timeout"


class Unavailable(SpaceError):
    """A dependency (node, helper, sandbox channel) cannot be reached right now; retrying may succeed."""

    code = "unavailable"


class GuestError(SpaceError):
    """An operation inside the sandbox failed; `guest_code` is the daemon's own code."""

    code = "guest_error"

    def __init__(self, message: str, *, guest_code: str, **details: Any) -> None:
        super().__init__(message, guest_code=guest_code, **details)
        self.guest_code = guest_code


class ChannelError(SpaceError):
    """The private channel to a sandbox broke or carried malformed frames."""

    code = "channel_error"


class RuntimeFailure(SpaceError):
    """The isolation runtime (runsc, qemu) or a privileged step failed."""

    code = "runtime_failure"


class RuntimeIncompatible(SpaceError):
    """A node's isolation runtime cannot restore this checkpoint (another gVisor platform, network mode,
    runtime version or template base: space.core.runtimes); `details.reason` says which."""

    code = "runtime_incompatible"


class NotSupported(SpaceError):
    """The sandbox's isolation cannot do this (yet), e.g. a disk snapshot of a microvm sandbox
    (space.core.isolation); `details` name the isolation and the operation. Retrying cannot help."""

    code = "not_supported"


class Internal(SpaceError):
    code = "internal"


class ArtifactCorrupt(SpaceError):
    """A stored artifact failed verification (checksum, size or authentication tag); it is never used."""

    code = "artifact_corrupt"


class KeyRevoked(SpaceError):
    """The tenant's key was revoked: everything wrapped by it is unreadable on purpose."""

    code = "key_revoked"


class KeyUnavailable(SpaceError):
    """The key service cannot be reached or refused for a transient reason; retrying may succeed."""

    code = "key_unavailable"


class IncompatibleProtocol(SpaceError):
    """A peer (a node registering, or the control plane answering it) speaks no protocol version this side
    speaks (space.protocol.node_protocol); the message names both ranges."""

    code = "incompatible_protocol"


def _all_subclasses(cls: type[SpaceError]) -> list[type[SpaceError]]:
    found: list[type[SpaceError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def error_from_dict(body: dict[str, Any]) -> SpaceError:
    """Rebuild a typed error from its wire form ({"code", "message", "details"}) at a process boundary."""
    code = str(body.get("code", "internal"))
    message = str(body.get("message", "unknown error"))
    raw_details = body.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    by_code = {sub.code: sub for sub in reversed(_all_subclasses(SpaceError))}
    cls = by_code.get(code, SpaceError)
    if cls is InvalidState:
        state = str(details.pop("state", "unknown"))
        event = details.pop("event", None)
        return InvalidState(message, state=state, event=event, **details)
    if cls is GuestError:
        guest_code = str(details.pop("guest_code", "internal"))
        return GuestError(message, guest_code=guest_code, **details)
    error = cls(message, **details)
    error.code = code
    return error
