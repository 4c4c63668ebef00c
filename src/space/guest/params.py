"""Typed access to a call's params: every wrong type or missing key is an `invalid_argument` GuestError.

JSON booleans are not accepted where integers are expected (bool is an int subclass in Python), and
integers are accepted where floats are expected.
"""

from __future__ import annotations

from typing import Any

from space.guest.channel import GuestError

REQUIRED: Any = object()


def _missing(key: str) -> GuestError:
    return GuestError("invalid_argument", f"missing parameter {key!r}")


def _wrong(key: str, expected: str, value: Any) -> GuestError:
    return GuestError("invalid_argument", f"parameter {key!r} must be {expected}, not {type(value).__name__}")


def get_str(params: dict[str, Any], key: str, default: Any = REQUIRED) -> Any:
    value = params.get(key)
    if value is None:
        if default is REQUIRED:
            raise _missing(key)
        return default
    if not isinstance(value, str):
        raise _wrong(key, "a string", value)
    return value


def get_int(params: dict[str, Any], key: str, default: Any = REQUIRED) -> Any:
    value = params.get(key)
    if value is None:
        if default is REQUIRED:
            raise _missing(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(key, "an integer", value)
    return value


def get_float(params: dict[str, Any], key: str, default: Any = REQUIRED) -> Any:
    value = params.get(key)
    if value is None:
        if default is REQUIRED:
            raise _missing(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(key, "a number", value)
    return float(value)


def get_bool(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(key, "a boolean", value)
    return value


def get_str_map(params: dict[str, Any], key: str) -> dict[str, str]:
    value = params.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _wrong(key, "an object of strings", value)
    return value
