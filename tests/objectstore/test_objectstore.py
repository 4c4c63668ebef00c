"""The local object store and the artifact format (parts + manifest) on it.

The same artifact contract runs against the S3 server on loopback in
tests/objectstore/test_objectstore_s3.py; this file adds what only the local store or only the format
logic needs (file modes, crash leftovers, memory bound, exact tamper cases).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from space.core import errors
from space.crypto.envelope import DataKey, mac
from space.crypto.keys import LocalKeyService
from space.objectstore import open_store
from space.objectstore.artifacts import (
    ArtifactWriter,
    Manifest,
    delete_artifact,
    manifest_key,
    read_entry,
    read_entry_bytes,
    read_manifest,
    restorable,
    verify,
)
from space.objectstore.base import ObjectStore, validate_key
from space.objectstore.local import LocalDirectoryStore

CANARY = b"CANARY-7f3a9c-do-not-store-in-plaintext"


@pytest.fixture
def store(tmp_path: Path) -> LocalDirectoryStore:
    opened = open_store(f"file://{tmp_path}/objects")
    assert isinstance(opened, LocalDirectoryStore)
    return opened


@pytest.fixture
def data_key() -> DataKey:
    return DataKey(key_id="test-key", wrapped=b"wrapped-form", plaintext=os.urandom(32))


# --- keys and urls -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["a", "a/b/c", "snap-1.img", "x_y/Z.9-", "a/.hidden"])
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key",
    ["", "/a", "a/", "a//b", "..", "a/../b", "a/./b", ".", "a b", "a\x00b", "a\\b", "é", "a:b", "x" * 1025],
)
def test_invalid_keys(store: LocalDirectoryStore, key: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        validate_key(key)
    with pytest.raises(errors.InvalidArgument):
        store.put(key, b"x")
    with pytest.raises(errors.InvalidArgument):
        store.get(key)


@pytest.mark.parametrize(
    "url",
    ["ftp://x/y", "file://relative/path", "file:relative", "s3://", "nothing", "s3://[bucket", "file://[x/y"],
)
def test_open_store_rejects_bad_urls(url: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        open_store(url)


def test_store_credentials_in_a_url_never_reach_messages_or_reprs() -> None:
    secret = "s3-secret-8d1e"
    store = open_store(f"s3://bucket/p?endpoint=http://127.0.0.1:9&access_key=AK&secret_key={secret}")
    try:
        assert secret not in repr(store) and "secret_key=***" in repr(store)
    finally:
        store.close()
    for bad in (
        f"s3:///p?secret_key={secret}",
        f"ftp://x?secret_key={secret}",
        f"s3://b?colour=x&secret_key={secret}",
    ):
        with pytest.raises(errors.InvalidArgument) as caught:
            open_store(bad)
        assert secret not in str(caught.value) and secret not in repr(caught.value.details)


# --- local store ---------------------------------------------------------------------------------------


def test_local_basic_operations(store: LocalDirectoryStore) -> None:
    assert store.list("") == []
    store.put("b/2", b"two")
    store.put("a/1", b"one")
    store.put("a/10/x", b"ten")
    store.put("ab", b"ab")
    assert store.get("a/1") == b"one"
    assert store.exists("a/1") and not store.exists("a/2") and not store.exists("a")
    assert store.list("") == ["a/1", "a/10/x", "ab", "b/2"]
    assert store.list("a") == ["a/1", "a/10/x", "ab"]  # plain string prefix, like S3
    assert store.list("a/") == ["a/1", "a/10/x"]
    assert store.list("a/1") == ["a/1", "a/10/x"]
    assert store.list("zzz/") == []
    store.put("a/1", b"replaced")
    assert store.get("a/1") == b"replaced"
    with pytest.raises(errors.NotFound):
        store.get("a/2")
    with pytest.raises(errors.NotFound):
        store.get("a/10")  # a directory is not an object
    store.delete("a/1")
    store.delete("a/1")  # idempotent
    assert store.delete_prefix("a/") == 1
    assert store.list("") == ["ab", "b/2"]
    assert not (store.root / "a").exists()  # empty directories are cleaned up


def test_local_files_are_private_and_atomic(store: LocalDirectoryStore) -> None:
    store.put("deep/dir/obj", b"data")
    path = store.root / "deep/dir/obj"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["obj"]  # no temporary file left
    # A temporary file left by a crash mid-put is never reported as an object.
    (path.parent / ".obj~tmp~abc123").write_bytes(b"partial")
    assert store.list("") == ["deep/dir/obj"]


def test_local_key_that_is_also_a_directory_is_a_conflict(store: LocalDirectoryStore) -> None:
    store.put("a/b", b"x")
    with pytest.raises(errors.Conflict):
        store.put("a", b"y")
    with pytest.raises(errors.Conflict):
        store.put("a/b/c", b"z")
    assert store.list("") == ["a/b"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=4),
    part_size=st.integers(min_value=256, max_value=4096),
    encrypted=st.booleans(),
    compression=st.sampled_from(["zstd", "none"]),
)
def test_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    part_size: int,
    encrypted: bool,
    compression: str,
) -> None:
    store = LocalDirectoryStore(tmp_path_factory.mktemp("prop"))
    key = DataKey("k", b"w", os.urandom(32)) if encrypted else None
    entries = {f"e{i}": os.urandom(size // 2) + b"a" * (size - size // 2) for i, size in enumerate(sizes)}
    writer = ArtifactWriter(
        store, "p", data_key=key, metadata={}, part_size=part_size, compression=compression
    )
    for name, data in entries.items():
        writer.add_bytes(name, data)
    manifest = read_manifest(store, writer.commit().prefix)
    for name, data in entries.items():
        assert len(manifest.entries[name].parts) == -(-len(data) // part_size)
        assert read_entry_bytes(store, manifest, name, data_key=key.plaintext if key else None) == data


def test_local_concurrent_put_and_delete_in_shared_directories(store: LocalDirectoryStore) -> None:
    """Deleting the last object of a directory removes it; a concurrent put into it must still succeed."""
    from concurrent.futures import ThreadPoolExecutor

    def churn(worker: int) -> None:
        for i in range(150):
            key = f"shared/{i % 3}/w{worker}"
            store.put(key, b"x")
            assert store.get(key) == b"x"
            store.delete(key)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(churn, range(4)))
    assert store.list("") == []


def test_local_store_cannot_escape_its_root(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "root")
    (tmp_path / "secret").write_bytes(b"outside")
    for key in ("../secret", "a/../../secret"):
        with pytest.raises(errors.InvalidArgument):
            store.get(key)


# --- artifacts -----------------------------------------------------------------------------------------


def write_artifact(
    store: ObjectStore, prefix: str, entries: dict[str, bytes], key: DataKey | None, part_size: int = 1000
) -> Manifest:
    writer = ArtifactWriter(store, prefix, data_key=key, metadata={"sandbox": "sb-1"}, part_size=part_size)
    for name, data in entries.items():
        writer.add_bytes(name, data)
    return writer.commit()


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_artifact_round_trip(
    store: LocalDirectoryStore, data_key: DataKey, encrypted: bool, compression: str
) -> None:
    key = data_key if encrypted else None
    entries = {
        "multi": os.urandom(2500) + b"z" * 3000,  # 6 parts of 1000 bytes, the last one short
        "exact": os.urandom(3000),  # exactly 3 parts
        "one": b"small",
        "empty": b"",
        "dir/nested.bin": b"n" * 10,
    }
    writer = ArtifactWriter(
        store,
        "sandboxes/sb-1/snap-1",
        data_key=key,
        metadata={"n": 1},
        part_size=1000,
        compression=compression,
    )
    for name, data in entries.items():
        writer.add_bytes(name, data)
    committed = writer.commit()
    manifest = read_manifest(store, "sandboxes/sb-1/snap-1")
    assert manifest.body() == committed.body()
    assert manifest.metadata == {"n": 1} and manifest.compression == compression
    assert [len(manifest.entries[n].parts) for n in entries] == [6, 3, 1, 0, 1]
    assert manifest.entries["multi"].size == 5500
    assert manifest.total_stored_bytes == sum(
        len(store.get(p.key)) for e in manifest.entries.values() for p in e.parts
    )
    for entry in manifest.entries.values():
        for part in entry.parts:
            stored = store.get(part.key)
            assert hashlib.sha256(stored).hexdigest() == part.sha256 and len(stored) == part.stored_size
    plain = data_key.plaintext if encrypted else None
    for name, data in entries.items():
        assert read_entry_bytes(store, manifest, name, data_key=plain) == data
    verify(store, manifest)
    if plain is not None:
        verify(store, manifest, data_key=plain)
    if encrypted:
        assert manifest.encryption is not None
        assert manifest.encryption.key_id == "test-key" and manifest.encryption.wrapped == b"wrapped-form"
    else:
        assert manifest.encryption is None
    assert restorable(store, "sandboxes/sb-1/snap-1")


class RecordingStore(LocalDirectoryStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def put(self, key: str, data: bytes) -> None:
        self.calls.append(("put", key))
        super().put(key, data)

    def get(self, key: str) -> bytes:
        self.calls.append(("get", key))
        return super().get(key)


def test_manifest_is_written_last_and_read_back(tmp_path: Path, data_key: DataKey) -> None:
    store = RecordingStore(tmp_path / "rec")
    manifest = write_artifact(store, "ordered", {"a": os.urandom(2500), "b": b"x"}, data_key)
    puts = [key for op, key in store.calls if op == "put"]
    assert puts[-1] == manifest_key("ordered") and puts.count(manifest_key("ordered")) == 1
    assert len(puts) == 1 + sum(len(e.parts) for e in manifest.entries.values())
    assert store.calls[-1] == ("get", manifest_key("ordered"))  # read back after writing


def test_add_stream_handles_short_reads_and_files(store: LocalDirectoryStore, tmp_path: Path) -> None:
    data = os.urandom(10_000)

    class Trickle(io.RawIOBase):
        """Returns at most 7 bytes per read, like a pipe."""

        def __init__(self) -> None:
            self.pos = 0

        def readable(self) -> bool:
            return True

        def read(self, size: int = -1) -> bytes:
            chunk = data[self.pos : self.pos + min(7, size if size >= 0 else 7)]
            self.pos += len(chunk)
            return chunk

    path = tmp_path / "input.bin"
    path.write_bytes(data)
    writer = ArtifactWriter(store, "art", data_key=None, metadata={}, part_size=4096)
    writer.add_stream("trickle", Trickle())  # type: ignore[arg-type]
    writer.add_file("file", path)
    with pytest.raises(errors.NotFound):
        writer.add_file("missing", tmp_path / "nope")
    manifest = writer.commit()
    assert [p.size for p in manifest.entries["trickle"].parts] == [4096, 4096, 1808]
    out = io.BytesIO()
    read_entry(store, manifest, "trickle", out, data_key=None)
    assert out.getvalue() == data
    assert read_entry_bytes(store, manifest, "file", data_key=None) == data


def test_writer_rejects_misuse(store: LocalDirectoryStore) -> None:
    with pytest.raises(errors.InvalidArgument):
        ArtifactWriter(store, "/abs", data_key=None, metadata={})
    with pytest.raises(errors.InvalidArgument):
        ArtifactWriter(store, "a", data_key=None, metadata={}, compression="lzma")
    with pytest.raises(errors.InvalidArgument):
        ArtifactWriter(store, "a", data_key=None, metadata={}, part_size=0)
    with pytest.raises(errors.InvalidArgument):
        ArtifactWriter(store, "a", data_key=None, metadata={"x": object()})
    writer = ArtifactWriter(store, "a", data_key=None, metadata={})
    writer.add_bytes("x", b"1")
    with pytest.raises(errors.AlreadyExists):
        writer.add_bytes("x", b"2")
    with pytest.raises(errors.InvalidArgument):
        writer.add_bytes("bad name", b"2")
    writer.commit()
    with pytest.raises(errors.InvalidArgument):
        writer.add_bytes("y", b"3")
    with pytest.raises(errors.InvalidArgument):
        writer.commit()
    with pytest.raises(errors.AlreadyExists):
        ArtifactWriter(store, "a", data_key=None, metadata={})


def test_missing_manifest_is_not_restorable(store: LocalDirectoryStore) -> None:
    """An upload interrupted before the manifest is never offered, and the next writer cleans up."""
    writer = ArtifactWriter(store, "half", data_key=None, metadata={}, part_size=100)
    writer.add_bytes("data", os.urandom(1000))
    # crash here: parts stored, no manifest
    assert len(store.list("half/")) == 10
    assert not restorable(store, "half")
    with pytest.raises(errors.NotFound, match="not restorable"):
        read_manifest(store, "half")
    retry = ArtifactWriter(store, "half", data_key=None, metadata={}, part_size=100)
    assert store.list("half/") == []  # leftovers of the interrupted attempt are gone
    retry.add_bytes("data", b"short")
    assert read_entry_bytes(store, retry.commit(), "data", data_key=None) == b"short"


def test_abort_and_delete(store: LocalDirectoryStore, data_key: DataKey) -> None:
    writer = ArtifactWriter(store, "gone", data_key=data_key, metadata={}, part_size=100)
    writer.add_bytes("x", os.urandom(500))
    writer.abort()
    assert store.list("gone/") == []
    write_artifact(store, "keep", {"x": b"keep"}, data_key)
    write_artifact(store, "del", {"x": os.urandom(3000)}, data_key)
    delete_artifact(store, "del")
    delete_artifact(store, "del")  # idempotent
    assert not restorable(store, "del") and store.list("del/") == []
    assert restorable(store, "keep")


def _only_part(manifest: Manifest, name: str, index: int = 0) -> str:
    return manifest.entries[name].parts[index].key


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
def test_flipped_bit_truncation_and_missing_part_are_detected(
    store: LocalDirectoryStore, data_key: DataKey, encrypted: bool
) -> None:
    key = data_key if encrypted else None
    plain = data_key.plaintext if encrypted else None
    payload = os.urandom(5000)
    for case in ("flip", "truncate", "missing", "extend"):
        prefix = f"corrupt-{case}"
        manifest = write_artifact(store, prefix, {"data": payload}, key)
        victim = _only_part(manifest, "data", 2)
        stored = store.get(victim)
        if case == "flip":
            store.put(victim, stored[:10] + bytes([stored[10] ^ 0x04]) + stored[11:])
        elif case == "truncate":
            store.put(victim, stored[:-1])
        elif case == "extend":
            store.put(victim, stored + b"\0")
        else:
            store.delete(victim)
        out = io.BytesIO()
        with pytest.raises(errors.ArtifactCorrupt) as caught:
            read_entry(store, manifest, "data", out, data_key=plain)
        assert caught.value.details["part"] == victim
        assert victim in caught.value.message
        expected_reason = {
            "flip": "checksum_mismatch",
            "truncate": "truncated",
            "missing": "missing",
            "extend": "size_mismatch",
        }[case]
        assert caught.value.details["reason"] == expected_reason
        # only the parts before the corrupt one were written, all verified
        assert out.getvalue() == payload[:2000]
        with pytest.raises(errors.ArtifactCorrupt):
            verify(store, manifest)


def _rewrite_manifest(store: LocalDirectoryStore, prefix: str, edit, resign_key: bytes | None = None) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the manifest like an attacker with write access: edit the body, fix its sha256."""
    key = manifest_key(prefix)
    document = json.loads(store.get(key))
    edit(document["manifest"])
    canonical = json.dumps(document["manifest"], sort_keys=True, separators=(",", ":")).encode()
    document["sha256"] = hashlib.sha256(canonical).hexdigest()
    if resign_key is not None:
        document["mac"] = mac(resign_key, "space-artifact-manifest-v1", canonical)
    store.put(key, json.dumps(document).encode())


