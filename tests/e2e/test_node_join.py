"""Issue 16 (ADR 0070), as an operator runs a fleet: a control plane started with `space controlplane run`
on a real PostgreSQL and the S3 server, a real runsc node joined with `space node join` and a token from
`space controlplane token create`; a sandbox created through the control plane, exec'd in, deleted. The
token is single-use: a second machine joining with it is refused before it starts anything.

Teardown leaves nothing: the joined node is stopped with SIGTERM (as its service manager would), then
purged through a helper started for that, and the host is checked for its mounts, loop devices,
processes, cgroups and network traces."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from space.cli.installation import supervisor_pid
from space.cli.node_join import AGENT_USER
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode
from space.sdk import Space
from tests.support import cluster as c
from tests.support import postgres
from tests.support.host import network_traces
from tests.support.s3server import DUMMY_CREDENTIALS, S3Server

pytestmark = pytest.mark.root

postgres_url = postgres.postgres_url
JOIN_TIMEOUT_S = 600.0


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    with c.root_scratch("join") as made:
        yield made


def _config(root: pathlib.Path, s3: S3Server, cgroup_parent: str) -> pathlib.Path:
    """One file for both roles: the object store's endpoint and credentials, the node's cgroup."""
    path = root / "space.toml"
    path.write_text(
        f'[controlplane]\nkeys_dir = "{root / "keys"}"\n'
        f'[node]\ncgroup_parent = "{cgroup_parent}"\ntemplates = "python"\n'
        f'[objects]\nendpoint = "{s3.endpoint}"\nregion = "us-east-1"\n'
        f'access_key_id = "{DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]}"\n'
        f'secret_access_key = "{DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}"\n'
    )
    path.chmod(0o600)
    return path


def _purge(data_dir: pathlib.Path, cgroup_parent: str) -> dict[str, list[str]]:
    """Destroy what the stopped node left (sandboxes, network, btrfs image); what is left on the host."""
    import pwd

    try:
        uid = pwd.getpwnam(AGENT_USER).pw_uid
    except KeyError:
        uid = 0
    node = LocalNode(data_dir, agent_user=uid, cgroup_parent=cgroup_parent)
    ids = c.sandbox_ids_in(data_dir)
    if data_dir.exists():
        node.start_helper()
        asyncio.run(node.stop(purge=True))
    left = {k: v for k, v in c.host_leftovers(data_dir, ids).items() if v}
    traces = network_traces(node_tag(data_dir.resolve()))
    if traces:
        left["network"] = traces
    for group in pathlib.Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}"):
        with contextlib.suppress(OSError):
            group.rmdir()
    return left


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_a_node_joins_with_a_single_use_token_and_runs_sandboxes(
    postgres_url: str, s3_server: S3Server, root: pathlib.Path, detach: bool
) -> None:
    database = postgres.new_database(postgres_url)
    s3_server.create_bucket("join")
    cgroup_parent = f"space-join-{secrets.token_hex(3)}"
    config = _config(root, s3_server, cgroup_parent)
    cp_port, node_port = c.free_port(), c.free_port()
    cp_url = f"http://127.0.0.1:{cp_port}"
    objects = "s3://join/fleet"
    controlplane = c.Service(
        "controlplane",
        [sys.executable, "-m", "space.cli.main", "controlplane", "run", "--config", str(config),
         "--database", database, "--objects", objects, "--listen", f"127.0.0.1:{cp_port}",
         "--data-dir", str(root / "cp")],
        root / "controlplane.log",
    )  # fmt: skip
    node_dir = root / "node"
    joined: subprocess.Popen[bytes] | None = None
    try:
        controlplane.start()
        c.wait_for(lambda: _healthy(controlplane, cp_url), timeout=c.START_TIMEOUT_S, interval=0.1, what="cp")
        admin_key = c.space_cli("controlplane", "admin-key", "create", "--database", database).stdout.strip()
        made = c.space_cli("controlplane", "token", "create", "--database", database)
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip()
        token_file = root / "token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        argv = [sys.executable, "-m", "space.cli.main", "node", "join", cp_url,
                "--token-file", str(token_file), "--data-dir", str(node_dir), "--config", str(config),
                "--objects", objects,
                "--listen", f"127.0.0.1:{node_port}", *(["--detach"] if detach else [])]  # fmt: skip
        with open(root / "join.log", "wb") as log:
            joined = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=c._child_env(), cwd=c.REPO,
                start_new_session=True,
            )  # fmt: skip
        if detach:  # returns once the node has enrolled, its supervisor left running in its own session
            assert joined.wait(JOIN_TIMEOUT_S) == 0, (root / "join.log").read_text()[-3000:]
            assert supervisor_pid(node_dir) is not None
        with Space(url=cp_url, api_key=admin_key) as sp:
            _wait_ready(sp, None if detach else joined, root / "join.log")
            # the join says which node it made once the node holds its identity (and the token is gone)
            c.wait_for(lambda: "SPACE_NODE_ID=node-" in (root / "join.log").read_text() or detach, timeout=60,
                       interval=0.2, what="SPACE_NODE_ID")  # fmt: skip
            assert not (node_dir / "enrolment.token").exists(), "the spent token is not kept"
            sandbox = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
            try:
                assert sandbox.exec("echo joined").stdout == "joined\n"
            finally:
                sandbox.delete()
        again = c.space_cli("node", "join", cp_url, "--token", token, "--data-dir", str(root / "node2"),
                       "--config", str(config))  # fmt: skip
        assert again.returncode == 5, again.stderr  # exit code of Unauthenticated
        assert "--token is refused" in again.stderr and "used already" in again.stderr
        assert token not in again.stderr + again.stdout
        assert not (root / "node2").exists(), "a refused join starts nothing"
    finally:
        if detach:  # the detached supervisor is stopped as `space up`'s is
            down = c.space_cli("down", "--data-dir", str(node_dir))
            assert down.returncode == 0, down.stderr
            assert supervisor_pid(node_dir) is None
        if joined is not None and joined.poll() is None:
            joined.terminate()
            try:
                joined.wait(120)
            except subprocess.TimeoutExpired:
                joined.kill()
                joined.wait()
        controlplane.stop()
        logs = "".join(
            path.read_text(errors="replace")
            for path in (root / "join.log", node_dir / "agent.log", node_dir / "space.log")
            if path.exists()
        )
        left = _purge(node_dir, cgroup_parent)
    assert joined is not None and joined.returncode == 0, (root / "join.log").read_text()[-3000:]
    assert left == {}
    assert "agent" in logs and token not in logs, "the token is never logged"


def _healthy(service: c.Service, url: str) -> bool:
    service.check_alive()
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(sp: Space, joined: subprocess.Popen[bytes] | None, log: pathlib.Path) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        assert joined is None or joined.poll() is None, log.read_text(errors="replace")[-3000:]
        nodes = sp.nodes.list()
        if any(node.data.get("status") == "ready" and (node.data.get("capacity") or {}) for node in nodes):
            return
        time.sleep(0.5)
    raise AssertionError("the joined node did not become ready:\n" + log.read_text(errors="replace")[-3000:])
