"""`space node join`'s checks of this machine (space.cli.node_join): what a node needs, found on PATH."""

from __future__ import annotations

import pathlib

import pytest

from space.cli.node_join import PREREQUISITES, install_prerequisites, missing_prerequisites
from space.core import errors


def test_every_missing_command_is_named_with_its_package(tmp_path: pathlib.Path) -> None:
    assert missing_prerequisites(path=str(tmp_path)) == PREREQUISITES
    for command in PREREQUISITES:
        tool = tmp_path / command
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    (tmp_path / "runsc").chmod(0o644)  # not executable: still missing
    assert missing_prerequisites(path=str(tmp_path)) == {"runsc": PREREQUISITES["runsc"]}


def test_runsc_alone_is_never_installed_with_apt(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr("subprocess.run", lambda argv, **_kw: ran.append(argv))
    install_prerequisites({"runsc": PREREQUISITES["runsc"]})
    assert ran == []


def test_a_failed_install_says_what_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "apt-get"
    fake.write_text("#!/bin/sh\necho 'E: no mirror' >&2\nexit 100\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(errors.RuntimeFailure, match="apt-get update -qq failed: E: no mirror"):
        install_prerequisites({"nft": "nftables"})
