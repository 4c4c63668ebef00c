"""Artifact write/read throughput (issue 4/5: object storage, BYOK). `python -m bench.objectstore_bench`.

Streams a generated entry (default 100 MB; half incompressible random bytes, half text-like, the mix a
checkpoint image of a mostly idle sandbox roughly shows) through ArtifactWriter into a store and back
through read_entry into a hashing sink, for: no compression/no encryption, zstd, zstd + AES-256-GCM.
Prints MB/s (of raw entry bytes) and the stored size; writes bench/results/objectstore-<time>.json.
The default store is a local directory under /var/tmp (removed afterwards); `--store-url s3://...` works too.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

from bench.stats import write_json
from space.crypto.envelope import DataKey
from space.objectstore import open_store
from space.objectstore.artifacts import ArtifactWriter, delete_artifact, read_entry

MB = 1_000_000


class Generated(io.RawIOBase):
    """`total` bytes, produced block by block: alternating random and text-like 1 MiB blocks."""

    def __init__(self, total: int) -> None:
        self.remaining = total
        self.random_block = os.urandom(1 << 20)
        words = b"def run(self): return self.state.get('value', 0) + 1  # sandbox agent loop\n"
        self.text_block = (words * ((1 << 20) // len(words) + 1))[: 1 << 20]
        self.count = 0
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = min(self.remaining, 1 << 20 if size < 0 else size, 1 << 20)
        block = self.random_block if self.count % 2 == 0 else self.text_block
        self.count += 1
        self.remaining -= size
        data = block[:size]
        self.digest.update(data)
        return data


class HashSink(io.RawIOBase):
    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return len(data)


def run(store_url: str, size: int) -> dict[str, Any]:
    store = open_store(store_url)
    results: dict[str, Any] = {}
    cases = [("none", False), ("zstd", False), ("zstd", True)]
    for compression, encrypted in cases:
        name = f"artifact_{compression}{'_aesgcm' if encrypted else ''}"
        key = DataKey("bench", b"wrapped", os.urandom(32)) if encrypted else None
        prefix = f"bench/{uuid.uuid4().hex}"
        source = Generated(size)
        started = time.perf_counter()
        writer = ArtifactWriter(store, prefix, data_key=key, metadata={}, compression=compression)
        writer.add_stream("data", source)  # type: ignore[arg-type]
        manifest = writer.commit()
        write_s = time.perf_counter() - started
        sink = HashSink()
        started = time.perf_counter()
        read_entry(store, manifest, "data", sink, data_key=key.plaintext if key else None)  # type: ignore[arg-type]
        read_s = time.perf_counter() - started
        assert sink.digest.digest() == source.digest.digest(), "round trip mismatch"
        delete_artifact(store, prefix)
        results[name] = {
            "write_mb_s": round(size / MB / write_s, 1),
            "read_mb_s": round(size / MB / read_s, 1),
            "raw_mb": round(size / MB, 1),
            "stored_mb": round(manifest.total_stored_bytes / MB, 1),
            "n": 1,
        }
        row = results[name]
        print(
            f"{name:24s} write {row['write_mb_s']:7.1f} MB/s   read {row['read_mb_s']:7.1f} MB/s"
            f"   stored {row['stored_mb']:6.1f} of {row['raw_mb']:.1f} MB"
        )
    store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--store-url", default=None)
    args = parser.parse_args()
    root = None
    url = args.store_url
    if url is None:
        root = tempfile.mkdtemp(prefix="space-bench-objects-", dir="/var/tmp")
        url = f"file://{root}"
    try:
        results = run(url, args.size_mb * MB)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"results: {write_json(results, 'objectstore')}")


if __name__ == "__main__":
    main()
