"""One stored part of an artifact entry: how raw bytes become a stored object and are checked coming back.

A stored part is a zstd frame of at most part_size raw bytes (or the raw bytes, compression "none"), then,
with a data key, sealed with AES-256-GCM under AAD = "space-artifact-v1|prefix|entry|index".

Invariants:
- The AAD binds a part to its artifact, entry and position: parts cannot be swapped, reordered or moved
  between artifacts without failing authentication.
- Coming back, a part's stored size and sha256 are checked against the manifest BEFORE it is decrypted or
  decompressed; then the GCM tag, then the decompressed size (a zstd frame claiming more than the manifest's
  size is refused before any allocation). Every failure is errors.ArtifactCorrupt naming the part.
- zstd contexts are not thread-safe: each worker thread keeps its own (thread-local), reused across parts.
"""

from __future__ import annotations

import hashlib
import threading

import zstandard

from space.core import errors
from space.crypto.envelope import DataKey, open_sealed, seal
from space.objectstore.base import ObjectStore
from space.objectstore.manifest import Manifest, PartRef, corrupt

ZSTD_LEVEL = 3

_local = threading.local()


def part_aad(prefix: str, name: str, index: int) -> bytes:
    # Names and prefixes cannot contain "|" (validated), so this encoding is unambiguous.
    return f"space-artifact-v1|{prefix}|{name}|{index}".encode()


def _compressor() -> zstandard.ZstdCompressor:
    compressor: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def encode_part(raw: bytes, *, compression: str, data_key: DataKey | None, aad: bytes) -> bytes:
    """The bytes to store for `raw`: compressed, then sealed (each step drops the GIL)."""
    stored = _compressor().compress(raw) if compression == "zstd" else raw
    if data_key is not None:
        stored = seal(data_key.plaintext, stored, aad)
    return stored


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_verified(store: ObjectStore, manifest: Manifest, part: PartRef) -> bytes:
    """A part's stored bytes, once their size and sha256 match the manifest."""
    try:
        stored = store.get(part.key)
    except errors.NotFound as exc:
        raise corrupt(manifest.prefix, part.key, "missing", f"part {part.key!r} is missing") from exc
    if len(stored) != part.stored_size:
        reason = "truncated" if len(stored) < part.stored_size else "size_mismatch"
        raise corrupt(
            manifest.prefix,
            part.key,
            reason,
            f"part {part.key!r} has {len(stored)} bytes, the manifest says {part.stored_size}",
        )
    if sha256_hex(stored) != part.sha256:
        raise corrupt(manifest.prefix, part.key, "checksum_mismatch", f"part {part.key!r} sha256 mismatch")
    return stored


def decode_part(
    store: ObjectStore, manifest: Manifest, name: str, index: int, part: PartRef, *, data_key: bytes | None
) -> bytes:
    """Fetch one part, check size and sha256, then open and decompress it (on a worker thread)."""
    data = fetch_verified(store, manifest, part)
    if data_key is not None:
        try:
            data = open_sealed(data_key, data, part_aad(manifest.prefix, name, index))
        except errors.ArtifactCorrupt as exc:
            raise corrupt(
                manifest.prefix, part.key, "authentication_failed", f"part {part.key!r} failed decryption"
            ) from exc
    if manifest.compression == "zstd":
        data = _decompress(manifest, part, data)
    if len(data) != part.size:
        raise corrupt(
            manifest.prefix,
            part.key,
            "size_mismatch",
            f"part {part.key!r} decodes to {len(data)} bytes, the manifest says {part.size}",
        )
    return data


def _decompress(manifest: Manifest, part: PartRef, data: bytes) -> bytes:
    try:
        # max_output_size only binds frames that do not state their size; a frame that does is
        # allocated at that size, so a tiny part claiming gigabytes is refused before decompressing.
        if zstandard.frame_content_size(data) > part.size:
            raise corrupt(
                manifest.prefix,
                part.key,
                "size_mismatch",
                f"part {part.key!r} claims more than the manifest's {part.size} bytes",
            )
        return _decompressor().decompress(data, max_output_size=part.size)
    except zstandard.ZstdError as exc:
        raise corrupt(
            manifest.prefix,
            part.key,
            "decompression_failed",
            f"part {part.key!r} does not decompress",
        ) from exc
