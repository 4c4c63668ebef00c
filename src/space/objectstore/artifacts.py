"""Artifacts: named byte streams stored as compressed, encrypted, checksummed parts plus a manifest.

Layout under a prefix P (see docs/adr/0010-object-storage-artifacts.md):
    P/parts/<entry#>/<part#>   one stored part: zstd frame of <= part_size raw bytes, then AES-256-GCM
    P/manifest.json            written LAST; lists every entry and part with sha256 and sizes

Invariants:
- An artifact exists (is restorable) exactly when its manifest exists. The manifest is written after every
  part was stored, then read back and compared, so a crash at any moment leaves either no manifest (the
  parts are garbage that the next writer on P or `delete_artifact` removes) or a complete artifact.
- Every stored part's sha256 and stored size are in the manifest and are checked BEFORE the part is
  decrypted or decompressed; any mismatch, a missing part, a failed GCM tag or a wrong decompressed size is
  errors.ArtifactCorrupt naming the part. Nothing unverified reaches the caller's output.
- With a data key, each part is sealed with AAD = "space-artifact-v1|prefix|entry|index", so parts cannot
  be swapped, reordered or moved between artifacts; the manifest carries an HMAC under a key derived from
  the data key, so altering the manifest (sizes, checksums, part list, metadata) is detected, and a reader
  holding a data key refuses an artifact whose manifest claims to be unencrypted (no downgrade).
- Memory is bounded by the parts in flight (`concurrency`, default 4, each up to three copies: raw,
  compressed, sealed), whatever the entry's size.
- On ArtifactCorrupt during `read_entry`, bytes of earlier (verified) parts may already be in `out`:
  callers discard the output, or call `verify(..., data_key=...)` first when nothing may be touched.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from space.core import errors
from space.crypto.envelope import DataKey, check_key, mac, mac_matches, open_sealed, seal
from space.objectstore.base import ObjectStore, validate_key

__all__ = [
    "FORMAT",
    "ArtifactWriter",
    "DataKey",
    "Encryption",
    "Entry",
    "Manifest",
    "PartRef",
    "delete_artifact",
    "manifest_key",
    "read_entry",
    "read_entry_bytes",
    "read_manifest",
    "restorable",
    "verify",
]

FORMAT = "space-artifact/1"
MANIFEST_NAME = "manifest.json"
ENCRYPTION_ALGORITHM = "AES-256-GCM"
COMPRESSIONS = ("zstd", "none")
ZSTD_LEVEL = 3
MIN_PART_SIZE = 1
MAX_PART_SIZE = 256 << 20
DEFAULT_CONCURRENCY = 4  # parts in flight per entry: overlaps compression, encryption, hashing and I/O
_MAC_PURPOSE = "space-artifact-manifest-v1"


@dataclass(frozen=True)
class PartRef:
    key: str  # object key of the stored part
    sha256: str  # of the stored bytes (after compression and encryption)
    stored_size: int
    size: int  # raw bytes this part contributes to the entry


@dataclass(frozen=True)
class Entry:
    size: int
    parts: tuple[PartRef, ...]


@dataclass(frozen=True)
class Encryption:
    key_id: str
    wrapped: bytes  # the data key wrapped by the tenant key (opaque to us)
    algorithm: str = ENCRYPTION_ALGORITHM

    @property
    def wrapped_b64(self) -> str:
        return base64.b64encode(self.wrapped).decode()


@dataclass
class Manifest:
    prefix: str
    created_at: datetime
    metadata: dict[str, Any]
    compression: str
    encryption: Encryption | None
    entries: dict[str, Entry]
    total_stored_bytes: int
    mac: str | None = field(default=None, repr=False)

    def body(self) -> dict[str, Any]:
        """The authenticated content, as it is serialized (without the mac)."""
        return {
            "format": FORMAT,
            "prefix": self.prefix,
            "created_at": self.created_at.isoformat(),
            "metadata": self.metadata,
            "compression": self.compression,
            "encryption": None
            if self.encryption is None
            else {
                "algorithm": self.encryption.algorithm,
                "key_id": self.encryption.key_id,
                "wrapped": self.encryption.wrapped_b64,
            },
            "entries": {
                name: {
                    "size": entry.size,
                    "parts": [
                        {"key": p.key, "sha256": p.sha256, "stored_size": p.stored_size, "size": p.size}
                        for p in entry.parts
                    ],
                }
                for name, entry in self.entries.items()
            },
            "total_stored_bytes": self.total_stored_bytes,
        }

    def canonical_body(self) -> bytes:
        return _canonical(self.body())

    def to_bytes(self) -> bytes:
        body = self.body()
        document = {"manifest": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest(), "mac": self.mac}
        return json.dumps(document, sort_keys=True, indent=1).encode()

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None


def manifest_key(prefix: str) -> str:
    return f"{_check_prefix(prefix)}/{MANIFEST_NAME}"


def _parts_prefix(prefix: str) -> str:
    return f"{prefix}/parts/"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _check_prefix(prefix: str) -> str:
    try:
        return validate_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"invalid artifact prefix {prefix!r}", prefix=str(prefix)) from exc


def _check_entry_name(name: str) -> str:
    try:
        return validate_key(name)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(
            f"invalid artifact entry name {name!r}: use [A-Za-z0-9._-] segments separated by '/'",
            entry=str(name),
        ) from exc


def _part_aad(prefix: str, name: str, index: int) -> bytes:
    # Names and prefixes cannot contain "|" (validated), so this encoding is unambiguous.
    return f"space-artifact-v1|{prefix}|{name}|{index}".encode()


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per worker thread, reused across parts.
    compressor: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _read_full(reader: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes; short only at end of stream (pipes and sockets return short reads)."""
    chunks: list[bytes] = []
    remaining = size
    while remaining > 0:
        chunk = reader.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ArtifactWriter:
    """Writes one artifact under `prefix`: add entries, then `commit` (which writes the manifest last).

    Constructing a writer on a prefix that already has a manifest is errors.AlreadyExists (a committed
    artifact is immutable); parts left by an interrupted earlier writer on the same prefix are removed.
    One writer per prefix at a time: callers serialize (a second concurrent writer would delete the first
    one's parts; the damage would be caught as ArtifactCorrupt on read, never restored silently).
    """

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        data_key: DataKey | None,
        metadata: dict[str, Any],
        part_size: int = 8 << 20,
        compression: str = "zstd",
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.store = store
        self.prefix = _check_prefix(prefix)
        if compression not in COMPRESSIONS:
            raise errors.InvalidArgument(f"unknown compression {compression!r}; use one of {COMPRESSIONS}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise errors.InvalidArgument(f"part_size must be between {MIN_PART_SIZE} and {MAX_PART_SIZE}")
        try:
            _canonical(metadata)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"artifact metadata must be JSON-serializable: {exc}") from exc
        if data_key is not None:
            check_key(data_key.plaintext)
        self.data_key = data_key
        self.metadata = dict(metadata)
        self.part_size = part_size
        self.compression = compression
        if not 1 <= concurrency <= 32:
            raise errors.InvalidArgument("concurrency must be between 1 and 32")
        self.concurrency = concurrency
        self._entries: dict[str, Entry] = {}
        self._committed = False
        if store.exists(manifest_key(self.prefix)):
            raise errors.AlreadyExists(
                f"artifact {self.prefix!r} already exists (committed artifacts are immutable)",
                prefix=self.prefix,
            )
        store.delete_prefix(_parts_prefix(self.prefix))

    def _store_part(self, name: str, index: int, key: str, raw: bytes) -> PartRef:
        """Encode (compress, seal), hash and put one part, on a worker thread (each step drops the GIL)."""
        stored = _compressor().compress(raw) if self.compression == "zstd" else raw
        if self.data_key is not None:
            stored = seal(self.data_key.plaintext, stored, _part_aad(self.prefix, name, index))
        self.store.put(key, stored)
        return PartRef(key, hashlib.sha256(stored).hexdigest(), len(stored), len(raw))

    def add_stream(self, name: str, reader: BinaryIO) -> None:
        """Read `reader` to its end, storing it part by part; memory stays bounded by the part size."""
        if self._committed:
            raise errors.InvalidArgument(f"artifact {self.prefix!r} is already committed")
        name = _check_entry_name(name)
        if name in self._entries:
            raise errors.AlreadyExists(f"artifact entry {name!r} was already added", entry=name)
        entry_number = len(self._entries)
        parts: list[PartRef] = []
        # Reading stays sequential; encoding and uploading overlap on up to `concurrency` workers. At most
        # `concurrency` parts are in flight, which keeps memory bounded whatever the entry's size.
        in_flight: deque[Future[PartRef]] = deque()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="artifact-put") as pool:
            try:
                index = 0
                while True:
                    raw = _read_full(reader, self.part_size)
                    if not raw:
                        break
                    at_end = len(raw) < self.part_size  # _read_full is short only at end of stream
                    key = f"{_parts_prefix(self.prefix)}{entry_number:04d}/{index:08d}"
                    if len(in_flight) >= self.concurrency:
                        parts.append(in_flight.popleft().result())
                    in_flight.append(pool.submit(self._store_part, name, index, key, raw))
                    del raw
                    index += 1
                    if at_end:
                        break
                while in_flight:
                    parts.append(in_flight.popleft().result())
            finally:
                for future in in_flight:
                    future.cancel()
        self._entries[name] = Entry(size=sum(p.size for p in parts), parts=tuple(parts))

    def add_file(self, name: str, path: Path) -> None:
        if not Path(path).is_file():
            raise errors.NotFound(f"file {path} not found", path=str(path))
        with Path(path).open("rb") as handle:
            self.add_stream(name, handle)

    def add_bytes(self, name: str, data: bytes) -> None:
        self.add_stream(name, io.BytesIO(data))

    def abort(self) -> None:
        """Undo an uncommitted writer: its manifest (if `commit` failed after writing it) first, then parts.

        The constructor refused a prefix that had a manifest, so whatever is there now is this writer's."""
        if not self._committed:
            self.store.delete(manifest_key(self.prefix))
            self.store.delete_prefix(_parts_prefix(self.prefix))
            self._entries.clear()

    def commit(self) -> Manifest:
        """Write the manifest (last), read it back and compare; returns the manifest as read back."""
        if self._committed:
            raise errors.InvalidArgument(f"artifact {self.prefix!r} is already committed")
        stored_keys = set(self.store.list(_parts_prefix(self.prefix)))
        missing = [p.key for e in self._entries.values() for p in e.parts if p.key not in stored_keys]
        if missing:
            raise errors.Unavailable(
                f"object store lost {len(missing)} parts of {self.prefix!r} before commit", part=missing[0]
            )
        encryption = None
        if self.data_key is not None:
            encryption = Encryption(key_id=self.data_key.key_id, wrapped=self.data_key.wrapped)
        manifest = Manifest(
            prefix=self.prefix,
            created_at=datetime.now(UTC),
            metadata=self.metadata,
            compression=self.compression,
            encryption=encryption,
            entries=dict(self._entries),
            total_stored_bytes=sum(p.stored_size for e in self._entries.values() for p in e.parts),
        )
        if self.data_key is not None:
            manifest.mac = mac(self.data_key.plaintext, _MAC_PURPOSE, manifest.canonical_body())
        written = manifest.to_bytes()
        key = manifest_key(self.prefix)
        self.store.put(key, written)
        if self.store.get(key) != written:
            raise errors.ArtifactCorrupt(
                f"manifest of {self.prefix!r} read back differently than written", part=key, reason="readback"
            )
        self._committed = True
        return _parse_manifest(self.prefix, key, written)


