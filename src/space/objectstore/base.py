"""The object-store interface: a flat namespace of "/"-separated keys holding immutable byte strings.

Invariants:
- Keys are validated before any I/O: segments of [A-Za-z0-9._-], separated by single "/", no leading "/",
  no "." or ".." segment, at most 1024 characters. A bad key is errors.InvalidArgument, never a path escape.
- `put` is atomic per object: a reader sees the old object, the new one, or (for a new key) nothing, never
  a partial write. Objects are written whole and never appended to.
- `get` of an absent key is errors.NotFound; `delete` of an absent key succeeds (idempotent).
- `list(prefix)` is plain string-prefix matching (S3 semantics) and returns keys sorted.
- The API is synchronous; async callers use `asyncio.to_thread`. Backend failures surface as typed errors
  from space.core.errors (`raise ... from exc`), never as library exceptions.
- A store URL may carry S3 credentials (access_key/secret_key); reprs and error messages show it only
  through `redact_url`.
- This module knows no backend: `backends.open_store(url)` picks one, and the backends import this module.
"""

from __future__ import annotations

import abc
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from space.core import errors

MAX_KEY_LENGTH = 1024
_SEGMENT = r"[A-Za-z0-9._-]+"
_KEY_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_PREFIX_RE = re.compile(rf"(?:{_SEGMENT}(?:/{_SEGMENT})*/?)?")


def _check_segments(value: str, what: str) -> None:
    for segment in value.split("/"):
        if segment in (".", ".."):
            raise errors.InvalidArgument(f"{what} {value!r} has a '{segment}' segment", key=value)


def validate_key(key: str) -> str:
    """Return `key` if it is a valid object key, else errors.InvalidArgument."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or not _KEY_RE.fullmatch(key):
        raise errors.InvalidArgument(
            f"invalid object key {key!r}: use '/'-separated segments of [A-Za-z0-9._-], no leading '/'",
            key=str(key),
        )
    _check_segments(key, "object key")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key, optionally ending in '/'."""
    if not isinstance(prefix, str) or len(prefix) > MAX_KEY_LENGTH or not _PREFIX_RE.fullmatch(prefix):
        raise errors.InvalidArgument(f"invalid object key prefix {prefix!r}", prefix=str(prefix))
    _check_segments(prefix.rstrip("/"), "object key prefix")
    return prefix


class ObjectStore(abc.ABC):
    """A place for artifacts: a local directory (default) or an S3 bucket."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing any previous object atomically."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; errors.NotFound if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys starting with `prefix`, sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent is fine."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with `prefix`; returns how many were removed."""
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing to release
        """Release connections; the store must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r})"


SECRET_URL_PARAMETERS = frozenset({"access_key", "secret_key"})


def redact_url(url: str) -> str:
    """`url` with the values of its credential parameters replaced by "***" (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparsable url)"
    if not parts.query:
        return url
    query = [(k, "***" if k in SECRET_URL_PARAMETERS else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(query=urlencode(query, safe=":/*")))
