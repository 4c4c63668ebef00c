"""Key services: tenant keys that wrap per-artifact data keys (envelope encryption, BYOK).

Invariants (see docs/adr/0011-envelope-encryption-and-key-services.md):
- A tenant key never leaves its key service; callers get fresh 32-byte data keys plus their wrapped form,
  and store only the wrapped form. Unwrapping is a call to the key service, so the service decides.
- Rotation adds a new key version used for new wraps; wrapped keys made under older versions still open.
- Revocation is final for SPACE: afterwards nothing wrapped by the key opens (errors.KeyRevoked), and no
  new data keys are issued. The local service destroys the key material; KMS disables the key.
- Errors are typed: unknown key -> NotFound, revoked/disabled -> KeyRevoked, service unreachable or
  throttling -> KeyUnavailable, a wrapped blob that fails authentication -> ArtifactCorrupt.

LocalKeyService layout (directory 0700, files 0600, all writes atomic via temp file + rename):
    <dir>/<key_id>/meta.json     {"description", "created_at", "current_version", "revoked_at"}
    <dir>/<key_id>/v<N>.key      32 random bytes, one file per version
Wrapped blob: b"SPK1" || version (4 bytes, big endian) || seal(kek_vN, data_key, aad=key_id|version).
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from space.core import errors
from space.crypto.envelope import KEY_BYTES, DataKey, open_sealed, seal

if TYPE_CHECKING:
    from mypy_boto3_kms.client import KMSClient

__all__ = ["DataKey", "KeyService", "KmsKeyService", "LocalKeyService", "open_key_service"]

_WRAP_MAGIC = b"SPK1"
_LOCAL_KEY_ID = re.compile(r"lk-[0-9a-f]{32}")


class KeyService(abc.ABC):
    """Where tenant keys live. Implementations are synchronous and thread-safe for separate calls."""

    @abc.abstractmethod
    def create_key(self, description: str = "") -> str:
        """Create a tenant key; returns its id."""

    @abc.abstractmethod
    def generate_data_key(self, key_id: str) -> DataKey:
        """A fresh 32-byte data key and its form wrapped by `key_id`'s current version."""

    @abc.abstractmethod
    def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        """Unwrap; errors.KeyRevoked when the key was revoked, errors.NotFound when unknown."""

    @abc.abstractmethod
    def rotate_key(self, key_id: str) -> None:
        """New key material for new wraps; data keys wrapped earlier still open."""

    @abc.abstractmethod
    def revoke_key(self, key_id: str) -> None:
        """Make every data key wrapped by `key_id` unreadable, for good. Idempotent."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class LocalKeyService(KeyService):
    """Tenant keys as files in a local directory: the embedded default (one machine, one operator)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_absolute():
            raise errors.InvalidArgument(f"key directory must be absolute: {directory}")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)
        except OSError as exc:
            raise errors.KeyUnavailable(f"cannot use key directory {directory}: {exc.strerror}") from exc

    # -- layout helpers ---------------------------------------------------------------------------------
    def _key_dir(self, key_id: str) -> Path:
        if not isinstance(key_id, str) or not _LOCAL_KEY_ID.fullmatch(key_id):
            raise errors.NotFound(f"no key {key_id!r} in the local key service", key_id=str(key_id))
        return self.directory / key_id

    def _meta(self, key_id: str) -> dict[str, Any]:
        path = self._key_dir(key_id) / "meta.json"
        try:
            meta: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise errors.NotFound(f"no key {key_id!r} in the local key service", key_id=key_id) from exc
        except (OSError, ValueError) as exc:
            raise errors.KeyUnavailable(f"key {key_id!r} metadata unreadable: {exc}", key_id=key_id) from exc
        return meta

    @contextlib.contextmanager
    def _locked(self, key_id: str) -> Iterator[Path]:
        key_dir = self._key_dir(key_id)
        if not key_dir.is_dir():
            raise errors.NotFound(f"no key {key_id!r} in the local key service", key_id=key_id)
        with open(key_dir / ".lock", "a+b") as lock:  # serializes rotate/revoke across processes
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield key_dir
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _check_not_revoked(self, key_id: str, meta: dict[str, Any]) -> None:
        if meta.get("revoked_at"):
            raise errors.KeyRevoked(
                f"key {key_id!r} was revoked at {meta['revoked_at']}; data wrapped by it cannot be opened",
                key_id=key_id,
            )

    def _material(self, key_id: str, version: int) -> bytes:
        path = self._key_dir(key_id) / f"v{version}.key"
        try:
            material = path.read_bytes()
        except FileNotFoundError as exc:
            meta = self._meta(key_id)
            self._check_not_revoked(key_id, meta)
            raise errors.NotFound(f"key {key_id!r} has no version {version}", key_id=key_id) from exc
        if len(material) != KEY_BYTES:
            raise errors.KeyUnavailable(f"key {key_id!r} version {version} is damaged", key_id=key_id)
        return material

    # -- KeyService ---------------------------------------------------------------------------------------
    def create_key(self, description: str = "") -> str:
        key_id = "lk-" + secrets.token_hex(16)
        key_dir = self.directory / key_id
        try:
            key_dir.mkdir(mode=0o700)
            write_private_file(key_dir / "v1.key", secrets.token_bytes(KEY_BYTES))
            # meta.json last: a key without it does not exist (a crash leaves an ignorable directory).
            meta = {
                "description": description,
                "created_at": _now(),
                "current_version": 1,
                "revoked_at": None,
            }
            write_private_file(key_dir / "meta.json", json.dumps(meta).encode())
        except OSError as exc:
            raise errors.KeyUnavailable(f"cannot create a key in {self.directory}: {exc.strerror}") from exc
        return key_id

    def generate_data_key(self, key_id: str) -> DataKey:
        meta = self._meta(key_id)
        self._check_not_revoked(key_id, meta)
        version = int(meta["current_version"])
        kek = self._material(key_id, version)
        plaintext = secrets.token_bytes(KEY_BYTES)
        wrapped = _WRAP_MAGIC + version.to_bytes(4, "big") + seal(kek, plaintext, _wrap_aad(key_id, version))
        return DataKey(key_id=key_id, wrapped=wrapped, plaintext=plaintext)

    def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        meta = self._meta(key_id)
        self._check_not_revoked(key_id, meta)
        if len(wrapped) < 8 or wrapped[:4] != _WRAP_MAGIC:
            raise errors.ArtifactCorrupt(
                f"not a wrapped data key of key {key_id!r}", reason="bad_wrapped_key"
            )
        version = int.from_bytes(wrapped[4:8], "big")
        kek = self._material(key_id, version)
        try:
            return open_sealed(kek, wrapped[8:], _wrap_aad(key_id, version))
        except errors.ArtifactCorrupt as exc:
            raise errors.ArtifactCorrupt(
                f"wrapped data key does not open under key {key_id!r} version {version}",
                key_id=key_id,
                reason="wrapped_key_authentication_failed",
            ) from exc

    def rotate_key(self, key_id: str) -> None:
        with self._locked(key_id) as key_dir:
            meta = self._meta(key_id)
            self._check_not_revoked(key_id, meta)
            version = int(meta["current_version"]) + 1
            try:
                write_private_file(key_dir / f"v{version}.key", secrets.token_bytes(KEY_BYTES))
                meta["current_version"] = version
                meta["rotated_at"] = _now()
                write_private_file(key_dir / "meta.json", json.dumps(meta).encode())
            except OSError as exc:
                raise errors.KeyUnavailable(f"cannot rotate key {key_id!r}: {exc.strerror}") from exc

    def revoke_key(self, key_id: str) -> None:
        with self._locked(key_id) as key_dir:
            meta = self._meta(key_id)
            try:
                if not meta.get("revoked_at"):
                    # Mark first: from here on every unwrap refuses, even if destruction is interrupted.
                    meta["revoked_at"] = _now()
                    write_private_file(key_dir / "meta.json", json.dumps(meta).encode())
                for material in key_dir.glob("v*.key"):
                    _destroy(material)
            except OSError as exc:
                raise errors.KeyUnavailable(f"cannot revoke key {key_id!r}: {exc.strerror}") from exc


