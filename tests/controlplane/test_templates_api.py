"""Templates in the control plane (ADR 0055), over a real HTTP server (uvicorn on loopback) and a real SQLite
store, with a scripted node in place of the node's build stream (the node's own build is tested in
tests/node and, end to end through the CLI, in tests/e2e/test_template_cli.py).

What is checked: a build recorded and settled (ready or failed) by its node's stream, its log (followed to the
end, and cut off by a client that goes away: the stream slot comes back), names and ids and node-level names
resolved for creates, and every route refusing another project's template exactly like a missing one."""

from __future__ import annotations

import asyncio
import json
import pathlib
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from space.cli import main as cli_main
from space.controlplane.api.app import create_app
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store, open_store
from space.controlplane.template_builds import TemplateBuilds
from space.core.ids import new_template_id, template_node_name
from tests.support.hop import Served as Server
from tests.support.hop import tcp_listener
from tests.support.loop import BackgroundLoop

STREAMS_PER_KEY = 2


@dataclass
class ScriptedNode:
    """The node's side of a build: yields `script`'s items; `hold` keeps the stream open until released."""

    loop: BackgroundLoop
    script: list[dict[str, Any]] = field(default_factory=list)
    hold: bool = False
    released: asyncio.Event | None = None
    builds: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    async def build_template(self, name: str, spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.builds.append((name, spec))
        for item in self.script:
            yield item
        if self.hold:
            self.released = asyncio.Event()
            await self.released.wait()
            yield {"done": {"name": name, "size_bytes": 1, "metadata": {}}}

    async def delete_template(self, name: str) -> dict[str, Any]:
        self.deleted.append(name)
        return {"name": name, "deleted": True}

    def release(self) -> None:
        assert self.released is not None
        self.loop.loop.call_soon_threadsafe(self.released.set)


@dataclass
class World:
    store: Store
    url: str
    node: ScriptedNode
    builds: TemplateBuilds
    loop: BackgroundLoop
    project: str
    key: str
    other_project: str
    other_key: str

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=30
        )


