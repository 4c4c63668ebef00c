"""The one version every component reports (space.core.versions, ADR 0079): the package's, or the
documented override; a bad override is refused by name, a peer's bad report is no report."""

from __future__ import annotations

import importlib.metadata

import pytest
from typer.testing import CliRunner

from space.cli import main as cli
from space.core import errors, versions


def test_the_package_version_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    assert versions.space_version() == importlib.metadata.version("space-sandbox")
    monkeypatch.setenv(versions.OVERRIDE_ENV, "2.0.0rc1+build.7")
    assert versions.space_version() == "2.0.0rc1+build.7"
    monkeypatch.setenv(versions.OVERRIDE_ENV, "")  # empty: no override
    assert versions.space_version() == importlib.metadata.version("space-sandbox")


@pytest.mark.parametrize("bad", ["1.0 beta", "-1", "x" * 65, "1.0\n2.0", "../1", '1"}'])
def test_a_bad_override_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(versions.OVERRIDE_ENV, bad)
    with pytest.raises(errors.InvalidArgument, match=versions.OVERRIDE_ENV):
        versions.space_version()


@pytest.mark.parametrize(
    "raw", [None, 2, ["1.0"], {"v": 1}, "", "x" * 65, "1.0 beta", "1.0\nforged", "<script>", "1.0\x00"]
)
def test_a_peer_s_bad_report_is_no_report(raw: object) -> None:
    assert versions.parse_reported(raw) is None


def test_a_peer_s_version_is_kept() -> None:
    assert versions.parse_reported("0.1.0") == "0.1.0"
    assert versions.parse_reported("99.0.0-next") == "99.0.0-next"


def test_space_version_prints_the_reported_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(versions.OVERRIDE_ENV, "3.1.4")
    done = CliRunner().invoke(cli.app, ["--version"])
    assert done.exit_code == 0 and done.output == "space 3.1.4\n"
    monkeypatch.setenv(versions.OVERRIDE_ENV, "not a version")
    refused = CliRunner().invoke(cli.app, ["--version"])
    assert refused.exit_code == 2 and versions.OVERRIDE_ENV in refused.output
