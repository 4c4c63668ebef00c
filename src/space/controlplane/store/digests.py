"""Secrets the store issues and the digests it keeps of them (API keys, node identities, tokens).

Invariants:
- A secret is never stored: only its SHA-256 hex digest (`hash_secret`), looked up by a unique index and
  compared with `hmac.compare_digest`. Secrets are 240-bit random, so no salt or slow KDF is needed.
- Nothing longer than MAX_SECRET_LENGTH is ever hashed as a secret (a bearer token of megabytes is
  refused before any work is done on it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final, Literal

API_KEY_PREFIX: Final = "space_"
API_KEY_RANDOM_CHARS: Final = 40  # secrets.token_urlsafe(30) is exactly 40 url-safe characters
#: A key in E2B's shape (`e2b_` + lowercase hex: older E2B SDKs check it client-side): the same 240 random
#: bits, as 60 hex digits. Otherwise a SPACE key like any other (same store, roles, revocation).
E2B_API_KEY_PREFIX: Final = "e2b_"
API_KEY_PREFIXES: Final = (API_KEY_PREFIX, E2B_API_KEY_PREFIX)
KeyShape = Literal["space", "e2b"]
API_KEY_DISPLAY_CHARS: Final = 12  # "space_" + 6 random characters: enough to tell keys apart
MAX_SECRET_LENGTH: Final = 256  # never hash megabytes sent as a bearer token


def hash_secret(secret: str) -> str:
    """SHA-256 hex of a secret (API key or node token). Secrets are 240-bit random, so no salt/KDF is
    needed: nobody can brute-force the preimage, and a plain digest allows an indexed lookup."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def hash_request(*parts: bytes | str) -> str:
    """A stable digest of a request (method, path, canonical body ...) for begin_idempotent."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        # Length-prefix every part so ("ab", "c") and ("a", "bc") differ.
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def plausible_secret(value: object) -> bool:
    """Whether `value` can be a secret at all (a non-empty string of at most MAX_SECRET_LENGTH)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_SECRET_LENGTH


def matches(stored_hash: str | None, secret: str) -> bool:
    """Whether `secret` hashes to `stored_hash` (constant-time comparison; None matches nothing)."""
    return stored_hash is not None and hmac.compare_digest(stored_hash, hash_secret(secret))


def new_api_key_secret(shape: KeyShape = "space") -> str:
    if shape == "e2b":
        return E2B_API_KEY_PREFIX + secrets.token_hex(30)
    return API_KEY_PREFIX + secrets.token_urlsafe(30)


def new_node_identity() -> str:
    """A fresh per-node secret (240-bit random), issued at each registration of a node (ADR 0019)."""
    return secrets.token_urlsafe(30)