def test_manifest_tampering_is_detected(store: LocalDirectoryStore, data_key: DataKey) -> None:
    payload = os.urandom(3000)
    manifest = write_artifact(store, "tamper", {"data": payload}, data_key)
    assert read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext) == payload
    # 1. A flipped byte without fixing the checksum: the manifest itself is corrupt.
    raw = store.get(manifest_key("tamper"))
    store.put(manifest_key("tamper"), raw.replace(b'"sb-1"', b'"sb-2"'))
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_manifest(store, "tamper")
    assert caught.value.details["part"] == manifest_key("tamper")
    # 2. A consistent rewrite (checksum fixed) is caught by the MAC under the data key.
    store.put(manifest_key("tamper"), raw)

    def drop_last_part(body):  # type: ignore[no-untyped-def]
        parts = body["entries"]["data"]["parts"]
        body["entries"]["data"]["size"] -= parts[-1]["size"]
        body["total_stored_bytes"] -= parts[-1]["stored_size"]
        del parts[-1]

    _rewrite_manifest(store, "tamper", drop_last_part)
    tampered = read_manifest(store, "tamper")  # well-formed, but not authentic
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_entry_bytes(store, tampered, "data", data_key=data_key.plaintext)
    assert caught.value.details["reason"] == "manifest_authentication_failed"
    with pytest.raises(errors.ArtifactCorrupt):
        verify(store, tampered, data_key=data_key.plaintext)
    # 3. Downgrade: claiming "not encrypted" is refused by a reader that holds a data key.
    store.put(manifest_key("tamper"), raw)
    _rewrite_manifest(store, "tamper", lambda body: body.update(encryption=None))
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_entry_bytes(store, read_manifest(store, "tamper"), "data", data_key=data_key.plaintext)
    assert caught.value.details["reason"] == "unexpected_plaintext"
    # 4. A manifest copied to another prefix does not pass as that artifact.
    store.put(manifest_key("elsewhere"), raw)
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_manifest(store, "elsewhere")
    assert caught.value.details["reason"] == "wrong_prefix"
    # 5. Garbage.
    store.put(manifest_key("garbage"), b"{not json")
    with pytest.raises(errors.ArtifactCorrupt):
        restorable(store, "garbage")


