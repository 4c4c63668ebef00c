"""`space logs` (ADR 0071) over a local installation's files: JSON and text lines merged by time, filtered by
component (the gateway's lines inside the agent's file), request id and time; `--raw`, `--follow`; and a
hostile line (terminal escapes, rich markup) printed as plain text."""

from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner, Result

from space.cli import logs
from space.cli import main as cli_main
from space.core import errors

NOW = datetime.now(UTC).replace(microsecond=0)  # for pure functions only: the suite may run this much later


def _json(minutes_ago: int, component: str, msg: str, request_id: str | None = None, **extra: str) -> str:
    """A line of `minutes_ago` before the real present (`--since` compares with the clock, not with NOW)."""
    ts = (datetime.now(UTC) - timedelta(minutes=minutes_ago)).isoformat(timespec="milliseconds")
    line = {"ts": ts, "level": "info", "component": component, "logger": f"space.{component}", "msg": msg,
            "request_id": request_id, "sandbox_id": None, "error": None, **extra}  # fmt: skip
    return json.dumps(line)


@pytest.fixture
def data_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "controlplane.log").write_text(
        _json(30, "controlplane", "old line") + "\n"
        + _json(3, "controlplane", "POST /v1/sandboxes/x/exec 200", "req_follow") + "\n"
        + "Traceback (most recent call last): a text line without time\n"
    )  # fmt: skip
    (tmp_path / "agent.log").write_text(
        _json(2, "agent", "POST /node/v1/sandboxes/x/exec 200", "req_follow") + "\n"
        + _json(1, "gateway", "denied example.com", "req_other") + "\n"
    )  # fmt: skip
    (tmp_path / "space.log").write_text(
        json.dumps({"ts": (datetime.now(UTC) - timedelta(minutes=4)).isoformat(), "source": "supervisor",
                    "event": "component.restarted", "component": "agent"}) + "\n"
    )  # fmt: skip
    return tmp_path


def _logs(data_dir: pathlib.Path, *args: str) -> Result:
    return CliRunner().invoke(cli_main.app, ["logs", "--source", "files", "--data-dir", str(data_dir), *args])


def test_one_request_id_follows_a_request_through_the_files(data_dir: pathlib.Path) -> None:
    done = _logs(data_dir, "--request-id", "req_follow", "--raw")
    assert done.exit_code == 0, done.output
    shown = [json.loads(line) for line in done.output.splitlines()]
    assert [(row["component"], row["msg"].split()[1]) for row in shown] == [
        ("controlplane", "/v1/sandboxes/x/exec"), ("agent", "/node/v1/sandboxes/x/exec")
    ]  # fmt: skip


def test_lines_are_merged_by_time_and_filtered_by_component_and_since(data_dir: pathlib.Path) -> None:
    everything = _logs(data_dir).output
    order = ["old line", "component.restarted", "/v1/sandboxes/x/exec", "/node/v1/", "denied example.com"]
    positions = [everything.index(text) for text in order]
    assert positions == sorted(positions), everything
    assert "Traceback" in everything  # a text line is shown as it is
    gateway = _logs(data_dir, "gateway", "--raw").output.splitlines()
    assert [json.loads(line)["msg"] for line in gateway] == ["denied example.com"]
    recent = _logs(data_dir, "--since", "10m", "--raw").output
    assert "old line" not in recent and "denied example.com" in recent
    assert "Traceback" not in recent  # no time: not known to be recent
    supervisor = _logs(data_dir, "supervisor").output
    assert "component.restarted" in supervisor and "exec" not in supervisor


def test_bad_arguments_are_named(data_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert "COMPONENT is one of" in _logs(data_dir, "kernel").output
    assert "--since is a duration" in _logs(data_dir, "--since", "yesterday").output
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no SPACE log files" in _logs(empty).output
    with pytest.raises(errors.InvalidArgument):
        logs.parse_since("10x")
    assert logs.parse_since("2h", NOW) == NOW - timedelta(hours=2)


def test_a_hostile_line_is_plain_text_on_the_terminal(data_dir: pathlib.Path) -> None:
    hostile = _json(0, "agent", "\x1b[2J\x1b]0;owned\x07[bold red]markup[/] \r overwritten", "req_h")
    with (data_dir / "agent.log").open("a") as log:
        log.write(hostile + "\n")
    shown = _logs(data_dir, "--request-id", "req_h").output
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
    assert "[bold red]markup[/]" in shown  # printed literally, not interpreted


def test_the_journal_is_read_for_space_units_only() -> None:
    argv = logs.journal_argv(NOW, follow=True, lines=50)
    assert argv[:4] == ["journalctl", "--output=cat", "--no-pager", "--lines=50"]
    units = {a.removeprefix("--unit=") for a in argv if a.startswith("--unit=")}
    assert units == {"space-controlplane.service", "space-node-helper.service", "space-node-agent.service"}
    assert "--follow" in argv and any(a.startswith("--since=") and a.endswith(" UTC") for a in argv)
    every = logs.journal_argv(None, follow=False, lines=None)  # filtered here: the last matches, not lines
    assert not any(a.startswith(("--lines", "--since")) for a in every) and "--follow" not in every


def test_follow_prints_lines_as_they_are_appended(data_dir: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2] / "src")}
    with subprocess.Popen(
        [sys.executable, "-m", "space.cli.main", "logs", "--source", "files", "--data-dir", str(data_dir),
         "--follow", "--raw", "--request-id", "req_new"],
        stdout=subprocess.PIPE, text=True, env=env,
    ) as follower:  # fmt: skip
        try:
            time.sleep(2)  # it has read the files' ends
            with (data_dir / "agent.log").open("a") as log:
                log.write(_json(0, "agent", "appended later", "req_new") + "\n")
                log.write(_json(0, "agent", "not this one", "req_else") + "\n")
            assert follower.stdout is not None
            ready, _, _ = select.select([follower.stdout], [], [], 30)
            assert ready, "nothing printed within 30 s"
            line = follower.stdout.readline()
            assert json.loads(line)["msg"] == "appended later"
        finally:
            follower.terminate()
            follower.wait(10)
