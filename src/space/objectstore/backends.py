"""Which backend a store URL names: `open_store(url)` (the one place that knows every backend).

Invariants:
- `file:///abs/dir` opens a LocalDirectoryStore, `s3://bucket[/prefix]?endpoint=...&region=...` an S3Store;
  any other URL, or one that does not parse, is errors.InvalidArgument, with credentials redacted from the
  message (base.redact_url).
- The backends depend on `base` only; this module depends on them, never the other way round. boto3 is
  imported only when an S3 URL is opened (its import costs a local-only node a noticeable start-up time).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from space.core import errors
from space.objectstore.base import ObjectStore, redact_url
from space.objectstore.local import LocalDirectoryStore


def open_store(url: str) -> ObjectStore:
    """`file:///abs/dir` -> LocalDirectoryStore; `s3://bucket[/prefix]?endpoint=...&region=...` -> S3Store."""
    try:
        scheme = urlsplit(url).scheme  # also parses the netloc: "s3://[x" is a ValueError
    except ValueError as exc:
        raise errors.InvalidArgument(f"invalid object store url {redact_url(url)!r}: {exc}") from exc
    if scheme == "file":
        return LocalDirectoryStore.from_url(url)
    if scheme == "s3":
        from space.objectstore.s3 import S3Store  # boto3 loads on first use of S3 only

        return S3Store.from_url(url)
    raise errors.InvalidArgument(
        f"unsupported object store url {redact_url(url)!r} (use file:///dir or s3://bucket)"
    )