@dataclass
class Served:
    store: Store
    url: str
    node: ScriptedNode
    builds: TemplateBuilds
    loop: BackgroundLoop


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One control plane for the module (each test makes its own projects and resets the node's script)."""
    tmp_path = tmp_path_factory.mktemp("templates")
    loop = BackgroundLoop()
    store = open_store(sqlite_url(tmp_path / "cp"))
    settings = ControlPlaneSettings.from_env({"SPACE_API_STREAMS_PER_KEY": str(STREAMS_PER_KEY)})
    app = create_app(store, node_token="n" * 40, run_reconciler=False, data_dir=tmp_path, settings=settings)
    node = ScriptedNode(loop)
    builds: TemplateBuilds = app.state.templates
    builds.nodes = lambda _node_id: node
    listener, url = tcp_listener()
    server = Server(loop, app, [listener])
    try:
        yield Served(store, url, node, builds, loop)
    finally:
        server.stop()
        loop.run(builds.aclose())
        loop.close()
        store.close()


@pytest.fixture
def world(served: Served) -> Iterator[World]:
    served.node.script, served.node.hold, served.node.released = [], False, None
    served.node.builds.clear()
    served.node.deleted.clear()
    store = served.store
    # (Again) a ready node with a fresh heartbeat, kept fresh while the test runs (a slow machine may take
    # longer than the scheduler's freshness bound between two builds): the builds' node choice takes no other.
    node = store.register_node(
        "http://127.0.0.1:9/node", "t" * 32, capacity={"cpus": 2, "memory_mb": 4096, "sandboxes": 8},
        templates=["python", "base"],
    )  # fmt: skip
    beating = threading.Event()

    def heartbeats() -> None:
        while not beating.wait(1.0):
            store.heartbeat(node.id, used={}, templates=["python", "base"])

    beater = threading.Thread(target=heartbeats, daemon=True)
    beater.start()
    org = store.create_org(f"o-{secrets.token_hex(4)}")
    mine, theirs = store.create_project(org.id, "mine"), store.create_project(org.id, "theirs")
    _k1, key = store.create_api_key(mine.id, org.id, "member")
    _k2, other_key = store.create_api_key(theirs.id, org.id, "member")
    yield World(
        store, served.url, served.node, served.builds, served.loop, mine.id, key, theirs.id, other_key
    )
    if served.node.released is not None:
        served.node.release()  # no build of this test stays held
    beating.set()
    beater.join(10)


def _build(
    world: World, name: str, spec: dict[str, Any] | None = None, key: str | None = None
) -> httpx.Response:
    with world.client(key) as client:
        return client.post(
            "/v1/templates",
            json={"name": name, "spec": spec or {"from": "python", "steps": [{"run": "true"}]}},
        )


def _follow(world: World, ref: str, key: str | None = None) -> list[dict[str, Any]]:
    with world.client(key) as client:
        answer = client.get(f"/v1/templates/{ref}/logs", params={"follow": "true"})
        assert answer.status_code == 200, answer.text
        return [json.loads(line) for line in answer.text.splitlines()]


def test_a_build_is_recorded_driven_and_resolved_for_creates(world: World) -> None:
    world.node.script = [
        {"log": "step 1/1: run true"},
        {"log": "ok"},
        {
            "done": {
                "name": "x",
                "size_bytes": 4096,
                "metadata": {"default_user": "user", "workdir": "/home/user"},
            }
        },
    ]
    answer = _build(world, "my-tpl")
    assert answer.status_code == 202, answer.text
    made = answer.json()
    assert (made["status"], made["builtin"], made["source"]) == ("building", False, "python")
    assert made["id"].startswith("tpl_") and made["node_name"] == template_node_name(made["id"])
    items = _follow(world, "my-tpl")
    assert [i["log"] for i in items if "log" in i] == [
        "step 1/1: run true",
        "ok",
        "build finished: template ready",
    ]
    final = items[-1]["template"]
    assert (final["status"], final["size_bytes"], final["default_user"], final["workdir"]) == (
        "ready",
        4096,
        "user",
        "/home/user",
    )
    # The node was asked for the node-level name, with the spec as sent (from: the built-in's name).
    assert world.node.builds == [
        (made["node_name"], {"from": "python", "steps": [{"run": "true"}], "user": None, "start_cmd": None})
    ]
    with world.client() as client:
        by_id, by_name = client.get(f"/v1/templates/{made['id']}"), client.get("/v1/templates/my-tpl")
        assert by_id.json() == by_name.json() and by_id.json()["status"] == "ready"
        listed = [t["name"] for t in client.get("/v1/templates").json()["templates"]]
        assert {"python", "base"} <= set(listed) and listed[-1] == "my-tpl"
        for ref in ("my-tpl", made["id"], made["node_name"]):
            sandbox = client.post("/v1/sandboxes", json={"template": ref, "wait": False})
            assert sandbox.status_code == 201, sandbox.text
            assert sandbox.json()["template"] == made["node_name"]
        # A template built on it: the node gets the node-level name as `from`.
        world.node.script = [{"done": {"name": "y", "size_bytes": 1, "metadata": {}}}]
        child = _build(world, "child", {"from": "my-tpl", "steps": []})
        assert child.status_code == 202, child.text
        assert world.node.builds[-1][1]["from"] == made["node_name"]
        # In use: not deleted (a stopped or suspended sandbox still needs it).
        refused = client.delete("/v1/templates/my-tpl")
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "conflict"), refused.text


def test_failed_and_building_templates_make_no_sandboxes(world: World) -> None:
    world.node.script = [
        {"log": "E: Unable to locate package nope"},
        {"error": {"code": "build_failed", "message": "step 1 (apt) exited with 100"}},
    ]
    failed = _build(world, "broken").json()
    items = _follow(world, failed["id"])
    assert items[-1]["template"]["status"] == "failed"
    assert "step 1 (apt) exited with 100" in items[-1]["template"]["error"]
    assert items[-2]["log"].startswith("build failed: build_failed: step 1 (apt) exited with 100")
    world.node.script, world.node.hold = [{"log": "working"}], True
    building = _build(world, "slow").json()
    with world.client() as client:
        for name, status in (("broken", "failed"), ("slow", "building")):
            answer = client.post("/v1/sandboxes", json={"template": name, "wait": False})
            assert answer.status_code == 409, answer.text
            assert (answer.json()["error"]["code"], answer.json()["error"]["details"]["state"]) == (
                "invalid_state",
                status,
            )
        missing = client.post("/v1/sandboxes", json={"template": "no-such-template", "wait": False})
        assert missing.status_code == 404, missing.text
        # Deleting the building one stops its build and asks the node to drop it.
        gone = client.delete(f"/v1/templates/{building['id']}")
        assert gone.status_code == 200, gone.text
        assert client.get("/v1/templates/slow").status_code == 404
        assert building["node_name"] in world.node.deleted
        assert _build(world, "slow").status_code == 202  # the name is free again
        world.node.release()