def _wrap_aad(key_id: str, version: int) -> bytes:
    return f"space-data-key-v1|{key_id}|{version}".encode()


def _now() -> str:
    return datetime.now(UTC).isoformat()


def write_private_file(path: Path, data: bytes) -> None:
    """Atomic 0600 write: temp file in the same directory, fsync, rename, fsync the directory. After it
    returns the file survives a crash; a failure removes the temporary file. (Also used for the credential
    vault's sealed values, which have the same needs.)"""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _destroy(path: Path) -> None:
    # Overwrite before unlinking: on a plain (non-CoW) filesystem this removes the bytes, not only the name.
    # On btrfs/SSDs old blocks may survive; the ADR says so (real crypto-shredding needs an HSM/KMS).
    with contextlib.suppress(FileNotFoundError):
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.write(secrets.token_bytes(size))
            handle.flush()
            os.fsync(handle.fileno())
        path.unlink()


# --- AWS KMS ------------------------------------------------------------------------------------------

_KMS_REVOKED = {"DisabledException", "KMSInvalidStateException", "KeyUnavailableException"}
_KMS_NOT_FOUND = {"NotFoundException"}
_KMS_CORRUPT = {"InvalidCiphertextException", "IncorrectKeyException"}
_KMS_DENIED = {"AccessDeniedException", "UnrecognizedClientException", "InvalidSignatureException"}