def _corrupt(prefix: str, part: str, reason: str, message: str) -> errors.ArtifactCorrupt:
    return errors.ArtifactCorrupt(f"artifact {prefix!r}: {message}", prefix=prefix, part=part, reason=reason)


def _parse_manifest(prefix: str, key: str, raw: bytes) -> Manifest:
    try:
        document = json.loads(raw)
        body = document["manifest"]
        if hashlib.sha256(_canonical(body)).hexdigest() != document["sha256"]:
            raise _corrupt(prefix, key, "checksum_mismatch", "manifest checksum does not match")
        if body["format"] != FORMAT:
            raise _corrupt(prefix, key, "unknown_format", f"unknown manifest format {body['format']!r}")
        if body["prefix"] != prefix:
            raise _corrupt(prefix, key, "wrong_prefix", f"manifest belongs to {body['prefix']!r}")
        enc = body["encryption"]
        encryption = (
            None
            if enc is None
            else Encryption(
                key_id=str(enc["key_id"]),
                wrapped=base64.b64decode(enc["wrapped"], validate=True),
                algorithm=str(enc["algorithm"]),
            )
        )
        entries: dict[str, Entry] = {}
        for name, item in body["entries"].items():
            parts = tuple(
                PartRef(str(p["key"]), str(p["sha256"]), int(p["stored_size"]), int(p["size"]))
                for p in item["parts"]
            )
            for part in parts:
                if not part.key.startswith(_parts_prefix(prefix)):
                    raise _corrupt(prefix, key, "foreign_part", f"part {part.key!r} is outside the artifact")
                if not MIN_PART_SIZE <= part.size <= MAX_PART_SIZE or part.stored_size < 0:
                    raise _corrupt(prefix, key, "size_mismatch", f"part {part.key!r} has an impossible size")
            if sum(p.size for p in parts) != int(item["size"]):
                raise _corrupt(prefix, key, "size_mismatch", f"entry {name!r} sizes do not add up")
            entries[str(name)] = Entry(size=int(item["size"]), parts=parts)
        manifest = Manifest(
            prefix=prefix,
            created_at=datetime.fromisoformat(body["created_at"]),
            metadata=dict(body["metadata"]),
            compression=str(body["compression"]),
            encryption=encryption,
            entries=entries,
            total_stored_bytes=int(body["total_stored_bytes"]),
            mac=document.get("mac"),
        )
        if manifest.compression not in COMPRESSIONS:
            raise _corrupt(
                prefix, key, "unknown_compression", f"unknown compression {manifest.compression!r}"
            )
        if encryption is not None and encryption.algorithm != ENCRYPTION_ALGORITHM:
            raise _corrupt(prefix, key, "unknown_encryption", f"unknown encryption {encryption.algorithm!r}")
        if manifest.canonical_body() != _canonical(body):
            raise _corrupt(prefix, key, "malformed", "manifest does not round-trip")
        return manifest
    except errors.ArtifactCorrupt:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _corrupt(prefix, key, "malformed", f"manifest is malformed ({type(exc).__name__})") from exc