def test_part_claiming_more_than_the_manifest_is_refused_before_decompressing(
    store: LocalDirectoryStore,
) -> None:
    """An unencrypted artifact has no MAC: a writer may swap in a tiny zstd frame that states a huge content
    size (zstd would allocate it whatever max_output_size says). Refused by its stated size, not by memory."""
    manifest = write_artifact(store, "bomb", {"data": b"x" * 100}, None)
    part = manifest.entries["data"].parts[0]
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    assert len(bomb) < 4096 and zstandard.frame_content_size(bomb) == 64 << 20
    store.put(part.key, bomb)

    def point_at_bomb(body):  # type: ignore[no-untyped-def]
        stored = body["entries"]["data"]["parts"][0]
        stored["sha256"], stored["stored_size"] = hashlib.sha256(bomb).hexdigest(), len(bomb)
        body["total_stored_bytes"] = len(bomb)

    _rewrite_manifest(store, "bomb", point_at_bomb)
    tampered = read_manifest(store, "bomb")  # consistent: checksums and sizes match the stored bytes
    tracemalloc.start()
    try:
        with pytest.raises(errors.ArtifactCorrupt) as caught:
            read_entry_bytes(store, tampered, "data", data_key=None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.details["reason"] == "size_mismatch" and peak < 16 << 20

    # A manifest that claims an impossible part size is malformed on its own.
    def huge_part(body):  # type: ignore[no-untyped-def]
        stored = body["entries"]["data"]["parts"][0]
        stored["size"] = body["entries"]["data"]["size"] = 1 << 40

    _rewrite_manifest(store, "bomb", huge_part)
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_manifest(store, "bomb")
    assert caught.value.details["reason"] == "size_mismatch"


def test_parts_cannot_be_reordered_even_with_a_valid_manifest(
    store: LocalDirectoryStore, data_key: DataKey
) -> None:
    """The AAD binds (prefix, entry, index): a re-signed manifest listing parts in another order fails."""
    payload = b"A" * 1000 + b"B" * 1000
    write_artifact(store, "order", {"data": payload}, data_key)
    _rewrite_manifest(
        store, "order", lambda body: body["entries"]["data"]["parts"].reverse(), resign_key=data_key.plaintext
    )
    manifest = read_manifest(store, "order")
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext)
    assert caught.value.details["reason"] == "authentication_failed"


