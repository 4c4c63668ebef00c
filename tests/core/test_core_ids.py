"""Tests of typed ids (space.core.ids): generation, roundtrip, strict rejection."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from space.core import errors, ids

GOOD_BODY = "abcdefghijklmnopqrstuvwxy4"  # 25 of the alphabet, then an allowed final character

KINDS: list[tuple[str, str, Callable[[], str], Callable[..., str], str]] = [
    ("sandbox", "sb-", ids.new_sandbox_id, ids.parse_sandbox_id, ids.SANDBOX_ID_PATTERN),
    ("snapshot", "snap-", ids.new_snapshot_id, ids.parse_snapshot_id, ids.SNAPSHOT_ID_PATTERN),
    ("node", "node-", ids.new_node_id, ids.parse_node_id, ids.NODE_ID_PATTERN),
    ("project", "prj-", ids.new_project_id, ids.parse_project_id, ids.PROJECT_ID_PATTERN),
    ("org", "org-", ids.new_org_id, ids.parse_org_id, ids.ORG_ID_PATTERN),
    ("api_key", "key-", ids.new_api_key_id, ids.parse_api_key_id, ids.API_KEY_ID_PATTERN),
]
KIND_IDS = [k[0] for k in KINDS]


@pytest.mark.parametrize(("name", "prefix", "new", "parse", "pattern"), KINDS, ids=KIND_IDS)
def test_new_ids_roundtrip_and_have_the_documented_shape(
    name: str, prefix: str, new: Callable[[], str], parse: Callable[..., str], pattern: str
) -> None:
    for _ in range(200):
        value = new()
        assert parse(value) == value
        assert value.startswith(prefix)
        body = value[len(prefix) :]
        assert len(body) == 26
        assert set(body) <= set("abcdefghijklmnopqrstuvwxyz234567")
        assert re.fullmatch(pattern, value)
        # the body is exactly the unpadded base32 of 16 bytes
        assert len(base64.b32decode(body.upper() + "======")) == 16


@pytest.mark.parametrize(("name", "prefix", "new", "parse", "pattern"), KINDS, ids=KIND_IDS)
def test_ids_are_unique(
    name: str, prefix: str, new: Callable[[], str], parse: Callable[..., str], pattern: str
) -> None:
    values = {new() for _ in range(5000)}
    assert len(values) == 5000


def test_each_kind_rejects_the_other_kinds() -> None:
    for _, _, new, _, _ in KINDS:
        value = new()
        accepted = [name for name, _, _, parse, _ in KINDS if _accepts(parse, value)]
        assert len(accepted) == 1, (value, accepted)


def _accepts(parse: Callable[..., str], value: object) -> bool:
    try:
        parse(value)
    except errors.InvalidArgument:
        return False
    return True


MALFORMED_SANDBOX_IDS: list[object] = [
    "",
    "sb-",
    "sb",
    "sb-" + GOOD_BODY[:-1],  # 25 characters
    "sb-" + GOOD_BODY + "a",  # 27 characters
    "sb-" + GOOD_BODY.upper(),
    "SB-" + GOOD_BODY,
    "sb-" + GOOD_BODY + "\n",
    "\nsb-" + GOOD_BODY,
    "sb-" + GOOD_BODY[:-1] + "\n",
    " sb-" + GOOD_BODY,
    "sb-" + GOOD_BODY[:10] + "/" + GOOD_BODY[11:],
    "sb-" + GOOD_BODY[:10] + "." + GOOD_BODY[11:],
    "sb-../" + GOOD_BODY[4:],
    "sb-" + GOOD_BODY[:10] + "0" + GOOD_BODY[11:],  # 0, 1, 8, 9 are not base32
    "sb-" + GOOD_BODY[:10] + "8" + GOOD_BODY[11:],
    "sb-" + GOOD_BODY[:-1] + "b",  # non-canonical final character (low bits set)
    "sb-" + GOOD_BODY[:-1] + "=",
    "sb_" + GOOD_BODY,
    "sbx" + GOOD_BODY,
    "snap-" + GOOD_BODY,
    "sb-" + GOOD_BODY[:-1] + "\x00",
    "sb-" + GOOD_BODY[:-1] + "é",
    "sb-" + GOOD_BODY * 1000,
    None,
    42,
    b"sb-" + GOOD_BODY.encode(),
    ["sb-" + GOOD_BODY],
]


@pytest.mark.parametrize("value", MALFORMED_SANDBOX_IDS, ids=repr)
def test_malformed_sandbox_ids_are_rejected_naming_the_field(value: object) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        ids.parse_sandbox_id(value)
    assert info.value.details["field"] == "sandbox_id"
    assert "sandbox_id" in info.value.message
    assert len(info.value.message) < 200  # huge inputs are not echoed back whole
    assert not ids.is_valid_id(ids.SANDBOX, value)


def test_the_good_body_used_above_is_valid() -> None:
    # Guards the malformed cases: each differs from a valid id by exactly the defect it names.
    assert ids.parse_sandbox_id("sb-" + GOOD_BODY) == "sb-" + GOOD_BODY


def test_field_name_can_be_overridden() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        ids.parse_snapshot_id("nope", field="snapshot")
    assert info.value.details["field"] == "snapshot"
    assert info.value.message.startswith("invalid snapshot:")


@given(st.from_regex(re.compile(ids.ID_BODY_PATTERN), fullmatch=True))
def test_the_pattern_accepts_exactly_canonical_encodings(body: str) -> None:
    raw = ids.id_body_bytes(ids.SANDBOX, "sb-" + body)
    assert len(raw) == 16
    assert base64.b32encode(raw).decode().rstrip("=").lower() == body


@given(st.binary(min_size=16, max_size=16))
def test_every_16_byte_value_encodes_to_a_valid_id(raw: bytes) -> None:
    value = "node-" + base64.b32encode(raw).decode().rstrip("=").lower()
    assert ids.parse_node_id(value) == value
    assert ids.id_body_bytes(ids.NODE, value) == raw


def test_exported_patterns_reject_trailing_newline_under_fullmatch() -> None:
    value = ids.new_sandbox_id()
    assert re.fullmatch(ids.SANDBOX_ID_PATTERN, value)
    assert not re.fullmatch(ids.SANDBOX_ID_PATTERN, value + "\n")
    assert "^" not in ids.SANDBOX_ID_PATTERN and "$" not in ids.SANDBOX_ID_PATTERN


@pytest.mark.parametrize("name", ["a", "python", "node-20", "py3-slim", "a" + "b" * 62, "x-"])
def test_valid_template_names(name: str) -> None:
    assert ids.parse_template_name(name) == name
    assert re.fullmatch(ids.TEMPLATE_NAME_PATTERN, name)


@pytest.mark.parametrize(
    "name",
    ["", "Python", "1python", "-python", "py_thon", "py.thon", "py/thon", "python\n", "python ",
     "a" * 64, "..", "pýthon", None, 7],
)  # fmt: skip
def test_invalid_template_names(name: object) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        ids.parse_template_name(name)
    assert info.value.details["field"] == "template"
