"""The life of a user template in the control plane as data: ONE transition table (status, event) -> status.

docs/adr/0055-templates-in-the-control-plane.md. Like the sandbox lifecycle (space.core.lifecycle), nobody
else decides whether an event is allowed; a refused event is InvalidState (409) naming the current status.

    building --built--> ready          the node committed the template
    building --fail---> failed         a step failed, the node or the driving control plane went away
    building | ready | failed --delete--> deleting
    deleting --deleted--> (row removed: names are free again, ids are random and never come back)

Invariants (checked when this module is imported):
- `building` and `deleting` are the in-progress statuses: written by compare-and-swap BEFORE their side
  effect starts, so after any crash the row says what may be half done. `building` has exactly one
  completion (`built`) and a `fail` edge to a stable status; `deleting` ends only with the row's removal.
- Every status but `deleting` allows `delete`; `deleting` allows `delete` again as a no-op (a retry).
- Only `ready` templates make sandboxes (USABLE); a create naming any other is a 409 naming its status.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from space.core.errors import InvalidArgument, InvalidState


class TemplateStatus(StrEnum):
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"
    DELETING = "deleting"


class TemplateEvent(StrEnum):
    BUILT = "built"
    FAIL = "fail"
    DELETE = "delete"
    DELETED = "deleted"  # the node copies are gone: the row is removed


S = TemplateStatus
E = TemplateEvent

#: None as a target: the row is removed.
TRANSITIONS: Final[dict[tuple[TemplateStatus, TemplateEvent], TemplateStatus | None]] = {
    (S.BUILDING, E.BUILT): S.READY,
    (S.BUILDING, E.FAIL): S.FAILED,
    (S.BUILDING, E.DELETE): S.DELETING,
    (S.READY, E.DELETE): S.DELETING,
    (S.FAILED, E.DELETE): S.DELETING,
    (S.DELETING, E.DELETE): S.DELETING,
    (S.DELETING, E.DELETED): None,
}

IN_PROGRESS: Final = frozenset({S.BUILDING, S.DELETING})
USABLE: Final = frozenset({S.READY})
STATUS_VALUES: Final = tuple(s.value for s in TemplateStatus)


def _check_table() -> None:
    for status in TemplateStatus:
        if (status, E.DELETE) not in TRANSITIONS:
            raise RuntimeError(f"template table: {status} must allow delete")
    if TRANSITIONS[(S.BUILDING, E.FAIL)] in IN_PROGRESS or TRANSITIONS[(S.BUILDING, E.BUILT)] in IN_PROGRESS:
        raise RuntimeError("template table: building must settle in a stable status")


_check_table()


def parse_status(value: object) -> TemplateStatus:
    if isinstance(value, str) and value in STATUS_VALUES:
        return TemplateStatus(value)
    raise InvalidArgument(f"unknown template status {value!r}", field="status")


def transition(status: TemplateStatus | str, event: TemplateEvent) -> TemplateStatus | None:
    """The status after `event` (None: the row goes), or InvalidState naming the current status."""
    current = parse_status(status)
    if (current, event) not in TRANSITIONS:
        raise InvalidState(
            f"event '{event}' does not apply to a template in status '{current}'",
            state=current.value,
            event=event.value,
        )
    return TRANSITIONS[(current, event)]


def require_usable(status: TemplateStatus | str, name: str) -> None:
    """InvalidState (409 naming the status) unless a sandbox can be made from the template now."""
    current = parse_status(status)
    if current not in USABLE:
        raise InvalidState(
            f"template {name!r} is {current.value}: only a ready template makes sandboxes",
            state=current.value,
            event="create",
        )