def read_manifest(store: ObjectStore, prefix: str) -> Manifest:
    """The artifact's manifest; errors.NotFound ("not restorable") when there is none."""
    prefix = _check_prefix(prefix)
    key = manifest_key(prefix)
    try:
        raw = store.get(key)
    except errors.NotFound as exc:
        raise errors.NotFound(
            f"artifact {prefix!r} is not restorable: it has no manifest", prefix=prefix
        ) from exc
    return _parse_manifest(prefix, key, raw)


def restorable(store: ObjectStore, prefix: str) -> bool:
    """True when a well-formed manifest exists (a corrupt manifest raises ArtifactCorrupt, not False)."""
    try:
        read_manifest(store, prefix)
    except errors.NotFound:
        return False
    return True


def _authenticate(manifest: Manifest, data_key: bytes | None) -> None:
    key = manifest_key(manifest.prefix)
    if manifest.encryption is None:
        if data_key is not None:
            raise _corrupt(
                manifest.prefix,
                key,
                "unexpected_plaintext",
                "a data key was given but the manifest says "
                "the artifact is not encrypted (refusing a possible downgrade)",
            )
        return
    if data_key is None:
        raise errors.InvalidArgument(
            f"artifact {manifest.prefix!r} is encrypted: a data key is required", prefix=manifest.prefix
        )
    check_key(data_key)
    if manifest.mac is None or not mac_matches(
        data_key, _MAC_PURPOSE, manifest.canonical_body(), manifest.mac
    ):
        raise _corrupt(
            manifest.prefix,
            key,
            "manifest_authentication_failed",
            "manifest failed authentication (altered, or this is not the artifact's data key)",
        )


