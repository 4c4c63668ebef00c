"""What the root helper accepts of a microVM checkpoint downloaded from object storage (ADR 0081): the
description's exact fields, types and bounds, QEMU's migration header of the microvm machine, and a staged
directory of exactly the three regular files (no link, no extra entry, nothing the agent still owns)."""

from __future__ import annotations

import os
import pathlib
import struct
from typing import Any

import pytest

from space.core import errors
from space.node.helper import microvm_transfer as mt
from space.node.helper import staging

GOOD_HEADER = b"QEVM" + struct.pack(">I", 3) + b"\x07" + struct.pack(">I", 7) + b"microvm"


def described(**changes: Any) -> dict[str, Any]:
    value: dict[str, Any] = {
        "format": 1, "accel": "tcg", "memory_mb": 512, "vcpus": 1, "kernel": "6.1.0-28-amd64",
        "template": "python", "memory_bytes": 80 << 20, "disk_bytes": 1536 << 20,
    }  # fmt: skip
    value.update(changes)
    return value


def test_a_well_formed_description_is_accepted_as_it_is() -> None:
    assert mt.parse_meta(described()) == described()


@pytest.mark.parametrize(
    "value",
    [
        [],
        "meta",
        described(extra=1),
        {k: v for k, v in described().items() if k != "kernel"},
        described(format=2),
        described(memory_mb=True),  # a bool is not a number here
        described(memory_mb="512"),
        described(memory_mb=64),
        described(vcpus=0),
        described(vcpus=1000),
        described(memory_bytes=-1),
        described(memory_bytes=1 << 60),
        described(disk_bytes=0),
        described(disk_bytes=1 << 40),
        described(kernel="../../etc/passwd"),
        described(kernel="x" * 200),
        described(template=""),
        described(accel="tcg\n"),
        described(accel=None),
    ],
)
def test_every_malformed_description_is_artifact_corrupt(value: object) -> None:
    with pytest.raises(errors.ArtifactCorrupt) as caught:
        mt.parse_meta(value)
    assert caught.value.details["reason"] == "meta"


def test_the_microvm_migration_header_is_required() -> None:
    mt.check_memory_header(GOOD_HEADER)
    for bad in (
        b"",
        b"QEVM",
        b"XEVM" + GOOD_HEADER[4:],
        GOOD_HEADER[:4] + struct.pack(">I", 2) + GOOD_HEADER[8:],  # another stream version
        GOOD_HEADER[:8] + b"\x01" + GOOD_HEADER[9:],  # no configuration section first
        GOOD_HEADER[:9] + struct.pack(">I", 6) + b"microv",
        GOOD_HEADER[:-7] + b"q35\x00\x00\x00\x00",  # another machine
    ):
        with pytest.raises(errors.ArtifactCorrupt) as caught:
            mt.check_memory_header(bad)
        assert caught.value.details["reason"] == "memory_header", bad


def test_another_nodes_machine_is_runtime_incompatible_naming_the_field() -> None:
    local = {"accel": "tcg", "memory_mb": 512, "vcpus": 1, "kernel": "6.1.0-28-amd64"}
    mt._check_compatible(described(), local, "python", "tcg")
    for field, value in (("accel", "kvm"), ("memory_mb", 1024), ("vcpus", 2), ("kernel", "6.1.0-9-amd64")):
        with pytest.raises(errors.RuntimeIncompatible) as caught:
            mt._check_compatible(described(**{field: value}), local, "python", "tcg")
        assert caught.value.details["field"] == field
    with pytest.raises(errors.InvalidArgument):
        mt._check_compatible(described(template="other"), local, "python", "tcg")


def _staged(tmp_path: pathlib.Path) -> pathlib.Path:
    image = tmp_path / "image"
    image.mkdir()
    for name in mt.STAGED_NAMES:
        (image / name).write_bytes(b"x")
    return image


@pytest.mark.root
def test_a_staged_directory_must_hold_exactly_three_plain_files(tmp_path: pathlib.Path) -> None:
    image = _staged(tmp_path)
    staging.take_ownership(image)
    os.close(mt._open_owned_dir(image))

    (image / "extra").write_bytes(b"")
    with pytest.raises(errors.ArtifactCorrupt):
        mt._open_owned_dir(image)
    (image / "extra").unlink()

    (image / mt.DISK).unlink()
    (image / mt.DISK).symlink_to("/etc/shadow")
    with pytest.raises(errors.ArtifactCorrupt):
        mt._open_owned_dir(image)
    (image / mt.DISK).unlink()

    (image / mt.DISK).mkdir()
    with pytest.raises(errors.ArtifactCorrupt):
        mt._open_owned_dir(image)


@pytest.mark.root
def test_a_directory_the_agent_still_owns_is_not_read(tmp_path: pathlib.Path) -> None:
    image = _staged(tmp_path)
    os.chown(image, 12345, 12345)
    with pytest.raises(errors.RuntimeFailure):
        mt._open_owned_dir(image)
    link = tmp_path / "link"
    link.symlink_to(image)
    with pytest.raises(OSError):
        mt._open_owned_dir(link)
