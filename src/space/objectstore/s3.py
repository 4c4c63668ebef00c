"""An object store in an S3 bucket (AWS S3 or any S3-compatible service), through boto3.

Invariants:
- URL form: `s3://bucket[/prefix]?endpoint=http://host:port&region=us-east-1[&access_key=..&secret_key=..]`.
  Every key is stored as `<prefix>/<key>`; `list` strips the prefix again, so callers see the same keys
  as with the local store. Credentials come from the URL or from boto3's usual chain (AWS_ACCESS_KEY_ID...).
- A single PUT is atomic in S3 (readers see the old or the new object), which is all `put` needs; objects
  are bounded by the caller (artifact parts), so no multipart upload is involved.
- botocore errors never leak: missing key/bucket -> NotFound, access -> PermissionDenied, throttling,
  5xx and connection failures -> Unavailable (after botocore's own bounded retries). `exists` uses HEAD,
  whose 404 carries no body, so a missing bucket reads as "absent" there; every other call says NotFound.
- Retries are bounded and back off: botocore's standard mode retries every request (connection drops,
  5xx, throttling) up to MAX_ATTEMPTS times with jittered exponential back-off. What botocore cannot
  retry, because it happens after the call returned, is retried here with the same shape of back-off,
  up to MAX_ATTEMPTS times: a GET body that breaks off, times out or fails its checksum, and an object
  whose stored bytes are not the bytes sent or received (see the next point). After the last attempt a
  broken transfer is errors.Unavailable and bytes that never verify are errors.ArtifactCorrupt.
- Integrity end to end: PUT sends a CRC32 (botocore's flexible checksums; S3 refuses a body that does not
  match it), GET validates the stored checksum (ChecksumMode), and both compare the server's ETag with the
  MD5 of the bytes sent or received when the ETag is a plain MD5 (single-part objects without SSE-KMS or
  SSE-C: the documented case). So a flipped bit on the way in or out is detected and retried, also with a
  server that does not check checksums, and `get` returns exactly the stored bytes or raises.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.parsers import ResponseParserError

from space.core import errors
from space.objectstore.base import ObjectStore, redact_url, validate_key, validate_prefix

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
MAX_ATTEMPTS = 5  # per request (botocore) and per transfer (body and integrity failures, here)
BACKOFF_BASE_S = 0.05  # botocore's base for non-throttling retries; doubles per attempt, with full jitter
BACKOFF_MAX_S = 2.0
_PLAIN_MD5_ETAG = re.compile(r'"?([0-9a-f]{32})"?')
T = TypeVar("T")


class IntegrityMismatch(Exception):
    """The server's digest of an object differs from the bytes sent or received (retried, then typed)."""


class BrokenBody(Exception):
    """An object's body broke off or timed out after botocore returned (retried, then Unavailable)."""


# What botocore does not retry because it happens after its retry loop: a body that breaks off, times
# out, is incomplete (refuse_incomplete_answer), does not parse or fails its checksum. (Failures of the
# request itself, HTTPClientError, botocore already retried: retrying them again would multiply attempts.)
_RETRIED = (
    BrokenBody,
    IncompleteReadError,
    FlexibleChecksumError,
    ResponseParserError,
    IntegrityMismatch,
)
_FAILURES = (ClientError, BotoCoreError, ResponseParserError, IntegrityMismatch, BrokenBody)


_NEEDS_ETAG = frozenset({"PutObject", "GetObject", "HeadObject"})


def refuse_incomplete_answer(operation_model: Any, response_dict: dict[str, Any], **_: Any) -> None:
    """An answer no S3 server sends is a broken transfer (IncompleteReadError, retried): a body without
    Content-Length or chunked framing or of another length, or an object answer without an ETag. A
    connection closed inside the headers otherwise reads as a complete, empty answer ("HTTP/1.1 200 OK"
    and nothing else: an empty listing, an empty object, an object that exists)."""
    headers = response_dict.get("headers", {})
    status = int(response_dict.get("status_code", 0))
    if status == 200 and operation_model.name in _NEEDS_ETAG and "etag" not in headers:
        raise IncompleteReadError(actual_bytes=0, expected_bytes=-1)
    if operation_model.http.get("method") == "HEAD" or status == 204:
        return
    declared = headers.get("content-length")
    if declared is None and "chunked" not in headers.get("transfer-encoding", ""):
        raise IncompleteReadError(actual_bytes=0, expected_bytes=-1)
    body = response_dict.get("body")
    if declared is not None and isinstance(body, bytes) and len(body) != int(declared):
        raise IncompleteReadError(actual_bytes=len(body), expected_bytes=int(declared))


