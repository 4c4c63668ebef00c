"""User template builds on a real node (runsc, btrfs, network = "sandbox" with the node's egress gateway),
through the node RPC app: one build from `python` with an apt package, a pip package (pip itself comes from
apt: the template has none), a file, a command, env, a workdir and a user, shared by the tests of this module;
then a sandbox made from it sees all of them; the failure paths leave nothing behind; a build killed with its
agent (its claim, build sandbox and half-made tree left on the node) does not stop the next build.

The packages come from a mirror in a network namespace of this test (tests/support/build_mirror.py), which the
build sandbox reaches through the gateway's allow-list (exactly the mirror's host): no traffic leaves the
machine."""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.egress_sandbox import CA_BEGIN
from space.node.agent.egress_settings import EgressSettings
from space.node.agent.egress_wiring import install
from space.node.agent.template_build import TemplateBuilds
from space.node.agent.template_build_sources import BuildSources
from space.node.egress import StaticResolver
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode
from tests.support.build_mirror import PROBE_WHEEL, Mirror, make_content, start_mirror
from tests.support.cluster import Service, free_port, wait_for
from tests.support.egress_net import leftovers
from tests.support.host import network_traces
from tests.support.loop import BackgroundLoop
from tests.support.realnode import assert_no_leaks, make_data_dir, require_root, sandbox_ids_in
from tests.support.sandboxes import delete_quietly

pytestmark = pytest.mark.root

TOKEN = "node-token-" + secrets.token_hex(8)
VALUE = "probe-" + secrets.token_hex(6)
FILE_TEXT = b"hello from the build\n"


@dataclass
class BuildNode:
    local: LocalNode
    agent: NodeAgent
    loop: BackgroundLoop
    app: Any
    mirror: Mirror

    @property
    def builds(self) -> TemplateBuilds:
        return self.app.state.template_builds  # type: ignore[no-any-return]

    @property
    def templates_dir(self) -> pathlib.Path:
        return self.local.layout.templates

    def run(self, coro, timeout: float = 600.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)

    async def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node", timeout=900) as client:
            return await client.request(
                method, f"/node/v1{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
            )

    def build(self, name: str, spec: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        response = self.run(self.call("POST", f"/templates/{name}/build", spec), timeout=900)
        if response.status_code != 200:
            return response.status_code, [response.json()]
        return 200, [json.loads(line) for line in response.text.splitlines() if line.strip()]


def _name() -> str:
    return "tpl-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def build_node(loop: BackgroundLoop) -> Iterator[BuildNode]:
    require_root()
    tag = f"spb{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-tplbuild-", dir="/var/tmp"))
    data_dir = make_data_dir("tplbuild")
    make_content(workdir / "www", VALUE)
    mirror = start_mirror(tag, 77, workdir / "www")
    local = LocalNode(data_dir, network="sandbox")
    agent: NodeAgent | None = None
    try:
        # The python template without its warm start: builds boot their sandboxes cold (never a warm start)
        agent = loop.run(local.start(progress=lambda line: None, templates=()), timeout=1800)
        loop.run(agent.ensure_template("python"), timeout=1800)
        settings = EgressSettings(
            state_dir=data_dir / "egress",
            resolver=StaticResolver({mirror.host: [mirror.upstream.addr]}),
            operator_allowed_networks=[ipaddress.ip_network("10.98.77.0/24")],
        )
        app = create_app(agent, TOKEN)
        app.state.service.egress = loop.run(install(agent, settings))
        assert app.state.service.egress is not None
        app.state.template_builds.use_sources(
            BuildSources(apt_sources=mirror.apt_sources, pip_index=mirror.pip_index)
        )
        yield BuildNode(local, agent, loop, app, mirror)
    finally:
        sandbox_ids = sandbox_ids_in(data_dir) | (set(agent.sandboxes) if agent is not None else set())
        try:
            if agent is not None:
                loop.run(agent.delete_all(), timeout=300)
            loop.run(local.stop(purge=True), timeout=300)
        finally:
            mirror.close()
            shutil.rmtree(workdir, ignore_errors=True)
    assert_no_leaks(data_dir, sandbox_ids)
    assert network_traces(node_tag(data_dir.resolve())) == []
    assert leftovers(tag) == [], "the mirror's namespace left behind"


