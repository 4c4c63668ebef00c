"""Artifacts: named byte streams stored as compressed, encrypted, checksummed parts plus a manifest.

This module is the artifact API (writer, readers, verify, delete) and re-exports the manifest's records and
readers, so callers import everything about artifacts from here. The format lives in `manifest` (the
manifest and its checks) and `parts` (one stored part's encoding and verification); the layout under a
prefix P is in docs/adr/0010-object-storage-artifacts.md:
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
- Two kill points (crash injection, armed only by SPACE_FAILPOINTS; space.faults.failpoints): ARTIFACT_POINTS,
  `objectstore.part_written` after a part was stored (an upload interrupted with parts and no manifest)
  and `objectstore.part_read` after a part was fetched and verified (a download interrupted half-way).
- On ArtifactCorrupt during `read_entry`, bytes of earlier (verified) parts may already be in `out`:
  callers discard the output, or call `verify(..., data_key=...)` first when nothing may be touched.
"""

from __future__ import annotations

import io
import itertools
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from space.core import errors
from space.crypto.envelope import DataKey, check_key, mac
from space.faults import failpoints
from space.objectstore.base import ObjectStore
from space.objectstore.manifest import (
    COMPRESSIONS,
    FORMAT,
    MAC_PURPOSE,
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    Encryption,
    Entry,
    Manifest,
    PartRef,
    authenticate,
    canonical,
    check_entry_name,
    check_prefix,
    manifest_key,
    parse_manifest,
    parts_prefix,
    read_manifest,
    restorable,
)
from space.objectstore.parts import decode_part, encode_part, fetch_verified, part_aad, sha256_hex

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

#: The kill points of artifact parts (module docstring).
ARTIFACT_POINTS = ("objectstore.part_written", "objectstore.part_read")
DEFAULT_CONCURRENCY = 4  # parts in flight per entry: overlaps compression, encryption, hashing and I/O


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
        self.prefix = check_prefix(prefix)
        if compression not in COMPRESSIONS:
            raise errors.InvalidArgument(f"unknown compression {compression!r}; use one of {COMPRESSIONS}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise errors.InvalidArgument(f"part_size must be between {MIN_PART_SIZE} and {MAX_PART_SIZE}")
        try:
            canonical(metadata)
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
        store.delete_prefix(parts_prefix(self.prefix))

    def _store_part(self, name: str, index: int, key: str, raw: bytes) -> PartRef:
        """Encode (compress, seal), hash and put one part, on a worker thread (each step drops the GIL)."""
        stored = encode_part(
            raw, compression=self.compression, data_key=self.data_key, aad=part_aad(self.prefix, name, index)
        )
        self.store.put(key, stored)
        failpoints.hit("objectstore.part_written")
        return PartRef(key, sha256_hex(stored), len(stored), len(raw))

    def add_stream(self, name: str, reader: BinaryIO) -> None:
        """Read `reader` to its end, storing it part by part; memory stays bounded by the part size."""
        if self._committed:
            raise errors.InvalidArgument(f"artifact {self.prefix!r} is already committed")
        name = check_entry_name(name)
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
                    key = f"{parts_prefix(self.prefix)}{entry_number:04d}/{index:08d}"
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
            self.store.delete_prefix(parts_prefix(self.prefix))
            self._entries.clear()

    def commit(self) -> Manifest:
        """Write the manifest (last), read it back and compare; returns the manifest as read back."""
        if self._committed:
            raise errors.InvalidArgument(f"artifact {self.prefix!r} is already committed")
        stored_keys = set(self.store.list(parts_prefix(self.prefix)))
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
            manifest.mac = mac(self.data_key.plaintext, MAC_PURPOSE, manifest.canonical_body())
        written = manifest.to_bytes()
        key = manifest_key(self.prefix)
        self.store.put(key, written)
        if self.store.get(key) != written:
            raise errors.ArtifactCorrupt(
                f"manifest of {self.prefix!r} read back differently than written", part=key, reason="readback"
            )
        self._committed = True
        return parse_manifest(self.prefix, key, written)


def _decoded_parts(
    store: ObjectStore, manifest: Manifest, name: str, data_key: bytes | None, concurrency: int
) -> Iterator[bytes]:
    entry = manifest.entries.get(name)
    if entry is None:
        raise errors.NotFound(f"artifact {manifest.prefix!r} has no entry {name!r}", entry=name)
    authenticate(manifest, data_key)
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
                    pool.submit(decode_part, store, manifest, name, index, part, data_key=data_key)
                )
            while in_flight:
                data = in_flight.popleft().result()
                following = next(upcoming, None)
                if following is not None:
                    in_flight.append(
                        pool.submit(
                            decode_part, store, manifest, name, following[0], following[1], data_key=data_key
                        )
                    )
                failpoints.hit("objectstore.part_read")
                yield data
                del data
        finally:
            for future in in_flight:
                future.cancel()


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
        fetch_verified(store, manifest, part)  # the bytes are dropped at once: memory stays bounded

    with ThreadPoolExecutor(concurrency, thread_name_prefix="artifact-verify") as pool:
        for _ in pool.map(check, parts):
            pass


def delete_artifact(store: ObjectStore, prefix: str) -> None:
    """Remove the manifest FIRST (the artifact stops being restorable at once), then every part.

    Idempotent, and safe to repeat after a crash: without a manifest the remaining parts are garbage."""
    prefix = check_prefix(prefix)
    store.delete(manifest_key(prefix))
    store.delete_prefix(f"{prefix}/")
