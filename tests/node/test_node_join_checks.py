"""`space node join`'s checks of this machine (space.cli.node_join): what a node needs, found on PATH."""

from __future__ import annotations

import argparse
import pathlib

import pytest
from typer.testing import CliRunner, Result

from space.cli import main as cli
from space.cli.node_join import (
    PREREQUISITES,
    agent_environment,
    install_prerequisites,
    missing_prerequisites,
)
from space.core import errors, process_env
from space.core.node_cgroups import parse_cgroup_parent
from space.node.local import HELPER_ENV


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


# -- what the join hands its processes, and what it refuses before starting any (ADR 0079) ------------------
def test_the_agent_and_the_helper_get_the_process_wide_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    passed = {"SPACE_LOG_FORMAT": "json", "SPACE_TRACE_SAMPLE": "0.5", "SPACE_TRACING": "off",
              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.example.com:4318",
              "SPACE_VERSION_OVERRIDE": "2.0.0"}  # fmt: skip
    for name, value in passed.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPACE_API_KEY", "sk-not-for-the-node")  # not a setting of the node's processes
    monkeypatch.setenv("UNRELATED_SECRET", "nope")
    env = agent_environment(None)
    assert {name: env.get(name) for name in passed} == passed
    assert "SPACE_API_KEY" not in env and "UNRELATED_SECRET" not in env
    assert set(process_env.PASSED_ON) <= set(HELPER_ENV)  # the helper is started with the same ones


def _join(*argv: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.app, ["node", "join", *argv], env=env)


BAD_CGROUP_PARENTS = [
    "../escape",
    "space/../../system.slice",
    "node1",
    "space_" + "x",
    "space" + "a" * 41,
    "",
    "space-x\\nforged",
]


@pytest.mark.parametrize("bad", BAD_CGROUP_PARENTS)
def test_a_cgroup_parent_the_helper_refuses_stops_the_join_before_anything_starts(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    started: list[object] = []

    def start_helper(self: object) -> None:
        started.append(self)

    monkeypatch.setattr("space.cli.node_join.JoinedNode.start_helper", start_helper)
    monkeypatch.setattr("space.cli.node_join.probe_control_plane", lambda *a, **k: started.append(a))
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncgroup_parent = "{bad}"\n')
    data_dir = tmp_path / "node"
    done = _join("https://cp.example.com", "--token", "t" * 32, "--config", str(config),
                 "--data-dir", str(data_dir))  # fmt: skip
    assert done.exit_code != 0 and "cgroup_parent" in done.output, done.output
    assert "'space' followed by at most 40 characters" in done.output, done.output
    assert started == [] and not data_dir.exists()
    by_env = _join("https://cp.example.com", "--token", "t" * 32, "--data-dir", str(data_dir),
                   env={"SPACE_NODE_CGROUP_PARENT": bad})  # fmt: skip
    if bad:  # (an empty variable is no setting: the default applies, and the join goes on to its checks)
        assert by_env.exit_code != 0 and "SPACE_NODE_CGROUP_PARENT" in by_env.output, by_env.output
    assert started == [] or bad == ""


def test_the_helper_and_the_join_take_the_same_cgroup_parents() -> None:
    """One validator (space.core.node_cgroups): what the join accepts the helper takes, and the reverse."""
    from space.node.helper import server

    for good in ("space", "space-node-2", "space" + "a" * 40):
        assert server._cgroup_parent(good) == good == parse_cgroup_parent(good)
    for bad in BAD_CGROUP_PARENTS:
        with pytest.raises(argparse.ArgumentTypeError):
            server._cgroup_parent(bad)
        with pytest.raises(errors.InvalidArgument):
            parse_cgroup_parent(bad)
