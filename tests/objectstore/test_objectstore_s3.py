"""The object-store and artifact contract on both backends: the local directory and a real S3 protocol
server on loopback (moto, see tests/support/s3server.py), plus KmsKeyService against the same server's KMS.

Every contract test takes the `store` fixture, parametrized over "local" and "s3", so the same assertions
run on both. Each test gets its own key prefix (S3) or directory (local), so tests never see each other.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.core import errors
from space.crypto.envelope import DataKey
from space.crypto.keys import KmsKeyService, open_key_service
from space.objectstore import ObjectStore, open_store
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
from space.objectstore.s3 import S3Store
from tests.support.s3server import S3Server

BUCKET = "space-test"
CANARY = b"CANARY-s3-4b1d-must-never-be-stored-in-plaintext"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        opened = open_store(f"file://{tmp_path}/objects")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        opened = open_store(server.bucket_url(BUCKET, prefix=f"t-{uuid.uuid4().hex[:12]}"))
        assert isinstance(opened, S3Store)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def data_key() -> DataKey:
    return DataKey(key_id="k", wrapped=b"wrapped", plaintext=os.urandom(32))


def write(store: ObjectStore, prefix: str, entries: dict[str, bytes], key: DataKey | None) -> Manifest:
    writer = ArtifactWriter(store, prefix, data_key=key, metadata={"test": True}, part_size=4096)
    for name, data in entries.items():
        writer.add_bytes(name, data)
    return writer.commit()


# --- object store contract -------------------------------------------------------------------------------


def test_store_contract(store: ObjectStore) -> None:
    assert store.list("") == []
    store.put("b/2", b"two")
    store.put("a/1", b"one")
    store.put("a/10/x", b"ten")
    store.put("ab", b"ab")
    store.put("empty", b"")
    assert store.get("a/1") == b"one" and store.get("empty") == b""
    assert store.exists("a/1") and not store.exists("a/2")
    assert store.list("") == ["a/1", "a/10/x", "ab", "b/2", "empty"]
    assert store.list("a") == ["a/1", "a/10/x", "ab"]
    assert store.list("a/") == ["a/1", "a/10/x"]
    store.put("a/1", b"replaced")
    assert store.get("a/1") == b"replaced"
    with pytest.raises(errors.NotFound):
        store.get("a/2")
    store.delete("a/1")
    store.delete("a/1")
    assert not store.exists("a/1")
    assert store.delete_prefix("a/") == 1
    assert store.delete_prefix("nothing/") == 0
    assert store.list("") == ["ab", "b/2", "empty"]
    with pytest.raises(errors.InvalidArgument):
        store.put("../escape", b"x")
    with pytest.raises(errors.InvalidArgument):
        store.list("/abs")


def test_store_large_object_and_many_keys(store: ObjectStore) -> None:
    blob = os.urandom(9 << 20)
    store.put("big", blob)
    assert hashlib.sha256(store.get("big")).digest() == hashlib.sha256(blob).digest()
    for i in range(30):
        store.put(f"many/{i:03d}", b"x")
    assert store.list("many/") == [f"many/{i:03d}" for i in range(30)]
    assert store.delete_prefix("many/") == 30


# --- artifact contract -------------------------------------------------------------------------------------


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
def test_artifact_round_trip(store: ObjectStore, data_key: DataKey, encrypted: bool) -> None:
    key = data_key if encrypted else None
    entries = {"multi": os.urandom(10_000) + b"\0" * 10_000, "exact": os.urandom(8192), "empty": b""}
    committed = write(store, "sb/snap-1", entries, key)
    manifest = read_manifest(store, "sb/snap-1")
    assert manifest.body() == committed.body() and restorable(store, "sb/snap-1")
    assert [len(manifest.entries[n].parts) for n in entries] == [5, 2, 0]
    verify(store, manifest)
    plain = data_key.plaintext if encrypted else None
    if plain is not None:
        verify(store, manifest, data_key=plain)
    for name, data in entries.items():
        out = io.BytesIO()
        read_entry(store, manifest, name, out, data_key=plain)
        assert out.getvalue() == data
    assert (manifest.encryption is not None) == encrypted


@pytest.mark.parametrize("case", ["flip", "truncate", "missing"])
def test_artifact_corruption_is_detected(store: ObjectStore, data_key: DataKey, case: str) -> None:
    payload = os.urandom(20_000)
    manifest = write(store, "corrupt", {"data": payload}, data_key)
    victim = manifest.entries["data"].parts[3].key
    stored = store.get(victim)
    if case == "flip":
        store.put(victim, stored[:100] + bytes([stored[100] ^ 0x01]) + stored[101:])
    elif case == "truncate":
        store.put(victim, stored[: len(stored) // 2])
    else:
        store.delete(victim)
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext)
    assert caught.value.details["part"] == victim
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        verify(store, manifest)
    assert caught.value.details["part"] == victim


def test_artifact_without_manifest_is_not_restorable(store: ObjectStore, data_key: DataKey) -> None:
    writer = ArtifactWriter(store, "half", data_key=data_key, metadata={}, part_size=1000)
    writer.add_bytes("data", os.urandom(5000))
    assert store.list("half/parts/") and not restorable(store, "half")
    with pytest.raises(errors.NotFound):
        read_manifest(store, "half")
    manifest = write(store, "whole", {"data": b"x"}, data_key)
    store.delete(manifest_key("whole"))
    assert not restorable(store, "whole")
    assert manifest.entries["data"].parts[0].key in store.list("whole/")
    delete_artifact(store, "half")
    delete_artifact(store, "whole")
    assert store.list("") == []


def test_artifact_manifest_tampering_is_detected(store: ObjectStore, data_key: DataKey) -> None:
    write(store, "tamper", {"data": os.urandom(9000)}, data_key)
    raw = store.get(manifest_key("tamper"))
    store.put(manifest_key("tamper"), raw.replace(b'"test": true', b'"test": false'))
    with pytest.raises(errors.ArtifactCorrupt):
        read_manifest(store, "tamper")


def test_encrypted_artifact_holds_no_plaintext(store: ObjectStore, data_key: DataKey) -> None:
    payload = (os.urandom(5000) + CANARY) * 4
    for prefix, key in (("enc", data_key), ("plain", None)):
        writer = ArtifactWriter(store, prefix, data_key=key, metadata={}, part_size=4096, compression="none")
        writer.add_bytes("data", payload)
        writer.commit()
    holding = {k.split("/")[0] for k in store.list("") if CANARY in store.get(k)}
    assert holding == {"plain"}  # the scan finds it where it should, and nowhere else
    assert not any(data_key.plaintext in store.get(k) for k in store.list("enc/"))


# --- S3 specifics ----------------------------------------------------------------------------------------


def test_s3_url_prefixes_isolate_stores(s3_server: S3Server) -> None:
    first = open_store(s3_server.bucket_url(BUCKET, prefix="iso/one"))
    second = open_store(s3_server.bucket_url(BUCKET, prefix="iso/two"))
    first.put("k", b"1")
    second.put("k", b"2")
    assert first.get("k") == b"1" and second.get("k") == b"2" and first.list("") == ["k"]
    raw = s3_server.client().get_object(Bucket=BUCKET, Key="iso/one/k")["Body"].read()
    assert raw == b"1"  # keys land under the URL's prefix in the bucket
    assert first.delete_prefix("") == 1 and second.get("k") == b"2"
    second.delete("k")


def test_s3_errors_are_typed(s3_server: S3Server) -> None:
    missing_bucket = open_store(f"s3://no-such-bucket-space?endpoint={s3_server.endpoint}&region=us-east-1")
    with pytest.raises(errors.NotFound):
        missing_bucket.get("k")
    assert not missing_bucket.exists("k")  # HEAD carries no error body: a missing bucket reads as "absent"
    with pytest.raises(errors.NotFound):
        missing_bucket.list("")
    with pytest.raises(errors.NotFound):
        missing_bucket.put("k", b"x")
    unreachable = S3Store(BUCKET, endpoint_url="http://127.0.0.1:9", region="us-east-1")
    with pytest.raises(errors.Unavailable) as caught:
        unreachable.get("k")
    assert isinstance(caught.value.__cause__, Exception)  # raised `from` the botocore error
    with pytest.raises(errors.InvalidArgument):
        open_store(f"s3://{BUCKET}?endpoint={s3_server.endpoint}&colour=blue")


# --- KMS key service --------------------------------------------------------------------------------------


@pytest.fixture
def kms(s3_server: S3Server) -> Iterator[KmsKeyService]:
    service = open_key_service(s3_server.kms_url)
    assert isinstance(service, KmsKeyService)
    try:
        yield service
    finally:
        service.close()


def test_kms_generate_decrypt_rotate_revoke(kms: KmsKeyService, s3_server: S3Server) -> None:
    key_id = kms.create_key("org-1")
    old = kms.generate_data_key(key_id)
    assert len(old.plaintext) == 32 and old.plaintext not in old.wrapped and old.key_id == key_id
    assert kms.decrypt_data_key(key_id, old.wrapped) == old.plaintext
    kms.rotate_key(key_id)
    client = s3_server.kms_client()
    assert client.get_key_rotation_status(KeyId=key_id)["KeyRotationEnabled"]
    assert len(client.list_key_rotations(KeyId=key_id)["Rotations"]) == 1
    new = kms.generate_data_key(key_id)
    assert kms.decrypt_data_key(key_id, old.wrapped) == old.plaintext  # old data keys still open
    assert kms.decrypt_data_key(key_id, new.wrapped) == new.plaintext
    other = kms.create_key("org-2")
    other_key = kms.generate_data_key(other)
    kms.revoke_key(key_id)
    assert client.describe_key(KeyId=key_id)["KeyMetadata"]["KeyState"] == "Disabled"
    for wrapped in (old.wrapped, new.wrapped):
        with pytest.raises(errors.KeyRevoked):
            kms.decrypt_data_key(key_id, wrapped)
    with pytest.raises(errors.KeyRevoked):
        kms.generate_data_key(key_id)
    assert kms.decrypt_data_key(other, other_key.wrapped) == other_key.plaintext


def test_kms_key_pending_deletion_is_revoked(kms: KmsKeyService, s3_server: S3Server) -> None:
    key_id = kms.create_key()
    wrapped = kms.generate_data_key(key_id).wrapped
    s3_server.kms_client().schedule_key_deletion(KeyId=key_id, PendingWindowInDays=7)
    with pytest.raises(errors.KeyRevoked):
        kms.decrypt_data_key(key_id, wrapped)
    with pytest.raises(errors.KeyRevoked):
        kms.rotate_key(key_id)


def test_kms_errors_are_typed(kms: KmsKeyService) -> None:
    key_id = kms.create_key()
    wrapped = kms.generate_data_key(key_id).wrapped
    with pytest.raises(errors.NotFound):
        kms.decrypt_data_key("00000000-0000-0000-0000-000000000000", wrapped)
    with pytest.raises(errors.ArtifactCorrupt):
        kms.decrypt_data_key(key_id, wrapped[:-1] + bytes([wrapped[-1] ^ 1]))
    other = kms.create_key()
    with pytest.raises((errors.PermissionDenied, errors.ArtifactCorrupt)):
        kms.decrypt_data_key(other, wrapped)  # wrapped by another key
    unreachable = KmsKeyService("http://127.0.0.1:9")
    with pytest.raises(errors.KeyUnavailable):
        unreachable.generate_data_key(key_id)
    unreachable.close()


def test_byok_suspend_style_flow_on_s3_with_kms(s3_server: S3Server, kms: KmsKeyService) -> None:
    """Upload encrypted under a KMS data key, restore by unwrapping from the manifest; revoke -> refused."""
    store = open_store(s3_server.bucket_url(BUCKET, prefix=f"byok-{uuid.uuid4().hex[:8]}"))
    tenant = kms.create_key("tenant")
    payload = os.urandom(30_000) + CANARY
    writer = ArtifactWriter(
        store, "snap", data_key=kms.generate_data_key(tenant), metadata={}, part_size=8192
    )
    writer.add_bytes("checkpoint.img", payload)
    writer.commit()
    manifest = read_manifest(store, "snap")
    assert manifest.encryption is not None and manifest.encryption.key_id == tenant
    plain = kms.decrypt_data_key(manifest.encryption.key_id, manifest.encryption.wrapped)
    assert read_entry_bytes(store, manifest, "checkpoint.img", data_key=plain) == payload
    assert not any(CANARY in store.get(k) for k in store.list(""))
    kms.rotate_key(tenant)
    assert kms.decrypt_data_key(tenant, manifest.encryption.wrapped) == plain
    kms.revoke_key(tenant)
    with pytest.raises(errors.KeyRevoked):
        kms.decrypt_data_key(manifest.encryption.key_id, manifest.encryption.wrapped)
    delete_artifact(store, "snap")
    assert store.list("") == []


# --- crashes ------------------------------------------------------------------------------------------------

_CRASH_WRITER = r"""
import hashlib, os, sys
from space.crypto.envelope import DataKey
from space.objectstore import open_store
from space.objectstore.artifacts import ArtifactWriter

