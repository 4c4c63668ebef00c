"""Artifacts through a fault-injecting proxy in front of the S3 server (tests/support/s3faults.py).

Seeded runs upload an artifact through the proxy, check what the real server holds with a direct (clean)
client, then download it through the proxy again. Over all runs:
- an upload either commits an artifact whose every part verifies on the server, or fails with a typed
  error and leaves no manifest (nothing restorable);
- a download returns exactly the uploaded bytes or fails with a typed error: 0 corrupt restores;
- every flipped bit is detected: the client fetched (or stored) that object again within the same
  operation, or the operation failed; a flipped bit never reaches the caller or the manifest.
The default run injects at least FAULTS faults (SPACE_SOAK=1 or SPACE_FUZZ=long: ten times as many).
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from space.core import errors
from space.crypto.envelope import DataKey
from space.objectstore import ObjectStore, open_store
from space.objectstore.artifacts import (
    ArtifactWriter,
    Manifest,
    read_entry_bytes,
    read_manifest,
    restorable,
    verify,
)
from space.objectstore.s3 import MAX_ATTEMPTS
from tests.support.s3faults import FaultSchedule, FaultyProxy
from tests.support.s3server import REGION, S3Server

BUCKET = "space-faults"
LONG = bool(os.environ.get("SPACE_SOAK")) or os.environ.get("SPACE_FUZZ") == "long"
FAULTS = 2000 if LONG else 200
RATE = 0.5
WORKERS = 4


@dataclass
class Tally:
    runs: int = 0
    committed: int = 0
    upload_failed: int = 0
    restored: int = 0
    restore_failed: int = 0
    corrupt: int = 0
    flips: int = 0
    flips_detected: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        for name in ("runs", "committed", "upload_failed", "restored", "restore_failed", "corrupt"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.flips += other.flips
        self.flips_detected += other.flips_detected
        self.faults.update(other.faults)
        self.errors.update(other.errors)


def _url(endpoint: str, prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint={endpoint}&region={REGION}"


def _flips_detected(proxy: FaultyProxy, first: int, last: int, failed: bool) -> tuple[int, int]:
    """(flips, detected) among requests first..last: a flip is detected when the client repeated that
    request within the operation (each object is stored or fetched once otherwise) or the operation failed."""
    flips = [e for e in proxy.events if e.kind.startswith("flip_") and first <= e.seq <= last]
    detected = 0
    for event in flips:
        same = (event.method, event.path)
        repeated = any(event.seq < s <= last and (m, p) == same for s, m, p in proxy.requests)
        detected += repeated or failed
    return len(flips), detected


def _upload(
    store: ObjectStore, prefix: str, entries: dict[str, bytes], key: DataKey | None, zstd: bool
) -> None:
    """As the node agent uploads (space.node.agent.transfer.upload): entries, commit, abort on failure."""
    compression = "zstd" if zstd else "none"
    writer = ArtifactWriter(store, prefix, data_key=key, metadata={}, part_size=2048, compression=compression)
    try:
        for name, data in entries.items():
            writer.add_bytes(name, data)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _download(store: ObjectStore, prefix: str, key: DataKey | None) -> dict[str, bytes]:
    manifest: Manifest = read_manifest(store, prefix)
    plaintext = key.plaintext if key else None
    return {name: read_entry_bytes(store, manifest, name, data_key=plaintext) for name in manifest.entries}


@dataclass
class Lane:
    """One worker's proxy and the store behind it (boto3 clients are costly to create: reused across runs)."""

    proxy: FaultyProxy
    faulty: ObjectStore
    clean: ObjectStore


def _upload_phase(
    lane: Lane, tally: Tally, prefix: str, entries: dict[str, bytes], key: DataKey | None
) -> bool:
    try:
        _upload(lane.faulty, prefix, entries, key, zstd=len(prefix) % 2 == 0)
    except errors.SpaceError as exc:  # anything else fails the test: no untyped errors
        tally.errors[f"upload {type(exc).__name__}"] += 1
        tally.upload_failed += 1
        assert not restorable(lane.clean, prefix), f"{prefix}: a failed upload left a manifest"
        return False
    tally.committed += 1
    stored = read_manifest(lane.clean, prefix)  # what the server holds verifies, part by part
    verify(lane.clean, stored, data_key=key.plaintext if key else None)
    return True


def _restore_phase(
    lane: Lane, tally: Tally, prefix: str, entries: dict[str, bytes], key: DataKey | None
) -> bool:
    try:
        got = _download(lane.faulty, prefix, key)
    except errors.SpaceError as exc:
        tally.errors[f"restore {type(exc).__name__}"] += 1
        tally.restore_failed += 1
        return False
    if got == entries:
        tally.restored += 1
    else:
        tally.corrupt += 1
    return True


def one_run(lane: Lane, seed: int, rate: float = RATE) -> Tally:
    """Upload one artifact through the proxy under schedule `seed`, check the server, download it back."""
    rng = random.Random(seed)
    tally = Tally(runs=1)
    prefix = f"faults/{uuid.uuid4().hex[:12]}/s{seed}"
    entries = {f"e{i}": rng.randbytes(rng.randrange(0, 7000)) for i in range(rng.randint(1, 2))}
    key = DataKey("k", b"wrapped", rng.randbytes(32)) if rng.random() < 0.5 else None
    lane.proxy.reset(FaultSchedule(seed, rate))
    try:
        committed = _upload_phase(lane, tally, prefix, entries, key)
        upload_end = len(lane.proxy.requests) - 1
        tally.flips, tally.flips_detected = _flips_detected(lane.proxy, 0, upload_end, not committed)
        if committed:
            restored = _restore_phase(lane, tally, prefix, entries, key)
            last = len(lane.proxy.requests) - 1
            flips, detected = _flips_detected(lane.proxy, upload_end + 1, last, not restored)
            tally.flips, tally.flips_detected = tally.flips + flips, tally.flips_detected + detected
        tally.faults = lane.proxy.counts()
    finally:
        lane.clean.delete_prefix(prefix + "/")
    return tally


