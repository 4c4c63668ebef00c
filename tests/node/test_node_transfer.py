"""The transfer verbs and the agent's download refuse what they must, before any side effect (no btrfs
needed): bad arguments, symlinks planted in staging, foreign entry names in a manifest, things that are
not send streams."""

from __future__ import annotations

import io
import pathlib
import struct
from collections.abc import Mapping

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.node.agent import transfer as agent_transfer
from space.node.helper import staging
from space.node.helper.context import HelperContext
from space.node.helper.server import dispatch
from space.node.volumes import sendstream
from space.objectstore.artifacts import ArtifactWriter, read_manifest
from space.objectstore.backends import open_store
from tests.support import helper_context

ctx = helper_context.ctx  # a helper context without root


def _answer(ctx: HelperContext, verb: str, args: Mapping[str, object]) -> dict[str, object]:
    return dispatch(ctx, {"verb": verb, "args": args}, lambda _line: None)


def _code(answer: dict[str, object]) -> str:
    assert answer["ok"] is False, answer
    error = answer["error"]
    assert isinstance(error, dict)
    return str(error["code"])


def test_transfer_verbs_validate_their_arguments(ctx: HelperContext) -> None:
    sid, snap = new_sandbox_id(), new_snapshot_id()
    assert _code(_answer(ctx, "snapshot.export", {"sandbox_id": "../etc", "snapshot_id": snap})) == (
        "invalid_argument"
    )
    assert _code(_answer(ctx, "staging.prepare", {"kind": "elsewhere"})) == "invalid_argument"
    export = {"kind": "export", "sandbox_id": sid, "snapshot_id": snap}
    assert _code(_answer(ctx, "staging.prepare", export)) == "invalid_argument"  # exports are the helper's
    bad_import = {"sandbox_id": sid, "snapshot_id": snap, "env": {"BAD NAME": "x"}}
    assert _code(_answer(ctx, "snapshot.import", bad_import)) == "invalid_argument"
    extra = {"sandbox_id": sid, "snapshot_id": snap, "path": "/etc/shadow"}
    assert _code(_answer(ctx, "snapshot.import", extra)) == "invalid_argument"
    assert _code(_answer(ctx, "staging.release", {"kind": "import"})) == "invalid_argument"  # ids needed


@pytest.mark.root  # take_ownership chowns what it accepts, which needs root
def test_staged_files_are_never_followed_through_symlinks(tmp_path: pathlib.Path) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    secret.chmod(0o644)
    (staged / "disk.stream").symlink_to(secret)
    with pytest.raises(errors.InvalidArgument), staging.open_staged(staged, "disk.stream"):
        pass
    image = staged / "image"
    image.mkdir()
    (image / "checkpoint.img").symlink_to(secret)
    with pytest.raises(errors.InvalidArgument):
        staging.take_ownership(image)
    assert secret.stat().st_mode & 0o777 == 0o644, "a chmod went through the planted link"
    (staged / "linked-dir").symlink_to(image)
    with pytest.raises(errors.InvalidArgument):
        staging.take_ownership(staged / "linked-dir")
    with pytest.raises(errors.InvalidArgument):
        staging.image_files(staged / "linked-dir")


def test_send_stream_header_is_parsed_and_garbage_refused() -> None:
    with pytest.raises(errors.ArtifactCorrupt):
        sendstream.read_header(io.BytesIO(b"not a stream at all, certainly not btrfs"))
    uuid, parent = bytes(range(16)), bytes(range(16, 32))
    attrs = b"".join(
        struct.pack("<HH", kind, len(value)) + value
        for kind, value in (
            (1, uuid), (2, struct.pack("<Q", 7)), (15, b"sn-x"), (20, parent), (21, struct.pack("<Q", 3))
        )
    )  # fmt: skip
    command = struct.pack("<IHI", len(attrs), 2, 0) + attrs
    command = command[:6] + struct.pack("<I", sendstream.command_crc(command)) + command[10:]
    stream = b"btrfs-stream\0" + struct.pack("<I", 1) + command
    header = sendstream.read_header(io.BytesIO(stream))
    assert header.kind == "delta" and header.name == "sn-x"
    assert header.uuid == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert header.parent_uuid == "10111213-1415-1617-1819-1a1b1c1d1e1f"
    with pytest.raises(errors.ArtifactCorrupt):
        sendstream.read_header(io.BytesIO(stream[:30]))


def test_download_refuses_entry_names_outside_the_known_set(tmp_path: pathlib.Path) -> None:
    store = open_store((tmp_path / "objects").as_uri())
    writer = ArtifactWriter(store, "evil/a1", data_key=None, metadata={})
    writer.add_bytes("escape", b"x")  # a valid key segment, but not something a checkpoint holds
    writer.commit()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(errors.ArtifactCorrupt):
        agent_transfer.download(store, read_manifest(store, "evil/a1"), out, data_key=None, skip=set())
    assert list(out.iterdir()) == []
    for name in ("disk.stream", "image/checkpoint.img", "sandbox.json", "base.stream"):
        assert agent_transfer.ENTRY_NAME.fullmatch(name)
    for name in ("../x", "image/../x", "image/.hidden", "image/a/b", "/abs"):
        assert agent_transfer.ENTRY_NAME.fullmatch(name) is None
