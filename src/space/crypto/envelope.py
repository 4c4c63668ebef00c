"""Authenticated encryption of small and medium byte strings (AES-256-GCM) and the data-key record.

Invariants:
- `seal` output is `nonce(12) || ciphertext || tag(16)`; the nonce is random per call (96-bit, never reused
  in practice for the number of seals one data key sees: one per artifact part).
- `aad` is bound into the tag: a sealed blob opened with any other aad fails, so a part cannot be moved to
  another artifact, entry or position.
- Any failure to open (wrong key, wrong aad, flipped bit, truncation) is `errors.ArtifactCorrupt`; the caller
  never sees partially decrypted plaintext.
- A `DataKey` holds the plaintext key only in memory; only `key_id` and `wrapped` are ever stored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space.core import errors

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES


@dataclass(frozen=True)
class DataKey:
    """A fresh per-artifact AES-256 key: `plaintext` for use now, `wrapped` (by the tenant key) to store."""

    key_id: str
    wrapped: bytes
    plaintext: bytes = field(repr=False)

    def __post_init__(self) -> None:
        check_key(self.plaintext)


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise errors.InvalidArgument(f"a data key must be {KEY_BYTES} bytes")


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """Encrypt and authenticate `plaintext` (and `aad`) under `key`: nonce || ciphertext+tag."""
    check_key(key)
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(bytes(key)).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """Inverse of `seal`; errors.ArtifactCorrupt if the key, the aad or any byte does not match."""
    check_key(key)
    if len(sealed) < OVERHEAD:
        raise errors.ArtifactCorrupt("sealed data is shorter than nonce and tag", reason="truncated")
    try:
        return AESGCM(bytes(key)).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except InvalidTag as exc:
        raise errors.ArtifactCorrupt(
            "authentication failed (wrong key, or the data was altered)", reason="authentication_failed"
        ) from exc


def derive_key(key: bytes, purpose: str) -> bytes:
    """A sub-key for one purpose (HKDF-SHA256), so one data key never serves two algorithms directly."""
    check_key(key)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose.encode()).derive(
        bytes(key)
    )


def mac(key: bytes, purpose: str, message: bytes) -> str:
    """Hex HMAC-SHA256 of `message` under the sub-key of `key` for `purpose`."""
    return hmac.new(derive_key(key, purpose), message, hashlib.sha256).hexdigest()


def mac_matches(key: bytes, purpose: str, message: bytes, expected: str) -> bool:
    return hmac.compare_digest(mac(key, purpose, message), expected)