@pytest.fixture
def lanes(s3_server: S3Server) -> Iterator[list[Lane]]:
    s3_server.create_bucket(BUCKET)
    clean = open_store(_url(s3_server.endpoint, ""))
    made: list[Lane] = []
    try:
        for _ in range(WORKERS):
            proxy = FaultyProxy(s3_server.endpoint, FaultSchedule(0, 0.0))
            made.append(Lane(proxy, open_store(_url(proxy.endpoint, "")), clean))
        yield made
    finally:
        for lane in made:
            lane.faulty.close()
            lane.proxy.close()
        clean.close()


def test_artifacts_survive_storage_faults(lanes: list[Lane]) -> None:
    total = Tally()
    seeds = iter(range(1_000_000))
    with ThreadPoolExecutor(WORKERS) as pool:
        while sum(total.faults.values()) < FAULTS:
            batch = [(lane, next(seeds)) for lane in lanes]
            for tally in pool.map(lambda job: one_run(*job), batch):
                total.add(tally)
    print(f"\nstorage faults: {total}")
    assert total.corrupt == 0, f"corrupt restores: {total}"
    assert total.flips_detected == total.flips, f"undetected flipped bits: {total}"
    assert total.flips > 0 and total.restored > 0 and total.committed > 0, total
    # Every kind of fault was injected at least once (the schedule is seeded, so this is deterministic).
    assert set(total.faults) >= {"reset_before", "reset_after", "status_500", "truncate", "flip_request"}, (
        total
    )


# --- faults that never clear: bounded retries, then a typed error and nothing restorable ------------------


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultyProxy]:
    s3_server.create_bucket(BUCKET)
    with FaultyProxy(s3_server.endpoint, FaultSchedule(0, 0.0)) as made:
        yield made


def _stores(proxy: FaultyProxy, s3_server: S3Server) -> tuple[ObjectStore, ObjectStore]:
    return open_store(_url(proxy.endpoint, "")), open_store(_url(s3_server.endpoint, ""))


@pytest.mark.parametrize(
    ("kind", "only", "error"),
    [
        ("status_500", "PUT", errors.Unavailable),  # every PUT refused
        ("reset_before", "PUT", errors.Unavailable),  # every PUT dropped before the server
        ("flip_request", "PUT", errors.ArtifactCorrupt),  # every PUT stored with a flipped bit
        ("reset_after", "manifest", errors.Unavailable),  # the manifest is stored, every answer lost
    ],
)
def test_upload_that_never_succeeds_fails_typed_and_leaves_nothing_restorable(
    proxy: FaultyProxy, s3_server: S3Server, kind: str, only: str, error: type[errors.SpaceError]
) -> None:
    def targeted(method: str, path: str) -> bool:
        return method == "PUT" and (only == "PUT" or path.endswith("/manifest.json"))

    proxy.reset(FaultSchedule(1, 1.0, kinds=(kind,), only=targeted))
    faulty, clean = _stores(proxy, s3_server)
    prefix = f"faults/{uuid.uuid4().hex[:12]}/never"
    try:
        started = time.monotonic()
        with pytest.raises(error):
            _upload(faulty, prefix, {"e0": os.urandom(1500)}, DataKey("k", b"w", os.urandom(32)), zstd=True)
        elapsed = time.monotonic() - started
        assert not restorable(clean, prefix) and clean.list(prefix + "/") == []
        puts = Counter(path for _, method, path in proxy.requests if method == "PUT")
        targeted_puts = {p: n for p, n in puts.items() if targeted("PUT", p)}
        # Bounded: each targeted object was tried MAX_ATTEMPTS times per S3Store attempt (botocore retries
        # transport failures and 5xx; S3Store retries integrity failures), never more.
        assert targeted_puts and max(targeted_puts.values()) <= MAX_ATTEMPTS * MAX_ATTEMPTS, puts
        assert elapsed < 30, f"retries back off, but boundedly: {elapsed:.1f}s"
    finally:
        clean.delete_prefix(prefix + "/")
        faulty.close()
        clean.close()


def test_every_flipped_download_is_artifact_corrupt_and_the_stored_copy_is_intact(
    proxy: FaultyProxy, s3_server: S3Server
) -> None:
    faulty, clean = _stores(proxy, s3_server)
    prefix = f"faults/{uuid.uuid4().hex[:12]}/flipped"
    data = {"e0": os.urandom(3000)}
    try:
        _upload(clean, prefix, data, None, zstd=False)
        proxy.reset(FaultSchedule(2, 1.0, kinds=("flip_response",)))
        with pytest.raises(errors.ArtifactCorrupt):
            _download(faulty, prefix, None)
        flips = proxy.events_of("flip_response")
        assert len(flips) == MAX_ATTEMPTS, flips  # the manifest, fetched and refused MAX_ATTEMPTS times
        assert _download(clean, prefix, None) == data
    finally:
        clean.delete_prefix(prefix + "/")
        faulty.close()
        clean.close()