#: Starts a server writing a marker and exits once the marker is there (as a server's readiness).
START_CMD = (
    "sh -c 'echo \"$(id -un) $(pwd) $GREETING\" > /tmp/started.txt; exec sleep infinity' & "
    "while [ ! -s /tmp/started.txt ]; do sleep 0.1; done"
)
#: How many processes of the sandbox run `sleep infinity` (what START_CMD leaves).
SERVERS = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep infinity'"
SPEC: dict[str, Any] = {
    "from": "python",
    "steps": [
        {"apt": ["space-build-probe"]},
        {"pip": [f"{PROBE_WHEEL}==1.0"]},
        {"file": {"path": "/etc/space-build/hello.txt", "content_b64": base64.b64encode(FILE_TEXT).decode(),
                  "mode": 0o640}},
        {"env": {"GREETING": "hi", "SECOND": "2"}},
        {"workdir": "/srv/app"},
        {"run": 'echo "ran as $(id -un) in $(pwd) with $GREETING" > /srv/app/ran.txt; echo run-step-output'},
    ],
    "user": "builder",
    # It leaves a server behind (a marker saying who, where and with what it runs) and exits (ADR 0054).
    "start_cmd": START_CMD,
}  # fmt: skip


@pytest.fixture(scope="module")
def built(build_node: BuildNode) -> tuple[str, list[dict[str, Any]]]:
    name = _name()
    status, items = build_node.build(name, SPEC)
    assert status == 200, items
    assert "done" in items[-1], items[-20:]
    return name, items


def test_a_build_streams_its_steps_and_commits_a_template(
    build_node: BuildNode, built: tuple[str, list[dict[str, Any]]]
) -> None:
    name, items = built
    logs = [item["log"] for item in items[:-1]]
    assert all(set(item) == {"log"} for item in items[:-1])
    assert any("step 1/6: apt" in line for line in logs) and any("run-step-output" in line for line in logs)
    assert any("installing python3-pip with apt first" in line for line in logs)
    done = items[-1]["done"]
    meta = done["metadata"]
    assert done["name"] == name and done["size_bytes"] > 10 << 20
    assert meta["from"] == "python" and meta["builtin"] is False
    assert meta["default_user"] == "builder" and meta["workdir"] == "/srv/app"
    assert meta["env"] == {"GREETING": "hi", "SECOND": "2"} and meta["start_cmd"] == START_CMD
    python_meta = json.loads((build_node.templates_dir / "python.json").read_text())
    assert meta["guest_code_hash"] == python_meta["guest_code_hash"]
    # listed by the node (and in what its heartbeat reports), complete on disk, read-only
    listed = build_node.run(build_node.call("GET", "/templates")).json()["templates"]
    assert {t["name"]: t["builtin"] for t in listed}[name] is False
    assert name in build_node.app.state.service.info().templates
    tree = build_node.templates_dir / name
    assert json.loads((build_node.templates_dir / f"{name}.json").read_text()) == meta
    assert subprocess.run(["btrfs", "property", "get", str(tree), "ro"], capture_output=True,
                          text=True, check=True).stdout.strip() == "ro=true"  # fmt: skip
    # what the build used for itself is not in the template: its apt sources, apt's lists, the node's CA
    assert not (tree / "var/lib/space-build").exists()
    assert list((tree / "var/lib/apt/lists").glob("*Packages*")) == []
    assert CA_BEGIN not in (tree / "etc/ssl/certs/ca-certificates.crt").read_bytes()
    assert not (tree / "usr/local/share/ca-certificates/space-egress-ca.crt").exists()
    assert not (build_node.templates_dir / f".{name}.new").exists()
    assert list((build_node.templates_dir / ".builds").glob("*.json")) == []