def _fetch_verified(store: ObjectStore, manifest: Manifest, part: PartRef) -> bytes:
    try:
        stored = store.get(part.key)
    except errors.NotFound as exc:
        raise _corrupt(manifest.prefix, part.key, "missing", f"part {part.key!r} is missing") from exc
    if len(stored) != part.stored_size:
        reason = "truncated" if len(stored) < part.stored_size else "size_mismatch"
        raise _corrupt(
            manifest.prefix,
            part.key,
            reason,
            f"part {part.key!r} has {len(stored)} bytes, the manifest says {part.stored_size}",
        )
    if hashlib.sha256(stored).hexdigest() != part.sha256:
        raise _corrupt(manifest.prefix, part.key, "checksum_mismatch", f"part {part.key!r} sha256 mismatch")
    return stored


def _decoded_parts(
    store: ObjectStore, manifest: Manifest, name: str, data_key: bytes | None, concurrency: int
) -> Iterator[bytes]:
    entry = manifest.entries.get(name)
    if entry is None:
        raise errors.NotFound(f"artifact {manifest.prefix!r} has no entry {name!r}", entry=name)
    _authenticate(manifest, data_key)
    # Parts are fetched, verified and decoded on up to `concurrency` workers and yielded in order; at most
    # `concurrency` decoded parts wait, so memory stays bounded. An error surfaces when its part's turn comes,
    # so everything yielded before it was verified.
    if not 1 <= concurrency <= 32:
        raise errors.InvalidArgument("concurrency must be between 1 and 32")
    parts = list(enumerate(entry.parts))
    with ThreadPoolExecutor(concurrency, thread_name_prefix="artifact-get") as pool:
        in_flight: deque[Future[bytes]] = deque()
        upcoming = iter(parts)
        try:
            for index, part in itertools.islice(upcoming, concurrency):
                in_flight.append(
                    pool.submit(_decode_part, store, manifest, name, index, part, data_key=data_key)
                )
            while in_flight:
                data = in_flight.popleft().result()
                following = next(upcoming, None)
                if following is not None:
                    in_flight.append(
                        pool.submit(
                            _decode_part, store, manifest, name, following[0], following[1], data_key=data_key
                        )
                    )
                yield data
                del data
        finally:
            for future in in_flight:
                future.cancel()


