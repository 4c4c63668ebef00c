"""The kill-point mechanism (space.faults.failpoints) and the list every component exports.

- the exported list is derived from the tables: every lifecycle transition (both sides of its
  compare-and-swap), every node route, every helper verb, the artifact parts and the named control-plane
  points are in it, each once;
- production arms nothing: an environment without SPACE_FAILPOINTS (or with it empty) arms no point, the
  root helper never inherits the variable (HELPER_ENV), this very process is unarmed and its node app has no
  kill-point middleware;
- armed, a process dies by SIGKILL at the point, after journaling it; restarted with the same environment
  it goes past that point (fire once) and dies at the next one; `*` arms every point.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

from space.controlplane.failpoints import POINTS, all_points
from space.core.lifecycle import TRANSITIONS
from space.faults import failpoints
from space.node.agent.app import ROUTERS, create_app
from space.node.agent.killpoints import KillPointMiddleware
from space.node.helper.verbs import VERBS
from space.node.local import HELPER_ENV
from space.objectstore.artifacts import ARTIFACT_POINTS

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_points_are_derived_from_the_tables() -> None:
    exported = all_points()
    flat = [p for points in exported.values() for p in points]
    assert len(flat) == len(set(flat))
    for state, event in TRANSITIONS:
        for phase in failpoints.PHASES:
            assert f"cp.{state.value}.{event.value}.{phase}" in exported["controlplane"]
    assert set(exported["controlplane"]) >= POINTS
    routes = {route.name for router in ROUTERS for route in router.routes}  # type: ignore[attr-defined]
    assert {f"agent.{name}.before" for name in routes} | {f"agent.{name}.after" for name in routes} == set(
        exported["agent"]
    )
    assert {f"helper.{verb}.{phase}" for verb in VERBS for phase in failpoints.PHASES} == set(
        exported["helper"]
    )
    assert set(ARTIFACT_POINTS) == set(exported["objectstore"])
    print(f"\nkill points: { ({k: len(v) for k, v in exported.items()}) }, {len(flat)} in all")


def test_production_settings_arm_nothing() -> None:
    assert not failpoints.arming_from({}).active
    assert not failpoints.arming_from({failpoints.ARM_VARIABLE: " , "}).active
    assert not failpoints.arming_from({failpoints.JOURNAL_VARIABLE: "/tmp/x"}).active  # a journal alone
    assert failpoints.ARM_VARIABLE not in HELPER_ENV and failpoints.JOURNAL_VARIABLE not in HELPER_ENV
    assert not failpoints.armed(), "the test process itself must run unarmed"
    failpoints.hit("cp.running.pause.before")  # unarmed: returns
    app = create_app(object(), "token")  # type: ignore[arg-type]
    assert all(m.cls is not KillPointMiddleware for m in app.user_middleware)


def test_arming_names_every_point_and_the_journal_disarms(tmp_path: pathlib.Path) -> None:
    journal = tmp_path / "fired"
    journal.write_text("a\n")
    arming = failpoints.arming_from(
        {failpoints.ARM_VARIABLE: "a,b", failpoints.JOURNAL_VARIABLE: str(journal)}
    )
    assert not arming.armed("a") and arming.armed("b") and not arming.armed("c")
    every = failpoints.arming_from({failpoints.ARM_VARIABLE: "*"})
    assert every.armed("anything.at.all") and every.active


def _run_until(points: str, journal: pathlib.Path) -> subprocess.CompletedProcess[str]:
    code = "from space.faults import failpoints as f\nfor p in ('one', 'two', 'three'):\n    f.hit(p)\n"
    code += "print('past')"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO / "src"),
        failpoints.ARM_VARIABLE: points,
        failpoints.JOURNAL_VARIABLE: str(journal),
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_an_armed_process_dies_once_at_each_point(tmp_path: pathlib.Path) -> None:
    journal = tmp_path / "fired"
    outcomes = [_run_until("one,three", journal) for _ in range(3)]
    assert [o.returncode for o in outcomes] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert "crash injection ARMED" in outcomes[0].stderr and outcomes[2].stdout == "past\n"
    assert journal.read_text().split() == ["one", "three"]
    every = tmp_path / "every"
    assert [_run_until("*", every).returncode for _ in range(4)] == [-signal.SIGKILL] * 3 + [0]
    assert every.read_text().split() == ["one", "two", "three"]


def test_the_node_app_dies_at_a_route_point_inside_bearer_auth(tmp_path: pathlib.Path) -> None:
    """An armed node app dies before the handler of the route a request matches, and only once the request
    passed BearerAuth (an unauthenticated one is answered 401)."""
    journal = tmp_path / "fired"
    code = "\n".join(
        [
            "from starlette.testclient import TestClient",
            "from space.node.agent.app import create_app",
            "client = TestClient(create_app(object(), 'tok'), raise_server_exceptions=False)",
            "path = '/node/v1/sandboxes/sb-aaaaaaaaaaaaaaaaaaaaaaaaaa/pause'",
            "print(client.post(path).status_code, flush=True)",
            "client.post(path, headers={'Authorization': 'Bearer tok'})",
            "print('past')",
        ]
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO / "src"),
        failpoints.ARM_VARIABLE: "agent.pause_sandbox.before",
        failpoints.JOURNAL_VARIABLE: str(journal),
    }
    died = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert died.stdout.split() == ["401"] and journal.read_text().split() == ["agent.pause_sandbox.before"]