class KmsKeyService(KeyService):
    """Tenant keys in AWS KMS or a KMS-compatible service (symmetric keys, GenerateDataKey/Decrypt).

    Revoke disables the key (the tenant can re-enable it in their KMS; SPACE never deletes a tenant's key).
    Before each GenerateDataKey/Decrypt the key state is read (DescribeKey), so a disabled or
    pending-deletion key is reported as KeyRevoked even by KMS implementations that do not enforce key
    state on Decrypt themselves (moto); real KMS refuses too (DisabledException -> KeyRevoked).
    """

    def __init__(self, endpoint_url: str | None, region: str = "us-east-1") -> None:
        import boto3
        from botocore.config import Config

        self.endpoint_url = endpoint_url
        self.region = region
        config = Config(retries={"mode": "standard", "max_attempts": 4}, connect_timeout=5, read_timeout=30)
        self._client: KMSClient = boto3.session.Session(region_name=region).client(
            "kms", endpoint_url=endpoint_url or None, config=config
        )

    def _call(self, key_id: str, operation: str, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            result: dict[str, Any] = getattr(self._client, operation)(**kwargs)
        except ClientError as exc:
            raise _translate_kms(exc, key_id, operation) from exc
        except BotoCoreError as exc:
            raise errors.KeyUnavailable(
                f"key service unreachable ({operation}): {type(exc).__name__}", key_id=key_id
            ) from exc
        return result

    def _require_enabled(self, key_id: str) -> None:
        metadata = self._call(key_id, "describe_key", KeyId=key_id)["KeyMetadata"]
        state = str(metadata.get("KeyState", "Enabled"))
        if state != "Enabled" or not metadata.get("Enabled", True):
            raise errors.KeyRevoked(
                f"key {key_id!r} is {state}; data wrapped by it cannot be opened", key_id=key_id, state=state
            )

    def create_key(self, description: str = "") -> str:
        result = self._call(
            "",
            "create_key",
            Description=description,
            KeyUsage="ENCRYPT_DECRYPT",
            KeySpec="SYMMETRIC_DEFAULT",
        )
        return str(result["KeyMetadata"]["KeyId"])

    def generate_data_key(self, key_id: str) -> DataKey:
        self._require_enabled(key_id)
        result = self._call(key_id, "generate_data_key", KeyId=key_id, KeySpec="AES_256")
        return DataKey(
            key_id=key_id, wrapped=bytes(result["CiphertextBlob"]), plaintext=bytes(result["Plaintext"])
        )

    def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        self._require_enabled(key_id)
        result = self._call(key_id, "decrypt", KeyId=key_id, CiphertextBlob=wrapped)
        plaintext = bytes(result["Plaintext"])
        if len(plaintext) != KEY_BYTES:
            raise errors.ArtifactCorrupt(
                f"key service returned a {len(plaintext)}-byte data key", key_id=key_id
            )
        return plaintext

    def rotate_key(self, key_id: str) -> None:
        self._require_enabled(key_id)
        # Automatic yearly rotation on, and one rotation now. KMS keeps every backing key, so ciphertexts
        # made before the rotation still decrypt.
        self._call(key_id, "enable_key_rotation", KeyId=key_id)
        self._call(key_id, "rotate_key_on_demand", KeyId=key_id)

    def revoke_key(self, key_id: str) -> None:
        self._call(key_id, "disable_key", KeyId=key_id)

    def close(self) -> None:
        self._client.close()


def _translate_kms(exc: Any, key_id: str, operation: str) -> errors.SpaceError:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    message = str(exc.response.get("Error", {}).get("Message", ""))
    if code in _KMS_NOT_FOUND:
        return errors.NotFound(f"no key {key_id!r} in the key service", key_id=key_id)
    if code in _KMS_REVOKED:
        return errors.KeyRevoked(
            f"key {key_id!r} is disabled or revoked ({code})", key_id=key_id, kms_code=code
        )
    if code in _KMS_CORRUPT:
        return errors.ArtifactCorrupt(
            f"wrapped data key rejected by the key service ({code})", key_id=key_id, reason=code
        )
    if code in _KMS_DENIED:
        return errors.PermissionDenied(
            f"key service refused {operation} on {key_id!r} ({code})", key_id=key_id
        )
    if code == "ValidationException":
        return errors.InvalidArgument(f"key service rejected {operation}: {message}", key_id=key_id)
    return errors.KeyUnavailable(
        f"key service failed {operation} ({code or 'error'})", key_id=key_id, kms_code=code
    )


def open_key_service(url: str) -> KeyService:
    """`local:///abs/dir` -> LocalKeyService; `kms://?endpoint=http://127.0.0.1:PORT&region=...` -> KMS."""
    parts = urlsplit(url)
    if parts.scheme == "local":
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise errors.InvalidArgument(f"invalid local key service url {url!r} (use local:///abs/dir)")
        return LocalKeyService(Path(path))
    if parts.scheme == "kms":
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise errors.InvalidArgument(f"unknown kms url parameters: {sorted(unknown)}")
        return KmsKeyService(query.get("endpoint"), region=query.get("region") or "us-east-1")
    raise errors.InvalidArgument(
        f"unsupported key service url {url!r} (use local:///dir or kms://?endpoint=)"
    )
