"""Fuzzing the parsers of external input outside the channel: ids and template names (space.core.ids),
egress policy entries (space.node.egress.policy), credential specs (space.controlplane.credentials.spec),
snapshot policies (space.core.retention), API request bodies (the gateway's pydantic models), artifact
manifests (space.objectstore.manifest) and btrfs send streams (space.node.volumes.sendstream_check).

Property of every target: only the typed errors the parser documents (errors.InvalidArgument, pydantic's
ValidationError, errors.ArtifactCorrupt, ...), never another exception; a bounded time per input (the
profile's deadline); a round trip where an encoder exists (ids, manifests, policies re-parsed)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from space.controlplane.api import bodies
from space.controlplane.credentials import spec
from space.core import errors, ids
from space.core.retention import SnapshotPolicy
from space.crypto.envelope import mac
from space.node.egress.policy import EgressPolicy, normalize_host, split_authority
from space.node.volumes import sendstream as ss
from space.node.volumes import sendstream_check as ssc
from space.objectstore.manifest import (
    MAC_PURPOSE,
    Encryption,
    Entry,
    Manifest,
    PartRef,
    authenticate,
    parse_manifest,
)
from tests.support import sendstreams as sb
from tests.support.fuzzing import JSON, executed, fuzz_settings

HOSTISH = st.text(alphabet="abcxyz019.-*:/[]%_@ \u00e9\u0131\u200b\uff0e", max_size=30)
ID_KINDS = [ids.SANDBOX, ids.SNAPSHOT, ids.NODE, ids.PROJECT, ids.ORG, ids.API_KEY]


@fuzz_settings(30)
@given(st.sampled_from(ID_KINDS), JSON | st.text(alphabet="sbnpkorg-_0123456789abcdefABCDEF", max_size=40))
def test_ids_parse_or_refuse_typed(kind: ids.IdKind, value: Any) -> None:
    executed("core.ids")
    try:
        parsed = ids.parse_id(kind, value)
    except errors.InvalidArgument:
        assert not ids.is_valid_id(kind, value)
        return
    assert ids.parse_id(kind, parsed) == parsed and ids.is_valid_id(kind, parsed)
    for parse in (ids.parse_template_name, ids.parse_process_id):
        with contextlib.suppress(errors.InvalidArgument):
            parse(value)


@fuzz_settings(30)
@given(JSON | HOSTISH)
def test_template_and_process_ids_refuse_typed(value: Any) -> None:
    executed("core.names")
    for parse in (ids.parse_template_name, ids.parse_process_id):
        with contextlib.suppress(errors.InvalidArgument):
            assert parse(parse(value)) == parse(value)


@fuzz_settings(50)
@given(st.lists(HOSTISH, max_size=4), st.lists(HOSTISH, max_size=3))
def test_egress_policy_entries_parse_or_refuse_typed(allow: list[str], deny: list[str]) -> None:
    executed("egress.policy")
    try:
        policy = EgressPolicy(allow=allow, deny=deny)
    except ValidationError:
        return
    assert EgressPolicy(allow=policy.allow, deny=policy.deny) == policy  # canonical entries are fixed points
    for host in allow:
        with contextlib.suppress(errors.InvalidArgument):
            normalize_host(host)
        with contextlib.suppress(errors.InvalidArgument):
            split_authority(host, 443)


@fuzz_settings(30)
@given(st.lists(HOSTISH | JSON, max_size=3), st.lists(HOSTISH | JSON, max_size=2), JSON | HOSTISH)
def test_credential_specs_refuse_typed(allow: list[Any], deny: list[Any], name: Any) -> None:
    executed("credentials.spec")
    calls = (
        lambda: spec.normalize_policy(allow, deny),
        lambda: spec.normalize_hosts(allow),
        lambda: spec.normalize_private_networks(allow),
        lambda: spec.validate_name(name),
        lambda: spec.validate_env_var(name),
        lambda: spec.normalize_host(name, "host"),
    )
    for call in calls:
        with contextlib.suppress(errors.InvalidArgument):
            call()


BODY_MODELS: list[type[BaseModel]] = [
    model
    for model in vars(bodies).values()
    if isinstance(model, type)
    and issubclass(model, BaseModel)
    and model.__module__ == bodies.__name__
    and not model.__name__.startswith("_")
]


@pytest.mark.parametrize("model", BODY_MODELS, ids=lambda m: m.__name__)
@fuzz_settings(12)
@given(value=st.dictionaries(st.text(max_size=20), JSON, max_size=6) | JSON)
def test_api_bodies_validate_or_refuse_typed(model: type[BaseModel], value: Any) -> None:
    executed(f"api.{model.__name__}")
    try:
        parsed = model.model_validate(value)
    except (ValidationError, errors.InvalidArgument):
        return
    assert model.model_validate(parsed.model_dump()) == parsed


@fuzz_settings(30)
@given(st.dictionaries(st.sampled_from([*list(SnapshotPolicy.model_fields), "x"]), JSON, max_size=5))
def test_snapshot_policies_validate_or_refuse_typed(value: dict[str, Any]) -> None:
    executed("snapshot.policy")
    for parse in (SnapshotPolicy.model_validate, SnapshotPolicy.from_stored):
        try:
            policy = parse(value)
        except ValidationError:
            continue
        assert SnapshotPolicy.model_validate(policy.model_dump()) == policy


PREFIX = "sandboxes/sb-x/s1"
PART = PartRef(f"{PREFIX}/parts/0000/00000000", "ab" * 32, 10, 7)
MANIFEST = Manifest(
    PREFIX, datetime(2026, 1, 2, tzinfo=UTC), {"k": [1, "v"]}, "zstd", None, {"e": Entry(7, (PART,))}, 10
)
GOOD = MANIFEST.to_bytes()


@fuzz_settings(50)
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, len(GOOD)),
)
def test_manifests_parse_exactly_or_refuse_typed(garbles: list[tuple[int, int]], cut: int) -> None:
    executed("objectstore.manifest")
    assert parse_manifest(PREFIX, "k", GOOD).to_bytes() == GOOD  # the round trip
    data = bytearray(GOOD)
    for pos, value in garbles:
        data[pos] = value
    try:
        parsed = parse_manifest(PREFIX, "k", bytes(data[:cut] if cut else data))
    except errors.ArtifactCorrupt:
        return
    assert parsed.canonical_body() == MANIFEST.canonical_body(), "an altered manifest parsed as another one"


@fuzz_settings(30)
@given(JSON)
def test_manifest_documents_refuse_typed(body: Any) -> None:
    executed("objectstore.manifest_json")
    for document in (body, {"manifest": body, "sha256": "0" * 64, "mac": None}):
        with contextlib.suppress(errors.ArtifactCorrupt):
            parse_manifest(PREFIX, "k", json.dumps(document).encode())


SEED = sb.encode([sb.subvol(b"sv"), sb.mkdir(b"d"), sb.mkfile(b"d/f"), sb.write(b"d/f", b"hi"), sb.end()])


@fuzz_settings(50)
@given(
    st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), max_size=6),
    st.integers(0, len(SEED)),
)
def test_send_streams_check_or_refuse_typed(garbles: list[tuple[int, int]], cut: int) -> None:
    executed("volumes.sendstream")
    data = bytearray(SEED)
    for pos, value in garbles:
        data[pos] = value
    with contextlib.suppress(errors.ArtifactCorrupt, errors.NotFound):
        ssc.check_stream(io.BytesIO(bytes(data[:cut] if cut else data)), ss.Expected.full("sv"))


def _every_bit_flipped(data: bytes) -> Iterator[bytes]:
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        yield bytes(flipped)


@pytest.mark.parametrize("encrypted", [False, True])
def test_every_single_flipped_bit_of_a_stored_manifest_is_refused(encrypted: bool) -> None:
    data_key = bytes(range(32))
    manifest = Manifest(PREFIX, MANIFEST.created_at, {"k": 1}, "zstd", None, MANIFEST.entries, 10)
    if encrypted:
        manifest.encryption = Encryption("key-1", b"wrapped")
        manifest.mac = mac(data_key, MAC_PURPOSE, manifest.canonical_body())
    stored = manifest.to_bytes()
    authenticate(parse_manifest(PREFIX, "k", stored), data_key if encrypted else None)  # the original is fine
    accepted = 0
    for flipped in _every_bit_flipped(stored):
        executed("objectstore.manifest_bitflips")
        try:
            authenticate(parse_manifest(PREFIX, "k", flipped), data_key if encrypted else None)
        except errors.ArtifactCorrupt:
            continue
        accepted += 1
    assert accepted == 0, f"{accepted} of {len(stored) * 8} single-bit flips were accepted"
