"""The node's secret files (space.node.agent.identity, ADR 0021): made owner-only, kept across starts, and
refused rather than used when others can read them, when they are symlinks or malformed."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from space.core import errors
from space.node.agent.identity import (
    NodeIdentity,
    default_identity_file,
    default_rpc_token_file,
    load_or_create_rpc_token,
    read_private,
)


def test_the_rpc_token_is_made_once_owner_only_and_kept(tmp_path: pathlib.Path) -> None:
    path = default_rpc_token_file(tmp_path)
    token = load_or_create_rpc_token(path)
    assert len(token) >= 32
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert load_or_create_rpc_token(path) == token  # the next start uses it again
    other = load_or_create_rpc_token(default_rpc_token_file(tmp_path / "another-node"))
    assert other != token


def test_secret_files_that_others_can_read_or_that_are_links_are_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "rpc.token"
    path.write_text("x" * 40)
    path.chmod(0o644)
    with pytest.raises(errors.PermissionDenied, match="readable by others"):
        load_or_create_rpc_token(path)
    path.chmod(0o640)
    with pytest.raises(errors.PermissionDenied):
        read_private(path)
    path.chmod(0o600)
    assert read_private(path) == "x" * 40
    link = tmp_path / "link.token"
    link.symlink_to(path)
    with pytest.raises(errors.PermissionDenied):
        read_private(link)
    assert read_private(tmp_path / "absent") is None


def test_a_short_operator_token_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "rpc.token"
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(errors.InvalidArgument):
        load_or_create_rpc_token(path)


def test_the_identity_is_persisted_before_use_and_loaded_at_the_next_start(tmp_path: pathlib.Path) -> None:
    path = default_identity_file(tmp_path)
    fresh = NodeIdentity.load(path)
    assert not fresh.enrolled and fresh.node_id is None and fresh.secret is None
    fresh.set("node-abc", "s" * 40)
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text()) == {"node_id": "node-abc", "identity": "s" * 40}
    again = NodeIdentity.load(path)
    assert again.enrolled and (again.node_id, again.secret) == ("node-abc", "s" * 40)
    assert "s" * 40 not in repr(again)  # never in a log line
    with pytest.raises(ValueError):
        again.set("", "secret")
    assert (again.node_id, again.secret) == ("node-abc", "s" * 40)  # unchanged by a refused set
    # No temporary file left next to it.
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize("content", ["{", "[]", '{"node_id": "n"}', "null"])
def test_a_malformed_identity_file_is_refused(tmp_path: pathlib.Path, content: str) -> None:
    path = tmp_path / "node.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content.encode())
    os.close(fd)
    with pytest.raises(errors.InvalidArgument, match="malformed"):
        NodeIdentity.load(path)