def test_wrong_or_missing_key(store: LocalDirectoryStore, data_key: DataKey) -> None:
    manifest = write_artifact(store, "keyed", {"data": b"payload"}, data_key)
    with pytest.raises(errors.ArtifactCorrupt):
        read_entry_bytes(store, manifest, "data", data_key=os.urandom(32))
    with pytest.raises(errors.InvalidArgument):
        read_entry_bytes(store, manifest, "data", data_key=None)
    with pytest.raises(errors.InvalidArgument):
        read_entry_bytes(store, manifest, "data", data_key=b"short")
    with pytest.raises(errors.NotFound):
        read_entry_bytes(store, manifest, "nope", data_key=data_key.plaintext)


def test_canary_never_stored_in_plaintext_when_encrypted(
    store: LocalDirectoryStore, data_key: DataKey
) -> None:
    # Incompressible surroundings keep zstd from hiding the canary by accident: only encryption hides it.
    payload = os.urandom(3000) + CANARY + os.urandom(3000) + CANARY
    enc = ArtifactWriter(store, "enc", data_key=data_key, metadata={}, part_size=2048, compression="none")
    enc.add_bytes("data", payload)
    enc.commit()
    plain = ArtifactWriter(store, "plain", data_key=None, metadata={}, part_size=2048, compression="none")
    plain.add_bytes("data", payload)
    plain.commit()
    found = {key for key in store.list("") if CANARY in store.get(key)}
    # The search itself works (finds the canary in the unencrypted artifact) and finds none in the other.
    assert found and all(key.startswith("plain/") for key in found)
    on_disk = b"".join(p.read_bytes() for p in store.root.rglob("*") if p.is_file() and "enc" in p.parts)
    assert CANARY not in on_disk and data_key.plaintext not in on_disk


