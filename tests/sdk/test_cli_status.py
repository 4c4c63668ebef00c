"""`space status` without a running SPACE (space.cli.status): what the status file and the database say,
uptime only while the supervisor lives, exit codes (0 running, 6 not), `--json` prints JSON only, and a
damaged or hostile status file neither crashes it nor makes `space down`/`space up` signal a process that is
not this installation's (space.cli.installation.stop_leftovers checks the command line, not just the pid)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import time

from typer.testing import CliRunner

from space.cli import main as cli_main
from space.cli.installation import stop_leftovers
from space.cli.status import collect, render
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.controlplane.supervisor import STATUS_FILENAME
from tests.support.cluster import wait_for

runner = CliRunner()


def write_status(
    data_dir: pathlib.Path, rows: list[dict[str, object]], url: str = "http://127.0.0.1:9"
) -> None:
    (data_dir / STATUS_FILENAME).write_text(json.dumps({"url": url, "components": rows}))


def row(name: str, pid: int | None, started_at: float | None, **extra: object) -> dict[str, object]:
    return {
        "name": name, "pid": pid, "state": "running", "started_at": started_at, "restarts": 0,
        "last_exit": None, "last_exit_at": None, "next_start_at": None, "failures": 0, **extra,
    }  # fmt: skip


def test_uptime_and_health_while_the_supervisor_lives(tmp_path: pathlib.Path) -> None:
    now = time.time()
    (tmp_path / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": "http://127.0.0.1:9"}))
    write_status(tmp_path, [row("helper", 11, now - 3725, restarts=2, last_exit="signal SIGKILL")])
    report = collect(tmp_path, now=now)
    assert report["running"] is True and report["supervisor_pid"] == os.getpid()
    [helper] = report["components"]
    assert helper["uptime_s"] == 3725.0 and helper["restarts"] == 2
    # Port 9 (discard) on loopback: nothing listens, the health check says so instead of failing.
    assert report["controlplane"]["health"] == "unreachable"
    assert report["nodes"] is None and report["sources"]["nodes"] == "database"
    text = render(report)
    assert "1h02m05s" in text and "signal SIGKILL" in text and "unreachable" in text


def test_not_running_exit_code_and_json_only(tmp_path: pathlib.Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "print(__import__('os').getpid())"], capture_output=True, check=True
    )
    (tmp_path / "up.json").write_text(json.dumps({"pid": int(dead.stdout)}))
    write_status(tmp_path, [row("agent", 12, time.time() - 5)])
    result = runner.invoke(cli_main.app, ["status", "--data-dir", str(tmp_path), "--json"])
    assert result.exit_code == 6, result.output
    report = json.loads(result.stdout)  # JSON only
    assert report["running"] is False and report["supervisor_pid"] is None
    assert report["components"][0]["uptime_s"] is None  # a dead supervisor's file is not a live uptime
    assert report["controlplane"] == {"health": "not running"}
    plain = runner.invoke(cli_main.app, ["status", "--data-dir", str(tmp_path)])
    assert plain.exit_code == 6 and "NOT running" in plain.stdout


def test_nodes_come_from_the_database(tmp_path: pathlib.Path) -> None:
    migrate(sqlite_url(tmp_path))
    store = Store(sqlite_url(tmp_path))
    try:
        node = store.register_node(
            "http://127.0.0.1:7", "t" * 32, capacity={"cpus": 2.0, "memory_mb": 4096, "sandboxes": 10}
        )
        store.heartbeat(
            node.id, used={}, runtime={"driver": "fake"}, space_version="9.9.9", pools={"python": 2}
        )  # ADR 0079
    finally:
        store.close()
    report = collect(tmp_path)
    assert report["running"] is False and report["components"] == []
    [seen] = report["nodes"]
    assert seen["id"] == node.id and seen["status"] == "ready" and seen["capacity"]["sandboxes"] == 10
    assert f"node {node.id} ready" in render(report)
    line = render(report).split(f"node {node.id}")[1]
    assert seen["space_version"] == "9.9.9" and "SPACE 9.9.9, pool python 2" in line, line


def test_a_damaged_status_file_is_no_status(tmp_path: pathlib.Path) -> None:
    for content in ("{", "[]", '"x"', json.dumps({"components": ["not a row", 3, None]})):
        (tmp_path / STATUS_FILENAME).write_text(content)
        report = collect(tmp_path)
        assert report["components"] == [] and report["running"] is False, content
        assert stop_leftovers(tmp_path) == []


def has_cmdline(pid: int) -> bool:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() != b""


def test_leftovers_are_only_this_installations_processes(tmp_path: pathlib.Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # A process the status file names but that is not this installation's (a reused pid, or a hostile
    # file): left alone. One whose command line names the data directory: stopped.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--data-dir", str(data_dir)]
    )  # fmt: skip
    try:
        # Right after Popen returns, the child may still be inside exec, with an empty /proc/PID/cmdline
        # (seen: 119 of 200 starts): a leftover of a dead supervisor has long finished starting.
        for proc in (stranger, ours):
            wait_for(functools.partial(has_cmdline, proc.pid), timeout=10, what="the child to finish exec")
        write_status(data_dir, [row("helper", stranger.pid, 0.0), row("agent", ours.pid, 0.0)])
        assert stop_leftovers(data_dir) == [ours.pid]
        assert ours.wait(10) != 0
        assert stranger.poll() is None
    finally:
        for proc in (stranger, ours):
            proc.kill()
            proc.wait()
