"""A sandbox's metadata, its list filters and its deadline: the rules, in one place (pure: no I/O).

Invariants (docs/adr/0048-metadata-lists-and-deadlines.md):
- Metadata is a flat map of strings: at most MAX_METADATA_KEYS keys, each a fullmatch of
  METADATA_KEY_PATTERN (1 to 128 characters of letters, digits and `_ . - : /`: never a quote, a
  backslash, `$`, `[`, `*` or whitespace, so a key can be neither SQL nor a JSON path of its own), each
  value a string of at most MAX_METADATA_VALUE characters, and the whole (keys and values, in UTF-8) at
  most MAX_METADATA_BYTES. Anything else is InvalidArgument naming the field `metadata`.
- A metadata filter is `key=value`, split at the FIRST `=` (so a value may hold `=`); its key obeys the
  same pattern, its value the same bound; no filter matches a sandbox that lacks the key.
- A deadline is whole seconds from now, 0 (now) to MAX_TIMEOUT_S; `on_timeout` is one of ON_TIMEOUT.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final, Literal, get_args

from space.core.errors import InvalidArgument

MAX_METADATA_KEYS: Final = 64
MAX_METADATA_KEY: Final = 128
MAX_METADATA_VALUE: Final = 1024
MAX_METADATA_BYTES: Final = 16 * 1024
METADATA_KEY_PATTERN: Final = r"[A-Za-z0-9_.:/-]{1,128}"
#: The longest deadline a sandbox may be given (create's ttl_s, or a timeout): 365 days.
MAX_TIMEOUT_S: Final = 365 * 24 * 3600
OnTimeout = Literal["delete", "pause"]
ON_TIMEOUT: Final[tuple[str, ...]] = get_args(OnTimeout)

_KEY = re.compile(METADATA_KEY_PATTERN)


def metadata_key(key: object, field: str = "metadata") -> str:
    """`key` if it is a valid metadata key; else InvalidArgument naming `field`."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        shown = repr(key)[:64]
        raise InvalidArgument(
            f"invalid {field} key {shown}: 1 to {MAX_METADATA_KEY} characters of letters, digits "
            "and _ . - : /",
            field=field,
        )
    return key


def metadata_value(value: object, field: str = "metadata") -> str:
    if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
        raise InvalidArgument(
            f"invalid {field} value: a string of at most {MAX_METADATA_VALUE} characters", field=field
        )
    return value


def check_metadata(metadata: object) -> dict[str, str]:
    """A copy of `metadata` if it obeys the module's bounds; else InvalidArgument naming `metadata`."""
    if not isinstance(metadata, Mapping):
        raise InvalidArgument("metadata must map strings to strings", field="metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidArgument(f"metadata has more than {MAX_METADATA_KEYS} keys", field="metadata")
    checked = {metadata_key(k): metadata_value(v) for k, v in metadata.items()}
    size = sum(len(k.encode()) + len(v.encode()) for k, v in checked.items())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(
            f"metadata is {size} bytes; at most {MAX_METADATA_BYTES} are allowed", field="metadata"
        )
    return checked


def parse_metadata_filter(pair: str) -> tuple[str, str]:
    """(key, value) of one `key=value` list filter (split at the first `=`)."""
    key, sep, value = pair.partition("=")
    if not sep:
        raise InvalidArgument(f"a metadata filter is key=value, not {pair[:64]!r}", field="metadata")
    return metadata_key(key), metadata_value(value)


def metadata_filters(pairs: Iterable[str]) -> dict[str, str]:
    """The filters of repeated `key=value` parameters; InvalidArgument if two give one key different values
    (no sandbox could match both) or there are more than MAX_METADATA_KEYS."""
    filters: dict[str, str] = {}
    for pair in pairs:
        key, value = parse_metadata_filter(pair)
        if filters.get(key, value) != value:
            raise InvalidArgument(
                f"metadata filter {key!r} is given twice with different values", field="metadata"
            )
        filters[key] = value
        if len(filters) > MAX_METADATA_KEYS:
            raise InvalidArgument(f"more than {MAX_METADATA_KEYS} metadata filters", field="metadata")
    return filters


def timeout_seconds(value: object, field: str = "timeout_s", *, allow_zero: bool = True) -> int:
    """`value` as a deadline in whole seconds from now (0 means now, unless not `allow_zero`)."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"{field} must be an integer from {low} to {MAX_TIMEOUT_S}", field=field)
    return value


def parse_on_timeout(value: object) -> OnTimeout:
    if value == "delete":
        return "delete"
    if value == "pause":
        return "pause"
    raise InvalidArgument(f"on_timeout must be one of {', '.join(ON_TIMEOUT)}", field="on_timeout")
