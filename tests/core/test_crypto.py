"""Envelope encryption and the local key service: round trips, tamper detection, rotation, revocation."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from space.core import errors
from space.crypto.envelope import DataKey, derive_key, open_sealed, seal
from space.crypto.keys import KmsKeyService, LocalKeyService, open_key_service

KEY = bytes(range(32))


def test_seal_round_trip_and_layout() -> None:
    sealed = seal(KEY, b"secret payload", b"aad")
    assert len(sealed) == 12 + len(b"secret payload") + 16
    assert b"secret payload" not in sealed
    assert open_sealed(KEY, sealed, b"aad") == b"secret payload"
    # A fresh nonce per seal: the same plaintext never produces the same bytes twice.
    assert seal(KEY, b"secret payload", b"aad") != sealed


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda s: s[:-1], id="truncated"),
        pytest.param(lambda s: s[:5], id="shorter-than-overhead"),
        pytest.param(lambda s: s[:20] + bytes([s[20] ^ 1]) + s[21:], id="flipped-bit"),
        pytest.param(lambda s: bytes([s[0] ^ 0x80]) + s[1:], id="flipped-nonce"),
    ],
)
def test_open_rejects_altered_data(mutate) -> None:  # type: ignore[no-untyped-def]
    sealed = seal(KEY, b"x" * 100, b"aad")
    with pytest.raises(errors.ArtifactCorrupt):
        open_sealed(KEY, mutate(sealed), b"aad")


def test_open_rejects_wrong_aad_and_wrong_key() -> None:
    sealed = seal(KEY, b"payload", b"prefix|entry|0")
    with pytest.raises(errors.ArtifactCorrupt):
        open_sealed(KEY, sealed, b"prefix|entry|1")
    with pytest.raises(errors.ArtifactCorrupt):
        open_sealed(os.urandom(32), sealed, b"prefix|entry|0")


def test_key_length_is_checked() -> None:
    with pytest.raises(errors.InvalidArgument):
        seal(b"short", b"x", b"")
    with pytest.raises(errors.InvalidArgument):
        DataKey(key_id="k", wrapped=b"w", plaintext=b"\0" * 16)


def test_data_key_repr_hides_plaintext() -> None:
    key = DataKey(key_id="k1", wrapped=b"wrapped", plaintext=KEY)
    assert repr(KEY) not in repr(key)


def test_derived_keys_differ_per_purpose() -> None:
    assert derive_key(KEY, "a") != derive_key(KEY, "b")
    assert derive_key(KEY, "a") == derive_key(KEY, "a")
    assert derive_key(KEY, "a") != KEY


@pytest.fixture
def keys(tmp_path: Path) -> LocalKeyService:
    return LocalKeyService(tmp_path / "keys")


def test_local_generate_and_decrypt(keys: LocalKeyService, tmp_path: Path) -> None:
    key_id = keys.create_key("org-1")
    data_key = keys.generate_data_key(key_id)
    assert data_key.key_id == key_id and len(data_key.plaintext) == 32
    assert data_key.plaintext not in data_key.wrapped
    assert keys.decrypt_data_key(key_id, data_key.wrapped) == data_key.plaintext
    assert keys.generate_data_key(key_id).plaintext != data_key.plaintext
    # A second service on the same directory (another process, a restart) opens it too.
    assert LocalKeyService(tmp_path / "keys").decrypt_data_key(key_id, data_key.wrapped) == data_key.plaintext


def test_local_key_files_are_private(keys: LocalKeyService) -> None:
    key_id = keys.create_key()
    assert stat.S_IMODE(keys.directory.stat().st_mode) == 0o700
    key_dir = keys.directory / key_id
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    for name in ("v1.key", "meta.json"):
        assert stat.S_IMODE((key_dir / name).stat().st_mode) == 0o600
    assert (key_dir / "v1.key").stat().st_size == 32


def test_local_rotation_keeps_old_data_keys_readable(keys: LocalKeyService) -> None:
    key_id = keys.create_key()
    old = keys.generate_data_key(key_id)
    keys.rotate_key(key_id)
    keys.rotate_key(key_id)
    new = keys.generate_data_key(key_id)
    assert old.wrapped[4:8] == (1).to_bytes(4, "big")
    assert new.wrapped[4:8] == (3).to_bytes(4, "big")
    assert keys.decrypt_data_key(key_id, old.wrapped) == old.plaintext
    assert keys.decrypt_data_key(key_id, new.wrapped) == new.plaintext


def test_local_revocation_destroys_material(keys: LocalKeyService) -> None:
    key_id = keys.create_key()
    wrapped_v1 = keys.generate_data_key(key_id).wrapped
    keys.rotate_key(key_id)
    wrapped_v2 = keys.generate_data_key(key_id).wrapped
    other = keys.create_key()
    other_key = keys.generate_data_key(other)
    keys.revoke_key(key_id)
    assert list((keys.directory / key_id).glob("v*.key")) == []
    for wrapped in (wrapped_v1, wrapped_v2):
        with pytest.raises(errors.KeyRevoked):
            keys.decrypt_data_key(key_id, wrapped)
    with pytest.raises(errors.KeyRevoked):
        keys.generate_data_key(key_id)
    with pytest.raises(errors.KeyRevoked):
        keys.rotate_key(key_id)
    keys.revoke_key(key_id)  # idempotent
    # Other tenants' keys are untouched.
    assert keys.decrypt_data_key(other, other_key.wrapped) == other_key.plaintext


def test_local_revocation_holds_even_if_metadata_is_restored(keys: LocalKeyService) -> None:
    """The material is gone, not just flagged: restoring an old meta.json does not bring the data back."""
    key_id = keys.create_key()
    wrapped = keys.generate_data_key(key_id).wrapped
    meta_before = (keys.directory / key_id / "meta.json").read_bytes()
    keys.revoke_key(key_id)
    (keys.directory / key_id / "meta.json").write_bytes(meta_before)
    with pytest.raises((errors.NotFound, errors.KeyRevoked)):
        keys.decrypt_data_key(key_id, wrapped)


def test_local_errors(keys: LocalKeyService) -> None:
    key_id = keys.create_key()
    other = keys.create_key()
    wrapped = keys.generate_data_key(key_id).wrapped
    with pytest.raises(errors.NotFound):
        keys.decrypt_data_key("lk-" + "0" * 32, wrapped)
    with pytest.raises(errors.NotFound):
        keys.generate_data_key("../etc")
    with pytest.raises(errors.NotFound):
        keys.revoke_key("lk-" + "1" * 32)
    with pytest.raises(errors.ArtifactCorrupt):
        keys.decrypt_data_key(other, wrapped)  # wrapped by another key
    tampered = wrapped[:-1] + bytes([wrapped[-1] ^ 1])
    with pytest.raises(errors.ArtifactCorrupt):
        keys.decrypt_data_key(key_id, tampered)
    with pytest.raises(errors.ArtifactCorrupt):
        keys.decrypt_data_key(key_id, b"garbage")
    future_version = wrapped[:4] + (9).to_bytes(4, "big") + wrapped[8:]
    with pytest.raises(errors.NotFound):
        keys.decrypt_data_key(key_id, future_version)


def test_open_key_service_urls(tmp_path: Path) -> None:
    local = open_key_service(f"local://{tmp_path}/k")
    assert isinstance(local, LocalKeyService) and local.directory == tmp_path / "k"
    kms = open_key_service("kms://?endpoint=http://127.0.0.1:1&region=eu-west-1")
    assert isinstance(kms, KmsKeyService)
    assert kms.endpoint_url == "http://127.0.0.1:1" and kms.region == "eu-west-1"
    kms.close()
    for bad in ("local://relative", "vault://x", "kms://?bogus=1", "local://host/abs"):
        with pytest.raises(errors.InvalidArgument):
            open_key_service(bad)


@pytest.mark.parametrize(
    ("cls", "code", "status"),
    [
        (errors.ArtifactCorrupt, "artifact_corrupt", 502),
        (errors.KeyRevoked, "key_revoked", 403),
        (errors.KeyUnavailable, "key_unavailable", 503),
    ],
)
def test_new_errors_have_codes_statuses_and_wire_form(
    cls: type[errors.SpaceError], code: str, status: int
) -> None:
    from space.rest.errors import status_for

    error = cls("boom", part="p/1", reason="truncated")
    assert error.code == code and status_for(error) == status
    rebuilt = errors.error_from_dict(error.to_dict())
    assert type(rebuilt) is cls and rebuilt.details == {"part": "p/1", "reason": "truncated"}
