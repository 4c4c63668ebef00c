"""Fuzzing the OCI image unpacker (space.node.volumes.oci_image, oci_layer; ADR 0056): a valid archive of
both formats, with bytes flipped, cut or inserted anywhere (outer headers, manifests, layer headers, layer
data), must unpack or be refused with a typed error (InvalidArgument, TooLarge), never another exception,
and never write outside its tree. Root: the unpacker sets owners."""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from space.core import errors
from space.node.volumes import oci_image
from space.node.volumes.oci_layer import Budget
from tests.support.fuzzing import executed, fuzz_settings
from tests.support.oci_archives import (
    Entry,
    Image,
    directory,
    docker_save,
    file,
    hardlink,
    layer,
    oci_layout,
    symlink,
)

pytestmark = pytest.mark.root

_IMAGE = Image(
    [
        layer(
            [
                directory("usr"),
                directory("usr/bin"),
                file("usr/bin/python3.11", b"#!", mode=0o755),
                symlink("usr/bin/python3", "python3.11"),
                directory("d"),
                file("d/a", b"a" * 700),
                Entry("dev/null", "chr"),
            ]
        ),
        layer(
            [
                file("d/.wh.a", b""),
                file("d/.wh..wh..opq", b""),
                file("d/b", b"b"),
                hardlink("d/h", "d/b"),
                symlink("up", "../../.."),
            ]
        ),
    ],
    config={"config": {"Env": ["A=b"], "WorkingDir": "/d"}},
)
SEEDS = [docker_save(_IMAGE), oci_layout(_IMAGE)]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert", "byte"]))
        if action == "flip":
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif action == "byte":
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif action == "cut":
            del data[at:]
            if not data:
                data.append(0)
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@fuzz_settings(40)
@given(mutated())
def test_mutated_archives_unpack_or_refuse_typed(archive: bytes) -> None:
    if os.geteuid() != 0:
        pytest.fail("the unpacker sets owners: run as root (CI does)")
    executed("oci.unpack")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="space-fuzz-oci-"))
    try:
        (scratch / "root").mkdir()
        (scratch / "outside").mkdir()
        fd = os.open(scratch / "root", os.O_RDONLY | os.O_DIRECTORY)
        try:
            oci_image.unpack(io.BytesIO(archive), fd, Budget(max_bytes=1 << 20, max_entries=1000))
        except (errors.InvalidArgument, errors.TooLarge):
            pass
        finally:
            os.close(fd)
        assert list((scratch / "outside").iterdir()) == []
        assert sorted(p.name for p in scratch.iterdir()) == ["outside", "root"]
    finally:
        shutil.rmtree(scratch)
