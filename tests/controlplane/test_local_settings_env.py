"""`space up` hands the settings variables on (ADR 0070): the processes LocalCluster starts see every
SPACE_* variable of the control plane's and the agent's settings that it was given, and nothing else of
its environment; `space up --config` refuses a bad file before it starts anything."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from space.controlplane.local import LocalCluster
from tests.support import cluster as c


def test_spawned_processes_see_the_settings_variables_only(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPACE_API_REQUESTS_PER_S", "5")  # the control plane's
    monkeypatch.setenv("SPACE_NODE_HEARTBEAT_INTERVAL_S", "2")  # the agent's
    monkeypatch.setenv("SPACE_UNRELATED_SECRET", "x")  # not a setting: stays here
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    cluster = LocalCluster(tmp_path)
    process = cluster._spawn("env", ["env"])
    assert process.wait(30) == 0
    seen = dict(line.split("=", 1) for line in (tmp_path / "env.log").read_text().splitlines() if "=" in line)
    assert seen["SPACE_API_REQUESTS_PER_S"] == "5"
    assert seen["SPACE_NODE_HEARTBEAT_INTERVAL_S"] == "2"
    assert "SPACE_UNRELATED_SECRET" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen


@pytest.mark.parametrize(
    ("text", "expected"),
    [("[controlplane]\napi_requests_per_s = -1\n", "api_requests_per_s"), ("[nodes]\n", "unknown section")],
)
def test_space_up_refuses_a_bad_config_file_first(tmp_path: pathlib.Path, text: str, expected: str) -> None:
    config = tmp_path / "space.toml"
    config.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "space.cli.main", "up", "--data-dir", str(tmp_path / "data"), "--config",
         str(config)],
        capture_output=True, text=True, timeout=60, env=c._child_env(), cwd=c.REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and str(config) in done.stderr
    assert not (tmp_path / "data").exists()