def _decode_part(
    store: ObjectStore, manifest: Manifest, name: str, index: int, part: PartRef, *, data_key: bytes | None
) -> bytes:
    """Fetch one part, check size and sha256, then open and decompress it (on a worker thread)."""
    data = _fetch_verified(store, manifest, part)
    if data_key is not None:
        try:
            data = open_sealed(data_key, data, _part_aad(manifest.prefix, name, index))
        except errors.ArtifactCorrupt as exc:
            raise _corrupt(
                manifest.prefix, part.key, "authentication_failed", f"part {part.key!r} failed decryption"
            ) from exc
    if manifest.compression == "zstd":
        try:
            # max_output_size only binds frames that do not state their size; a frame that does is
            # allocated at that size, so a tiny part claiming gigabytes is refused before decompressing.
            if zstandard.frame_content_size(data) > part.size:
                raise _corrupt(
                    manifest.prefix,
                    part.key,
                    "size_mismatch",
                    f"part {part.key!r} claims more than the manifest's {part.size} bytes",
                )
            data = _decompressor().decompress(data, max_output_size=part.size)
        except zstandard.ZstdError as exc:
            raise _corrupt(
                manifest.prefix,
                part.key,
                "decompression_failed",
                f"part {part.key!r} does not decompress",
            ) from exc
    if len(data) != part.size:
        raise _corrupt(
            manifest.prefix,
            part.key,
            "size_mismatch",
            f"part {part.key!r} decodes to {len(data)} bytes, the manifest says {part.size}",
        )
    return data


def read_entry(
    store: ObjectStore,
    manifest: Manifest,
    name: str,
    out: BinaryIO,
    *,
    data_key: bytes | None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> None:
    """Stream entry `name` into `out`, verifying each part (sha256, size, tag) before it is used."""
    for data in _decoded_parts(store, manifest, name, data_key, concurrency):
        out.write(data)


def read_entry_bytes(
    store: ObjectStore,
    manifest: Manifest,
    name: str,
    *,
    data_key: bytes | None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> bytes:
    """The whole entry in memory: only for small entries (specs, metadata)."""
    buffer = io.BytesIO()
    read_entry(store, manifest, name, buffer, data_key=data_key, concurrency=concurrency)
    return buffer.getvalue()


def verify(
    store: ObjectStore,
    manifest: Manifest,
    *,
    data_key: bytes | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> None:
    """Download every part and check size and sha256; with `data_key`, also authenticate the manifest
    and decrypt and decompress every part (the complete check, short of using the data)."""
    if data_key is not None:
        for name in manifest.entries:
            for _ in _decoded_parts(store, manifest, name, data_key, concurrency):
                pass
        return
    parts = [part for entry in manifest.entries.values() for part in entry.parts]

    def check(part: PartRef) -> None:
        _fetch_verified(store, manifest, part)  # the bytes are dropped at once: memory stays bounded

    with ThreadPoolExecutor(concurrency, thread_name_prefix="artifact-verify") as pool:
        for _ in pool.map(check, parts):
            pass


def delete_artifact(store: ObjectStore, prefix: str) -> None:
    """Remove the manifest FIRST (the artifact stops being restorable at once), then every part.

    Idempotent, and safe to repeat after a crash: without a manifest the remaining parts are garbage."""
    prefix = _check_prefix(prefix)
    store.delete(manifest_key(prefix))
    store.delete_prefix(f"{prefix}/")