def test_a_sandbox_of_the_built_template_has_everything_and_runs_as_its_user(
    build_node: BuildNode, built: tuple[str, list[dict[str, Any]]]
) -> None:
    name, _ = built

    async def scenario() -> dict[str, Any]:
        handle = await build_node.agent.create(name, sandbox_id=new_sandbox_id())
        try:
            session = handle.session
            out: dict[str, Any] = {}
            for key, cmd, user in (
                ("probe", "space-build-probe", None),
                ("wheel", f"python3 -c 'import {PROBE_WHEEL}; print({PROBE_WHEEL}.VALUE)'", None),
                (
                    "file",
                    "stat -c '%a %U' /etc/space-build/hello.txt && cat /etc/space-build/hello.txt",
                    "root",
                ),
                ("ran", "cat /srv/app/ran.txt", None),
                ("whoami", "id -un; pwd; echo $GREETING $SECOND", None),  # the template's defaults
                # what the start command started in the warm start's boot runs here (restored, not rerun)
                ("started", "cat /tmp/started.txt", None),
                ("server", SERVERS, None),
                ("start log", "stat -c %U /tmp/space-start.log", None),
            ):
                result = await session.exec(cmd, user=user)
                out[key] = (result.exit_code, result.stdout.decode(), result.stderr.decode())
            out["how"] = (handle.created_from, handle.start_process, handle.start_error)
            return out
        finally:
            await delete_quietly(build_node.agent, handle.sandbox_id)

    out = build_node.run(scenario())
    assert out["probe"][:2] == (0, "space-build-probe ok\n"), out["probe"]
    assert out["wheel"][:2] == (0, VALUE + "\n"), out["wheel"]
    assert out["file"][:2] == (0, "640 root\n" + FILE_TEXT.decode()), out["file"]
    assert out["ran"][:2] == (0, "ran as root in /srv/app with hi\n"), out["ran"]
    assert out["whoami"][:2] == (0, "builder\n/srv/app\nhi 2\n"), out["whoami"]
    assert out["how"] == ("warm", None, None)  # restored from the warm start: the command is not run again
    assert out["started"][:2] == (0, "builder /srv/app hi\n"), out["started"]
    assert out["server"][:2] == (0, "1\n"), out["server"]
    assert out["start log"][:2] == (0, "builder\n"), out["start log"]


def test_requests_the_node_refuses_before_building(
    build_node: BuildNode, built: tuple[str, list[dict[str, Any]]]
) -> None:
    name, _ = built
    refused = {
        "exists": build_node.build(name, {"from": "python"}),
        "no base": build_node.build(_name(), {"from": "tpl-" + "0" * 16}),
        "builtin": build_node.build("python", {"from": "python"}),
    }
    assert refused["exists"][0] == 409 and refused["exists"][1][0]["error"]["code"] == "already_exists"
    assert refused["no base"][0] == 404
    assert refused["builtin"][0] == 400
    assert build_node.builds.building == {}


def test_a_failing_step_fails_the_build_and_leaves_nothing(build_node: BuildNode) -> None:
    name = _name()
    before = set(build_node.agent.sandboxes)
    runtimes_before = {r.sandbox_id for r in build_node.run(build_node.agent.driver.list())}
    status, items = build_node.build(
        name, {"from": "python", "steps": [{"run": "echo first"}, {"run": "echo boom >&2; exit 3"}]}
    )
    assert status == 200
    error = items[-1]["error"]
    assert error["code"] == "build_failed" and error["details"]["exit_code"] == 3
    assert error["details"]["step"] == 2 and "boom" in error["details"]["tail"]
    assert any("first" in item.get("log", "") for item in items)
    # nothing half-built: no build sandbox (agent or runtime), no tree, no staging, no claim
    assert set(build_node.agent.sandboxes) == before
    assert {r.sandbox_id for r in build_node.run(build_node.agent.driver.list())} == runtimes_before
    assert [p.name for p in build_node.templates_dir.iterdir() if name in p.name] == []
    assert list((build_node.templates_dir / ".builds").glob("*.json")) == []
    assert build_node.builds.building == {}


