"""`space up --detach` supervises what it started (ADR 0037), over the real runsc node: the control plane,
the node agent (with the egress gateway inside it) and the root helper are SIGKILLed in turn in ONE run;
each comes back (`space status`: restarts 1, the death in space.log as a structured line), the node keeps
its identity (one node record, the same id), and a sandbox created before the kills still answers exec
afterwards (a restart converges like any other crash) and still pauses and resumes (the agent reaches the
restarted helper by itself). Then `space down` stops everything with no restart fighting it, and
`space down --purge` with SPACE not running still destroys everything.

To keep the run short, the restarts are polled in-process (`space.cli.status.collect`, what the command
prints; the command itself runs at the start, the end and after `space down`), and the sandbox is driven
with the SDK (the CLI's config file gives its url and key) instead of a CLI process per call."""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import pytest

from space.cli.status import collect
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from space.core.errors import SpaceError
from space.sdk import Sandbox, Space
from tests.support.cluster import free_port, host_leftovers, sandbox_ids_in, wait_for
from tests.support.space_up import Cli, components, status_report, supervisor_events

pytestmark = pytest.mark.root

KILL_ORDER = ("controlplane", "agent", "helper")


def node_ids(cli: Cli) -> list[str]:
    store = Store(sqlite_url(cli.data_dir))
    try:
        return [node.id for node in store.list_nodes(None)]
    finally:
        store.close()


def sdk(cli: Cli) -> Space:
    config = json.loads((cli.home / ".config" / "space" / "config.json").read_text())
    return Space(url=config["url"], api_key=config["api_key"])


def exec_answers(sandbox: Sandbox, text: str) -> bool:
    try:
        result = sandbox.exec(["echo", text], timeout=60)
    except SpaceError:
        return False  # not converged yet (control plane, agent or sandbox coming back)
    return result.exit_code == 0 and result.stdout == f"{text}\n"


def restarted(cli: Cli, name: str, old_pid: int) -> dict[str, object]:
    """The component's row once it runs again after the kill (an empty dict before)."""
    row = components(collect(cli.data_dir))[name]
    fresh = row["state"] == "running" and row["restarts"] == 1 and row["pid"] not in (None, old_pid)
    return row if fresh else {}


def test_each_component_killed_comes_back_and_the_sandbox_converges(cli: Cli) -> None:
    port = free_port()
    cli.run("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach", timeout=900)
    report = status_report(cli)
    assert report["running"] is True and report["controlplane"]["health"] == "ok"
    rows = components(report)
    assert set(rows) == set(KILL_ORDER)
    for row in rows.values():
        assert row["state"] == "running" and row["restarts"] == 0 and isinstance(row["pid"], int)
        assert isinstance(row["uptime_s"], float) and row["uptime_s"] >= 0
    assert (cli.data_dir / "status.json").stat().st_mode & 0o077 == 0, "the status file is owner-only"
    [node_id] = node_ids(cli)
    nodes = report["nodes"]
    assert isinstance(nodes, list) and [n["id"] for n in nodes] == [node_id]
    assert nodes[0]["status"] == "ready" and nodes[0]["capacity"]["sandboxes"] > 0

    client = sdk(cli)
    sandbox = client.sandboxes.create()
    assert exec_answers(sandbox, "before")

    took: dict[str, float] = {}
    for name in KILL_ORDER:
        old_pid = int(str(components(collect(cli.data_dir))[name]["pid"]))
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        row = wait_for(functools.partial(restarted, cli, name, old_pid), timeout=120, interval=0.2, what=name)
        took[name] = time.monotonic() - killed
        assert row["last_exit"] == "signal SIGKILL", row
        deaths = [e for e in supervisor_events(cli.data_dir) if e["event"] == "component.exited"]
        assert any(e["component"] == name and e["pid"] == old_pid for e in deaths), (name, deaths)
        assert any(
            e["event"] == "component.restarted" and e["component"] == name and e["pid"] == row["pid"]
            for e in supervisor_events(cli.data_dir)
        ), name

    # Converges: the sandbox from before answers again, on the same node (no new node registered) ...
    converging = time.monotonic()
    wait_for(lambda: exec_answers(sandbox, "after"), timeout=120, interval=0.5, what="exec again")
    took["exec after the helper's restart"] = time.monotonic() - converging
    print(
        "\nSIGKILL to restarted (status.json), then exec answering: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in took.items())
    )
    assert node_ids(cli) == [node_id], "a new node registered after the restarts"
    # ... and the agent reaches the restarted helper by itself (pause and resume are helper verbs).
    assert sandbox.pause().state == "paused"
    assert sandbox.resume().state == "running"
    assert exec_answers(sandbox, "resumed")
    client.close()
    final = status_report(cli)
    restarts = {name: row["restarts"] for name, row in components(final).items()}
    # An agent still starting when its helper is killed exits with it (a helper call of its start-up fails)
    # and is restarted once more: a dependent's restart, logged like any death, never a loop.
    agent_deaths = [e for e in supervisor_events(cli.data_dir)
                    if e["event"] == "component.exited" and e["component"] == "agent"]  # fmt: skip
    assert len(agent_deaths) == restarts["agent"] and restarts["agent"] in {1, 2}, agent_deaths
    assert {**restarts, "agent": 1} == dict.fromkeys(KILL_ORDER, 1), restarts
    assert final["controlplane"]["health"] == "ok"

    # `space down` stops everything: no restart fights it, and nothing of it is left running.
    seen = sandbox_ids_in(cli.data_dir)
    pids = [int(str(row["pid"])) for row in components(final).values()]
    cli.run("down", "--data-dir", str(cli.data_dir), timeout=300)
    stopped = status_report(cli)
    assert stopped["running"] is False
    assert {row["state"] for row in components(stopped).values()} == {"stopped"}
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a component outlived `space down`"
    # No restart fights `space down`: the restart events are exactly the restarts counted before it.
    restart_events = [e for e in supervisor_events(cli.data_dir) if e["event"] == "component.restarted"]
    assert len(restart_events) == sum(restarts.values()), restart_events

    # `space down --purge` when SPACE is not running still purges (a helper is started just for it).
    purged = cli.run("down", "--data-dir", str(cli.data_dir), "--purge", timeout=600)
    assert b"purged" in purged.stderr, purged.stderr
    assert not cli.data_dir.exists()
    left = {k: v for k, v in host_leftovers(cli.data_dir, seen).items() if v}
    assert left == {}, f"left behind by `space down --purge` while not running: {left}"