store = open_store(sys.argv[1])
key = DataKey("k", b"w", bytes.fromhex(sys.argv[2]))
i = 0
while True:
    blob = os.urandom(1 << 20)
    store.put("objects/" + hashlib.sha256(blob).hexdigest(), blob)
    writer = ArtifactWriter(store, f"artifacts/a{i:05d}", data_key=key, metadata={}, part_size=64 << 10)
    writer.add_bytes("data", blob)
    writer.add_bytes("digest", hashlib.sha256(blob).hexdigest().encode())
    writer.commit()
    print(i, flush=True)
    i += 1
"""


def test_sigkill_mid_write_leaves_only_whole_objects_and_artifacts(
    store: ObjectStore, data_key: DataKey, tmp_path: Path
) -> None:
    """A writer killed with SIGKILL at a random moment: every object is whole, every artifact with a
    manifest reads back completely, and the rest are not restorable (and the next writer cleans them)."""
    script = tmp_path / "writer.py"
    script.write_text(_CRASH_WRITER)
    child = subprocess.Popen(
        [sys.executable, str(script), store.url, data_key.plaintext.hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        for _ in range(3):  # at least three complete artifacts, then kill mid-way through the next ones
            assert child.stdout.readline(), child.stderr.read() if child.stderr else ""
        time.sleep(0.05 + (os.getpid() % 7) / 100)
    finally:
        child.kill()
        child.wait(timeout=30)
    objects = store.list("objects/")
    assert objects
    for key in objects:
        assert hashlib.sha256(store.get(key)).hexdigest() == key.split("/")[1]  # never a partial object
    prefixes = sorted({key.split("/")[1] for key in store.list("artifacts/")})
    complete = [p for p in prefixes if restorable(store, f"artifacts/{p}")]
    assert len(complete) >= 3 and complete == prefixes[: len(complete)]
    for prefix in complete:
        manifest = read_manifest(store, f"artifacts/{prefix}")
        verify(store, manifest, data_key=data_key.plaintext)
        data = read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext)
        digest = read_entry_bytes(store, manifest, "digest", data_key=data_key.plaintext)
        assert hashlib.sha256(data).hexdigest().encode() == digest
    for prefix in prefixes[len(complete) :]:
        # The interrupted one: not restorable; a new writer on the prefix starts clean and succeeds.
        writer = ArtifactWriter(store, f"artifacts/{prefix}", data_key=data_key, metadata={}, part_size=1024)
        assert store.list(f"artifacts/{prefix}/") == []
        writer.add_bytes("data", b"again")
        manifest = writer.commit()
        assert read_entry_bytes(store, manifest, "data", data_key=data_key.plaintext) == b"again"