def test_names_are_checked(world: World) -> None:
    world.node.hold = True
    assert _build(world, "taken").status_code == 202
    cases = [
        ("python", 409, "already_exists"),  # a built-in's name
        ("taken", 409, "already_exists"),
        ("tpl-0123456789abcdef", 400, "invalid_argument"),  # node-level names are reserved
        ("Upper", 400, "invalid_argument"),
        ("../x", 400, "invalid_argument"),
        ("a" * 64, 422, "validation_error"),
    ]
    for name, status, code in cases:
        answer = _build(world, name)
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), (name, answer.text)
    too_many = _build(world, "many", {"from": "python", "steps": [{"run": "true"}] * 10_000})
    assert too_many.status_code in {400, 413}, too_many.text  # refused: before or after the body bound
    hostile_from = _build(world, "x", {"from": "oci:tpl_0123456789abcdef", "steps": []})
    assert (hostile_from.status_code, hostile_from.json()["error"]["details"]["field"]) == (400, "spec.from")
    with world.client() as client:
        huge = client.post(
            "/v1/templates",
            content=b'{"name": "h", "spec": {"from": "python", "steps": ['
            + b'{"run": "true"},' * 200_000
            + b'{"run": "x"}]}}',
            headers={"Content-Type": "application/json"},
        )
        assert huge.status_code == 413, huge.text
    world.node.release()


def test_another_projects_template_is_a_missing_one(world: World) -> None:
    world.node.script = [{"done": {"name": "x", "size_bytes": 1, "metadata": {}}}]
    theirs = _build(world, "secret-tpl", key=world.other_key).json()
    _follow(world, theirs["id"], world.other_key)
    missing_id = new_template_id()
    refs = {
        theirs["id"]: missing_id,
        "secret-tpl": "no-such-tpl",
        theirs["node_name"]: template_node_name(missing_id),
    }
    with world.client() as client:
        for ref, absent in refs.items():
            for method, suffix, kwargs in (
                ("GET", "", {}),
                ("GET", "/logs", {"params": {"follow": "true"}}),
                ("DELETE", "", {}),
                ("PUT", "/source", {"content": b"tar"}),
            ):
                foreign = client.request(method, f"/v1/templates/{ref}{suffix}", **kwargs)
                nothing = client.request(method, f"/v1/templates/{absent}{suffix}", **kwargs)
                assert foreign.status_code == nothing.status_code == 404, (method, ref, foreign.text)
                assert (
                    foreign.json()["error"]["message"].replace(ref, absent)
                    == nothing.json()["error"]["message"]
                )
            for body in ({"template": ref, "wait": False},):
                assert client.post("/v1/sandboxes", json=body).status_code == 404
            built_on = _build(world, f"on-{secrets.token_hex(3)}", {"from": ref, "steps": []})
            assert built_on.status_code == 404, built_on.text
        listed = [t["id"] for t in client.get("/v1/templates").json()["templates"]]
        assert theirs["id"] not in listed
        for encoded in ("secret%2Dtpl", "..%2Fsecret-tpl", "%2e%2e", "secret-tpl%00"):
            assert client.get(f"/v1/templates/{encoded}").status_code in {400, 404}
    assert world.store.find_template(world.other_project, "secret-tpl") is not None  # untouched


def test_a_log_follower_that_goes_away_gives_its_stream_back(world: World) -> None:
    world.node.script, world.node.hold = [{"log": "building for ever"}], True
    made = _build(world, "endless").json()
    # Three times as many followers as the key's stream slots, one after another: each one that went away
    # must have given its slot back (a leak would answer 429).
    for _ in range(3 * STREAMS_PER_KEY):
        with (
            world.client() as client,
            client.stream("GET", "/v1/templates/endless/logs", params={"follow": "true"}) as answer,
        ):
            assert answer.status_code == 200
            first = next(answer.iter_lines())
            assert json.loads(first)["log"] == "building for ever"
    world.node.release()
    assert _follow(world, made["id"])[-1]["template"]["status"] == "ready"


