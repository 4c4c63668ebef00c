"""Envelope encryption (AES-256-GCM data keys) and the key services that wrap them (local, AWS KMS).

Invariant: a plaintext data key exists only in memory; what is stored is its key id and wrapped form
(envelope.py, keys.py). This package imports only space.core (layer rule, scripts/check_imports.py).
"""

from space.crypto.envelope import DataKey, open_sealed, seal

__all__ = ["DataKey", "open_sealed", "seal"]
