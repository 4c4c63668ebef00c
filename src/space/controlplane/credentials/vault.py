"""Vault backends: where the *values* of credentials live. Metadata lives in the SQL store; values only here.

How to add a backend (HashiCorp Vault, a cloud secret manager, ...): subclass `VaultBackend` and implement
`put`, `get` and `delete`:

- `put(hint, value) -> reference` stores a secret and returns an opaque reference (at most 512 characters,
  printable ASCII) that `get`/`delete` accept later. The control plane records only the reference and the
  backend's `name` in the credential's row; it never interprets the reference. `hint` is a stable,
  non-secret name of the credential (e.g. `cred-...`), for backends that want readable paths; a backend
  must return a NEW reference for each `put` (a rotation writes the new value first, switches the row to
  it, and only then deletes the old one, so a crash in between leaves at worst an unreferenced value).
- `get(reference) -> bytes` returns the value, or raises `errors.NotFound` if the reference is unknown
  (deleted) and `errors.Unavailable` if the backend cannot be reached right now.
- `delete(reference)` is idempotent: deleting an unknown reference is not an error.
- Backends are called from worker threads (the API runs them with asyncio.to_thread): they must be safe to
  call concurrently. They must never log values.

Invariants of EncryptedLocalVault (the default backend):
- Every value is sealed with AES-256-GCM under a 32-byte master key, with a fresh random 96-bit nonce and
  the reference as associated data, so a sealed value moved to another reference does not open. Only the
  sealed bytes reach the blob storage (the SQL table `vault_secrets`, or files in a directory): the
  database never holds a plaintext value.
- The master key is a file of the control plane's data directory with mode 0600, created once, complete
  (temporary file + hard link: two starters race safely, the loser reads the winner's key). Control-plane
  replicas that share a database must share this file (same contents); losing it makes every stored value
  unreadable.
- A value that fails authentication (tampered, wrong key) is `errors.Internal`, never silently returned.
"""

from __future__ import annotations

import abc
import contextlib
import os
import pathlib
import re
import secrets
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from space.core import errors
from space.crypto.keys import write_private_file

MASTER_KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
MAX_VALUE_BYTES: Final = 64 << 10  # a credential, not a file
SEALED_VERSION: Final = b"\x01"
REFERENCE_PATTERN: Final = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class VaultBackend(abc.ABC):
    """Stores secret values by opaque reference; see the module docstring for the contract."""

    #: Recorded with every reference, so a control plane can tell which backend holds a value.
    name: str = "abstract"

    @abc.abstractmethod
    def put(self, hint: str, value: bytes) -> str:
        """Store `value`; return a new opaque reference to it."""

    @abc.abstractmethod
    def get(self, reference: str) -> bytes:
        """The value stored under `reference` (NotFound if there is none)."""

    @abc.abstractmethod
    def delete(self, reference: str) -> None:
        """Forget the value under `reference` (idempotent)."""


class SealedBlobs(Protocol):
    """Where EncryptedLocalVault keeps sealed (encrypted) values: the SQL store or a directory."""

    def put_blob(self, reference: str, sealed: bytes) -> None: ...
    def get_blob(self, reference: str) -> bytes | None: ...
    def delete_blob(self, reference: str) -> None: ...


class DirectoryBlobs:
    """Sealed values as files `<directory>/<reference>` (mode 0600), written atomically (tmp + rename).
    Temporary files start with "." and no reference does, so they never shadow a value."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, reference: str) -> pathlib.Path:
        if REFERENCE_PATTERN.fullmatch(reference) is None or reference.startswith("."):
            raise errors.InvalidArgument("malformed vault reference", field="reference")
        return self.directory / reference

    def put_blob(self, reference: str, sealed: bytes) -> None:
        write_private_file(self._path(reference), sealed)

    def get_blob(self, reference: str) -> bytes | None:
        try:
            return self._path(reference).read_bytes()
        except FileNotFoundError:
            return None

    def delete_blob(self, reference: str) -> None:
        self._path(reference).unlink(missing_ok=True)


def load_master_key(path: pathlib.Path) -> bytes:
    """The master key in `path`, created (32 random bytes, mode 0600) if the file does not exist.

    Created complete or not at all: the key is written to a private temporary file which is then hard-linked
    to `path` (link fails if `path` exists), so a concurrent starter never reads a half-written key and
    exactly one key wins."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(MASTER_KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):  # another starter won: use its key
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    key = path.read_bytes()
    if len(key) != MASTER_KEY_BYTES:
        raise errors.Internal(f"credential master key {path} is malformed ({len(key)} bytes)")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise errors.PermissionDenied(
            f"credential master key {path} must not be readable by others (mode 0600)"
        )
    return key


class EncryptedLocalVault(VaultBackend):
    """The default backend: AES-256-GCM sealed values in `blobs`, under a master key file (module docs)."""

    name = "local"

    def __init__(self, master_key: bytes, blobs: SealedBlobs) -> None:
        if len(master_key) != MASTER_KEY_BYTES:
            raise errors.InvalidArgument("the master key must be 32 bytes", field="master_key")
        self._aead = AESGCM(master_key)
        self._blobs = blobs

    @classmethod
    def open(cls, key_file: pathlib.Path, blobs: SealedBlobs) -> EncryptedLocalVault:
        return cls(load_master_key(key_file), blobs)

    def _seal(self, reference: str, value: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return SEALED_VERSION + nonce + self._aead.encrypt(nonce, value, reference.encode())

    def _open(self, reference: str, sealed: bytes) -> bytes:
        if len(sealed) < 1 + NONCE_BYTES + 16 or sealed[:1] != SEALED_VERSION:
            raise errors.Internal(f"sealed credential value {reference} is malformed")
        nonce, body = sealed[1 : 1 + NONCE_BYTES], sealed[1 + NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, body, reference.encode())
        except InvalidTag as exc:
            raise errors.Internal(
                f"sealed credential value {reference} does not authenticate (tampered, or another master key)"
            ) from exc

    def put(self, hint: str, value: bytes) -> str:
        if len(value) > MAX_VALUE_BYTES:
            raise errors.TooLarge(f"a credential value may be at most {MAX_VALUE_BYTES} bytes", field="value")
        reference = f"{hint}.{secrets.token_hex(8)}"
        if REFERENCE_PATTERN.fullmatch(reference) is None:
            raise errors.InvalidArgument("malformed vault reference hint", field="hint")
        self._blobs.put_blob(reference, self._seal(reference, value))
        return reference

    def get(self, reference: str) -> bytes:
        sealed = self._blobs.get_blob(reference)
        if sealed is None:
            raise errors.NotFound("the credential's value is gone from the vault")
        return self._open(reference, sealed)

    def delete(self, reference: str) -> None:
        self._blobs.delete_blob(reference)
