"""Checks of the values callers hand to the store, shared by every repository.

Invariants:
- A value that breaks the rules of a field is the caller's error: `InvalidArgument` naming the field;
  a field that may not be set at all through a method is a programming error: `TypeError`.
- Times handed to the store are aware and stored in UTC; durations are non-negative seconds (NaN too is
  refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from space.core.errors import InvalidArgument


def text(value: object, field: str, max_length: int) -> str:
    """`value` if it is a string of 1 to `max_length` characters; else InvalidArgument naming `field`."""
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise InvalidArgument(f"invalid {field}: expected 1 to {max_length} characters", field=field)
    return value


def aware(value: datetime, field: str) -> datetime:
    """`value` in UTC; InvalidArgument if it is naive."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{field} must be a timezone-aware datetime", field=field)
    return value.astimezone(UTC)


def seconds(value: float, field: str) -> timedelta:
    """A non-negative number of seconds as a timedelta."""
    if not value >= 0:  # also rejects NaN
        raise InvalidArgument(f"{field} must be a non-negative number of seconds", field=field)
    return timedelta(seconds=value)


def settable(fields: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    """A copy of `fields`; TypeError if it names a column that is not among `allowed`."""
    unknown = set(fields) - allowed
    if unknown:
        # A programming error in the caller, not a user error.
        raise TypeError(f"fields not settable here: {sorted(unknown)}")
    return dict(fields)


def rowcount(result: Any) -> int:
    """The number of rows an UPDATE or DELETE matched."""
    # CursorResult.rowcount; Session.execute is typed as returning Result, which lacks it.
    return int(result.rowcount)