def test_byok_flow_with_local_key_service(store: LocalDirectoryStore, tmp_path: Path) -> None:
    """Encrypt with a data key from the key service; rotation keeps it readable, revocation does not."""
    keys = LocalKeyService(tmp_path / "keys")
    tenant = keys.create_key("org-1")
    old_manifest = write_artifact(store, "old", {"data": b"before rotation"}, keys.generate_data_key(tenant))
    keys.rotate_key(tenant)
    new_manifest = write_artifact(store, "new", {"data": b"after rotation"}, keys.generate_data_key(tenant))
    for manifest, expected in ((old_manifest, b"before rotation"), (new_manifest, b"after rotation")):
        assert manifest.encryption is not None
        plain = keys.decrypt_data_key(manifest.encryption.key_id, manifest.encryption.wrapped)
        assert read_entry_bytes(store, manifest, "data", data_key=plain) == expected
    keys.revoke_key(tenant)
    for manifest in (old_manifest, new_manifest):
        assert manifest.encryption is not None
        with pytest.raises(errors.KeyRevoked):
            keys.decrypt_data_key(manifest.encryption.key_id, manifest.encryption.wrapped)


class _Generated(io.RawIOBase):
    """`total` bytes of pseudo-random data produced on demand (never held whole)."""

    def __init__(self, total: int) -> None:
        self.remaining = total
        self.block = os.urandom(1 << 16)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = min(self.remaining, size if size >= 0 else 1 << 16, len(self.block))
        self.remaining -= size
        return self.block[:size]