def test_delete_keeps_sandboxes_made_from_the_template(
    build_node: BuildNode, built: tuple[str, list[dict[str, Any]]]
) -> None:
    name, _ = built

    async def scenario() -> tuple[int, int, int, int, str]:
        handle = await build_node.agent.create(name, sandbox_id=new_sandbox_id())
        try:
            build_node.builds.building[name] = "sb-held"  # a build of the name in flight
            busy = (await build_node.call("DELETE", f"/templates/{name}")).status_code
            del build_node.builds.building[name]
            builtin = (await build_node.call("DELETE", "/templates/python")).status_code
            deleted = (await build_node.call("DELETE", f"/templates/{name}")).status_code
            again = (await build_node.call("DELETE", f"/templates/{name}")).status_code
            result = await handle.session.exec("space-build-probe")
            return busy, builtin, deleted, again, result.stdout.decode()
        finally:
            await delete_quietly(build_node.agent, handle.sandbox_id)

    busy, builtin, deleted, again, probe = build_node.run(scenario())
    assert (busy, builtin, deleted, again) == (409, 400, 200, 404)
    assert probe == "space-build-probe ok\n"
    assert not (build_node.templates_dir / name).exists()
    assert not (build_node.templates_dir / f"{name}.json").exists()
    assert not (build_node.templates_dir / ".warm" / name).exists()
    assert name not in build_node.app.state.service.info().templates


def test_a_build_killed_with_its_agent_does_not_stop_the_next_one(build_node: BuildNode) -> None:
    """The node's agent, as its own process, is SIGKILLed while a build runs a step (and, as if it had also
    died in a commit, a staging tree and a tree without metadata are left); the agent starts again, adopts
    the orphaned build sandbox and sweeps it away at start, and a rebuild of the same name works and
    leaves nothing else behind.
    Last in the module: the in-process agent's egress gateway gives its ports to the agent process."""
    name = _name()
    data_dir = build_node.local.layout.data_dir
    build_node.run(build_node.app.state.service.egress.close())
    token_file = data_dir / "kill-test.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "space.node.agent.server",
        "--data-dir",
        str(data_dir),
        "--no-prepare",
        "--listen",
        f"127.0.0.1:{port}",
        "--rpc-token-file",
        str(token_file),
        "--log-level",
        "info",  # the start-up sweep is logged
    ]
    agent = Service("agent", argv, data_dir / "kill-test-agent.log")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}/node/v1", timeout=300,
                          headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip

    def up() -> bool:
        agent.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            return client.get("/info").status_code == 200
        return False

    try:
        agent.start()
        wait_for(up, timeout=120, what="the agent process")
        spec = {"from": "python", "steps": [{"run": "echo started; sleep 600"}]}
        with client.stream("POST", f"/templates/{name}/build", json=spec) as stream:
            for line in stream.iter_lines():
                if "started" in line:
                    break
            agent.kill()  # mid-step: the build sandbox runs on, its claim stays, nobody cleans up
        python = build_node.templates_dir / "python"
        for half in (f".{name}.new", name):  # what a kill inside a commit leaves
            target = str(build_node.templates_dir / half)
            subprocess.run(["btrfs", "subvolume", "snapshot", "-r", str(python), target], check=True,
                           capture_output=True)  # fmt: skip
        claims = list((build_node.templates_dir / ".builds").glob("*.json"))
        assert [c.stem for c in claims] == [name]
        orphan = json.loads(claims[0].read_text())["sandbox_id"]
        helper = build_node.builds._helper()
        running = build_node.run(helper.call("sandbox.list"))["sandboxes"]
        assert [(s["sandbox_id"], s["runtime"]) for s in running] == [(orphan, "running")]  # the kill left it
        agent.start()
        wait_for(up, timeout=120, what="the agent process, again")
        # the new agent process adopted the orphan and swept it at start, before it served anything
        assert client.get("/sandboxes").json()["sandboxes"] == []
        assert build_node.run(helper.call("sandbox.list"))["sandboxes"] == []
        assert list((build_node.templates_dir / ".builds").glob("*.json")) == []
        assert orphan in agent.log_path.read_text()  # "cleaning up after a build that did not finish"
        response = client.post(
            f"/templates/{name}/build", json={"from": "python", "steps": [{"run": "touch /rebuilt"}]}
        )
        items = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        assert response.status_code == 200 and "done" in items[-1], items[-5:]
        assert client.get("/sandboxes").json()["sandboxes"] == []  # the orphan and the new build sandbox
        assert (build_node.templates_dir / name / "rebuilt").exists()
        assert not (build_node.templates_dir / f".{name}.new").exists()
        assert list((build_node.templates_dir / ".builds").glob("*.json")) == []
        assert client.delete(f"/templates/{name}").status_code == 200
    finally:
        client.close()
        agent.stop()
        build_node.agent.sandboxes.clear()  # the in-process agent's view is stale: the process had the node