def backoff_delay(attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Full-jitter exponential back-off before retry `attempt` (1-based), as botocore's standard mode."""
    return rand() * min(BACKOFF_BASE_S * 2.0 ** (attempt - 1), BACKOFF_MAX_S)


def etag_confirms(response: Any, data: bytes) -> bool:
    """False only when the server's ETag is a plain MD5 (documented for single-part objects without
    SSE-KMS or SSE-C) and it is not the MD5 of `data`; True when it matches or says nothing checkable."""
    if response.get("ServerSideEncryption", "") not in ("", "AES256") or response.get("SSECustomerAlgorithm"):
        return True
    match = _PLAIN_MD5_ETAG.fullmatch(str(response.get("ETag", "")))
    if match is None:
        return True
    return match.group(1) == hashlib.md5(data, usedforsecurity=False).hexdigest()


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        url: str | None = None,
    ) -> None:
        if not bucket:
            raise errors.InvalidArgument("an s3 object store needs a bucket name")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.url = url or f"s3://{bucket}/{prefix}"
        session = boto3.session.Session(
            aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None,
            region_name=region,
        )
        config = Config(
            s3={"addressing_style": "path"},  # works with every S3-compatible server, also on loopback
            retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS},
            request_checksum_calculation="when_supported",  # a CRC32 with every PUT
            response_checksum_validation="when_supported",  # checked on every GET of such an object
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=16,
        )
        self._client: S3Client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._client.meta.events.register("before-parse.s3", refuse_incomplete_answer)

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise errors.InvalidArgument(
                f"invalid s3 url {redact_url(url)!r} (use s3://bucket/prefix?endpoint=...)"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=False).items()}
        unknown = set(query) - {"endpoint", "region", "access_key", "secret_key"}
        if unknown:
            raise errors.InvalidArgument(f"unknown s3 url parameters: {sorted(unknown)}")
        return cls(
            parts.netloc,
            parts.path,
            endpoint_url=query.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or None,
            region=query.get("region") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            access_key=query.get("access_key"),
            secret_key=query.get("secret_key"),
            url=url,
        )

    def _full(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _retrying(self, call: Callable[[], T]) -> T:
        """`call()`, retried on what botocore does not retry (see the module docs); the last failure is
        re-raised for the caller to translate."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return call()
            except _RETRIED:
                if attempt == MAX_ATTEMPTS:
                    raise
                time.sleep(backoff_delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        try:
            self._retrying(lambda: self._put_once(full, data))
        except _FAILURES as exc:
            raise translate(exc, key) from exc

    def _put_once(self, full: str, data: bytes) -> None:
        response = self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        if not etag_confirms(response, data):
            raise IntegrityMismatch(f"the server stored other bytes than were sent to {full!r}")

    def get(self, key: str) -> bytes:
        full = self._full(key)
        try:
            return self._retrying(lambda: self._get_once(full))
        except _FAILURES as exc:
            raise translate(exc, key) from exc

    def _get_once(self, full: str) -> bytes:
        response = self._client.get_object(Bucket=self.bucket, Key=full)
        body = response["Body"]
        try:
            data = body.read()  # botocore checks Content-Length and, for checksummed objects, the CRC
        except (HTTPClientError, IncompleteReadError) as exc:
            raise BrokenBody(f"the body of {full!r} broke off: {type(exc).__name__}") from exc
        finally:
            body.close()
        if not etag_confirms(response, data):
            raise IntegrityMismatch(f"the bytes received for {full!r} are not the object's")
        return data

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self._retrying(lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except _FAILURES as exc:
            if _object_absent(exc, key):
                return False
            raise translate(exc, key) from exc
        return True

    def _list_page(self, prefix: str, token: str | None) -> Any:
        if token:
            return self._client.list_objects_v2(
                Bucket=self.bucket, Prefix=self.prefix + prefix, ContinuationToken=token
            )
        return self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix)

    def _iter_keys(self, prefix: str) -> Iterator[str]:
        token: str | None = None
        while True:  # page by page, each page retried on its own (a paginator cannot retry one page)
            page = self._retrying(functools.partial(self._list_page, prefix, token))
            for item in page.get("Contents", []):
                yield item["Key"][len(self.prefix) :]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        try:
            return sorted(self._iter_keys(prefix))
        except _FAILURES as exc:
            raise translate(exc, prefix) from exc

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._retrying(lambda: self._client.delete_object(Bucket=self.bucket, Key=full))
        except _FAILURES as exc:
            if _object_absent(exc, key):
                return
            raise translate(exc, key) from exc

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            objects: list[Any] = [{"Key": self.prefix + k} for k in batch]
            try:
                response = self._retrying(
                    functools.partial(
                        self._client.delete_objects,
                        Bucket=self.bucket,
                        Delete={"Objects": objects, "Quiet": True},
                    )
                )
            except _FAILURES as exc:
                raise translate(exc, prefix) from exc
            failed = response.get("Errors", [])
            if failed:
                raise errors.Unavailable(
                    f"s3 refused to delete {len(failed)} objects under {prefix!r}",
                    first=str(failed[0].get("Key", "")),
                    code=str(failed[0].get("Code", "")),
                )
        return len(keys)

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for `space up` with a fresh S3 server and for tests)."""
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _error_code(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise translate(exc, self.bucket) from exc
        except BotoCoreError as exc:
            raise translate(exc, self.bucket) from exc

    def close(self) -> None:
        self._client.close()


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _object_absent(exc: BaseException, key: str) -> bool:
    """A 404 that does not name a missing bucket: the object is absent (HEAD's bodiless 404 never names the
    bucket, see the module docs)."""
    return isinstance(translate(exc, key), errors.NotFound) and _error_code(exc) != "NoSuchBucket"


def _status(exc: ClientError) -> int:
    meta: dict[str, Any] = dict(exc.response.get("ResponseMetadata", {}))
    return int(meta.get("HTTPStatusCode", 0) or 0)


def translate(exc: BaseException, key: str) -> errors.SpaceError:
    """One botocore failure -> one typed SPACE error (the caller raises it `from exc`): bytes that never
    verified are ArtifactCorrupt, a transfer that never completed is Unavailable."""
    if isinstance(exc, IntegrityMismatch | FlexibleChecksumError):
        return errors.ArtifactCorrupt(
            f"s3 object {key!r} was never stored or read intact ({MAX_ATTEMPTS} attempts)",
            part=key,
            reason="checksum_mismatch",
        )
    if isinstance(exc, ClientError):
        return _translate_client_error(exc, key)
    return errors.Unavailable(f"s3 unreachable for {key!r}: {type(exc).__name__}", key=key)


def _translate_client_error(exc: ClientError, key: str) -> errors.SpaceError:
    code = _error_code(exc)
    status = _status(exc)
    if code in _NOT_FOUND or status == 404:
        what = "bucket" if code == "NoSuchBucket" else "object"
        return errors.NotFound(f"s3 {what} not found for {key!r}", key=key, s3_code=code)
    if code in _DENIED or status == 403:
        return errors.PermissionDenied(f"s3 refused access to {key!r} ({code})", key=key, s3_code=code)
    if code in ("EntityTooLarge",):
        return errors.TooLarge(f"s3 object {key!r} too large", key=key)
    if code in ("InvalidBucketName", "InvalidArgument", "KeyTooLongError"):
        return errors.InvalidArgument(f"s3 rejected {key!r} ({code})", key=key, s3_code=code)
    return errors.Unavailable(f"s3 error on {key!r}: {code or status}", key=key, s3_code=code)
