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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from space.core import errors
from space.objectstore.base import ObjectStore, redact_url, validate_key, validate_prefix

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}


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
            retries={"mode": "standard", "max_attempts": 4},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=16,
        )
        self._client: S3Client = session.client("s3", endpoint_url=endpoint_url, config=config)

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

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, key) from exc

    def get(self, key: str) -> bytes:
        full = self._full(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
            body = response["Body"]
            try:
                return body.read()
            finally:
                body.close()
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, key) from exc

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=full)
        except (ClientError, BotoCoreError) as exc:
            if _object_absent(exc, key):
                return False
            raise translate(exc, key) from exc
        return True

    def _iter_keys(self, prefix: str) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            for item in page.get("Contents", []):
                yield item["Key"][len(self.prefix) :]

    def list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        try:
            return sorted(self._iter_keys(prefix))
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, prefix) from exc

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except (ClientError, BotoCoreError) as exc:
            if _object_absent(exc, key):
                return
            raise translate(exc, key) from exc

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            try:
                response = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self.prefix + k} for k in batch], "Quiet": True},
                )
            except (ClientError, BotoCoreError) as exc:
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


def _object_absent(exc: ClientError | BotoCoreError, key: str) -> bool:
    """A 404 that does not name a missing bucket: the object is absent (HEAD's bodiless 404 never names the
    bucket, see the module docs)."""
    return isinstance(translate(exc, key), errors.NotFound) and _error_code(exc) != "NoSuchBucket"


def _status(exc: ClientError) -> int:
    meta: dict[str, Any] = dict(exc.response.get("ResponseMetadata", {}))
    return int(meta.get("HTTPStatusCode", 0) or 0)


def translate(exc: ClientError | BotoCoreError, key: str) -> errors.SpaceError:
    """One botocore failure -> one typed SPACE error (the caller raises it `from exc`)."""
    if isinstance(exc, ClientError):
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
    return errors.Unavailable(f"s3 unreachable for {key!r}: {type(exc).__name__}", key=key)
