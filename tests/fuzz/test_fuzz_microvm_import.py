"""Fuzzing what the root helper reads of a microVM checkpoint from object storage before QEMU sees it
(space.node.helper.microvm_transfer, ADR 0081): the description (`meta.json`) and the memory image's
header. Only ArtifactCorrupt, never another exception; what is accepted is exactly a well-formed value.
(QEMU's own migration parser, which reads the rest of the stream, is the fuzz target ADR 0081 leaves
open: it needs the jailed QEMU, not this process.)"""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from space.core import errors
from space.node.helper import microvm_transfer as mt
from tests.support.fuzzing import JSON, executed, fuzz_settings

GOOD = {
    "format": 1, "accel": "tcg", "memory_mb": 512, "vcpus": 1, "kernel": "6.1.0-28-amd64",
    "template": "python", "memory_bytes": 80 << 20, "disk_bytes": 1536 << 20,
}  # fmt: skip
HEADER = mt.MIGRATION_HEADER + bytes([mt.CONFIGURATION_SECTION]) + struct.pack(">I", 7) + b"microvm"


@fuzz_settings(60)
@given(
    st.dictionaries(st.sampled_from([*GOOD, "extra"]), JSON | st.integers(), max_size=9)
    | st.builds(lambda k, v: {**GOOD, k: v}, st.sampled_from(list(GOOD)), JSON | st.integers())
    | JSON
)
def test_a_description_parses_exactly_or_is_artifact_corrupt(value: Any) -> None:
    executed("microvm.meta")
    try:
        parsed = mt.parse_meta(value)
    except errors.ArtifactCorrupt:
        return
    assert parsed == value and set(parsed) == set(GOOD)
    assert all(type(parsed[k]) is type(GOOD[k]) for k in GOOD)


def _one_byte_changed(index: int, value: int) -> bytes:
    return HEADER[:index] + bytes([value]) + HEADER[index + 1 :]


@fuzz_settings(60)
@given(
    st.binary(max_size=40)
    | st.builds(_one_byte_changed, st.integers(0, len(HEADER) - 1), st.integers(0, 255))
)
def test_a_memory_header_is_the_microvm_one_or_artifact_corrupt(head: bytes) -> None:
    executed("microvm.memory_header")
    try:
        mt.check_memory_header(head)
    except errors.ArtifactCorrupt:
        assert head[: len(HEADER)] != HEADER
        return
    assert head.startswith(HEADER)