def test_sweep_fails_abandoned_builds(world: World) -> None:
    """A building row whose control plane died: its lease passed (another host), or its owner is a dead
    process of this host (found at once): the sweep fails it and asks the node to drop any copy."""
    spec = {"from": "python", "steps": []}
    nodes = world.store.list_nodes()
    passed = world.store.create_template(
        world.project,
        "passed",
        spec=spec,
        source="python",
        node_id=nodes[0].id,
        lease_owner="other-host:1:1",
        lease_s=0,
    )
    dead = world.store.create_template(
        world.project,
        "dead",
        spec=spec,
        source="python",
        node_id=nodes[0].id,
        lease_owner=f"{socket.gethostname()}:999999999:1",
        lease_s=3600,
    )
    alive = world.store.create_template(
        world.project,
        "alive",
        spec=spec,
        source="python",
        node_id=None,
        lease_owner="other-host:1:1",
        lease_s=3600,
    )
    settled = world.loop.run(world.builds.sweep())
    assert sorted(settled) == sorted([passed.id, dead.id])
    for record in (passed, dead):
        now = world.store.get_template(world.project, record.id)
        assert now is not None and now.status == "failed" and "control plane" in (now.error or "")
        assert record.node_name in world.node.deleted
    still = world.store.get_template(world.project, alive.id)
    assert still is not None and still.status == "building"
    assert world.loop.run(world.builds.sweep()) == []  # idempotent


def _cli(world: World, *args: str) -> Result:
    return CliRunner().invoke(cli_main.app, ["--url", world.url, "--api-key", world.key, "template", *args])


def test_the_cli_builds_from_options_and_files_and_fails_with_the_reason(
    world: World, tmp_path: pathlib.Path
) -> None:
    (tmp_path / "tool.py").write_bytes(b"print('tool')\n")
    world.node.script = [{"log": "step 1: file"}, {"done": {"name": "x", "size_bytes": 1, "metadata": {}}}]
    built = _cli(
        world,
        "build",
        "opts",
        "--from",
        "python",
        "--apt",
        "jq",
        "--pip",
        "six==1.16.0",
        "--file",
        f"{tmp_path / 'tool.py'}:/opt/tool.py",
        "--run",
        "echo a",
        "--run",
        "echo b",
        "--env",
        "K=V",
        "--workdir",
        "/opt",
        "--user",
        "agent",
        "--start-cmd",
        "sleep 1",
    )
    assert built.exit_code == 0, built.output
    assert built.stdout.strip().startswith("tpl_") and "step 1: file" in built.stderr
    assert world.node.builds[-1][1] == {
        "from": "python",
        "steps": [
            {"file": {"path": "/opt/tool.py", "content_b64": "cHJpbnQoJ3Rvb2wnKQo=", "mode": 0o644}},
            {"apt": ["jq"]}, {"pip": ["six==1.16.0"]}, {"env": {"K": "V"}}, {"workdir": "/opt"},
            {"run": "echo a"}, {"run": "echo b"},
        ],
        "user": "agent",
        "start_cmd": "sleep 1",
    }  # fmt: skip
    (tmp_path / "space-template.toml").write_text(
        'name = "declared"\nfrom = "opts"\nuser = "agent"\n'
        '[[steps]]\nfile = { src = "tool.py", path = "/opt/t.py", mode = 0o755 }\n'
        '[[steps]]\nrun = "echo declared"\n'
    )
    declared = _cli(world, "build", "-f", str(tmp_path / "space-template.toml"))
    assert declared.exit_code == 0, declared.output
    spec = world.node.builds[-1][1]
    tool = {"path": "/opt/t.py", "content_b64": "cHJpbnQoJ3Rvb2wnKQo=", "mode": 0o755}
    assert spec["steps"] == [{"file": tool}, {"run": "echo declared"}]
    assert spec["from"] == world.store.find_template(world.project, "opts").node_name  # type: ignore[union-attr]
    (tmp_path / "typo.toml").write_text('name = "t"\nfrom = "python"\n[[steps]]\nrn = "x"\n')
    typo = _cli(world, "build", "-f", str(tmp_path / "typo.toml"))
    assert typo.exit_code == 2 and "rn" in typo.stderr
    world.node.script = [
        {"log": "boom"},
        {"error": {"code": "build_failed", "message": "step 1 (run) exited with 7"}},
    ]
    failed = _cli(world, "build", "bad", "--from", "python", "--run", "exit 7")
    assert failed.exit_code == 1, failed.output
    assert (
        "error: build_failed: template 'bad' failed to build: build_failed: step 1 (run) exited with 7"
        in failed.stderr
    )
    listed = _cli(world, "list")
    rows = {line.split()[1]: line.split()[2] for line in listed.stdout.splitlines()[1:]}
    assert (rows["opts"], rows["declared"], rows["bad"], rows["python"]) == (
        "ready",
        "ready",
        "failed",
        "ready",
    )
    assert _cli(world, "delete", "bad").exit_code == 0
    missing = _cli(world, "get", "bad")
    assert missing.exit_code == 3 and "not_found" in missing.stderr