class _Hasher(io.RawIOBase):
    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[no-untyped-def]
        self.digest.update(data)
        self.size += len(data)
        return len(data)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_memory_stays_bounded_by_the_part_size(
    store: LocalDirectoryStore, data_key: DataKey, concurrency: int
) -> None:
    total, part_size = 48 << 20, 1 << 20
    tracemalloc.start()
    try:
        writer = ArtifactWriter(
            store, "big", data_key=data_key, metadata={}, part_size=part_size, concurrency=concurrency
        )
        writer.add_stream("data", _Generated(total))  # type: ignore[arg-type]
        manifest = writer.commit()
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        sink = _Hasher()
        read_entry(store, manifest, "data", sink, data_key=data_key.plaintext, concurrency=concurrency)  # type: ignore[arg-type]
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sink.size == total and len(manifest.entries["data"].parts) == 48
    # Per part in flight: raw, compressed and sealed copies at most, plus the one being read; never the entry.
    bound = (3 * concurrency + 3) * part_size
    assert write_peak < bound, (write_peak, bound)
    assert read_peak < bound, (read_peak, bound)


def test_parallel_upload_keeps_part_order(store: LocalDirectoryStore, data_key: DataKey) -> None:
    payload = b"".join(bytes([i]) * 1000 for i in range(64))
    writer = ArtifactWriter(store, "order", data_key=data_key, metadata={}, part_size=1000, concurrency=8)
    writer.add_bytes("data", payload)
    manifest = writer.commit()
    assert [p.key.rsplit("/", 1)[1] for p in manifest.entries["data"].parts] == [
        f"{i:08d}" for i in range(64)
    ]
    for concurrency in (1, 3, 8):
        assert (
            read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext, concurrency=concurrency)
            == payload
        )
