"""Issue 16's fleet on three "machines" of this one (ADR 0070): three network namespaces joined by a bridge,
each with its own data directories. The control-plane "machine" runs a pair of `space controlplane run`
replicas on one real PostgreSQL; two node "machines" each run `space node join` (real runsc) against a
different replica; the S3-protocol server listens on the bridge's host address.

1. a sandbox is suspended on the node it runs on and, that node cordoned, restored on the other one with
   its file;
2. that node is drained: the sandbox moves back, running, with its file;
3. the machine it is on stops SPACE and joins again (no token: the node's identity): the sandbox, which
   kept running, is adopted;
4. the control plane is backed up (`space backup create`) and restored into a fresh database and data
   directory; a control plane started on the restored state knows the sandbox and the nodes.

What a real multi-machine run would add: clock offsets between machines (ADR 0033's assumptions), real
latency and loss on the links, DNS names and certificates for TLS between machines, separate kernels and
disks (here they share one kernel, its cgroups and its page cache), and PostgreSQL on its own machine
reached over TCP (here: its unix socket)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from space.node.helper.netaddr import node_tag
from space.sdk import Space
from tests.support import cluster as c
from tests.support import postgres
from tests.support.host import loop_devices_for, network_traces
from tests.support.s3server import DUMMY_CREDENTIALS, S3Server, stop_server

pytestmark = pytest.mark.root

postgres_url = postgres.postgres_url
READY_TIMEOUT_S = 600.0
MOVE_TIMEOUT_S = 300.0
LOOP_RELEASE_S = 60.0
PAYLOAD = b"it travels between machines\n"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class Machines:
    """The bridge and the three namespaces: `address(name)` on the bridge, `host` the bridge's own."""

    tag: str
    subnet: str

    @property
    def bridge(self) -> str:
        return f"spbr{self.tag}"

    @property
    def host(self) -> str:
        return f"{self.subnet}.1"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{ {'cp': 10, 'a': 11, 'b': 12}[name] }"

    def namespace(self, name: str) -> str:
        return f"spm{self.tag}{name}"

    def inside(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run in that machine's network namespace only (its mounts and cgroups are the host's:
        `ip netns exec` would remount /sys and hide the cgroup tree runsc needs)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(name)}", "--", *argv]


@pytest.fixture
def machines() -> Iterator[Machines]:
    if os.geteuid() != 0:
        pytest.fail("three machines need network namespaces and root helpers: run the tests as root")
    tag = secrets.token_hex(2)
    made = Machines(tag, f"10.213.{secrets.randbelow(200) + 20}")
    try:
        _run("ip", "link", "add", made.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{made.host}/24", "dev", made.bridge)
        _run("ip", "link", "set", made.bridge, "up")
        for name in ("cp", "a", "b"):
            ns, outside, inside = made.namespace(name), f"spv{tag}{name}", f"spi{tag}{name}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", made.bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "-n", ns, "addr", "add", f"{made.address(name)}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for name in ("cp", "a", "b"):
            subprocess.run(["ip", "netns", "del", made.namespace(name)], check=False, capture_output=True)
            subprocess.run(["ip", "link", "del", f"spv{tag}{name}"], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", made.bridge], check=False, capture_output=True)


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    made = pathlib.Path("/var/tmp") / f"space-test-fleet3-{secrets.token_hex(4)}"
    made.mkdir(mode=0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def bridge_s3(machines: Machines, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The S3-protocol server on the bridge's host address, reachable from every machine."""
    for name, value in DUMMY_CREDENTIALS.items():  # this process's own client (the bucket)
        monkeypatch.setenv(name, value)
    port = c.free_port()
    log_dir = pathlib.Path(f"/var/tmp/space-moto-{secrets.token_hex(4)}")
    log_dir.mkdir()
    log_path = log_dir / "moto.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", machines.host, "-p", str(port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **DUMMY_CREDENTIALS},
        )  # fmt: skip
    server = S3Server(f"http://{machines.host}:{port}", process, log_path)
    try:
        c.wait_for(
            lambda: _answers(server.endpoint), timeout=60, interval=0.2, what=f"moto on {machines.host}"
        )
        server.create_bucket("fleet")
        yield server
    finally:
        stop_server(server)


def _answers(endpoint: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        httpx.get(endpoint, timeout=2.0)
        return True
    return False


def _space(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", *argv], capture_output=True, text=True, timeout=300,
        env=c._child_env(**(env or {})), cwd=c.REPO, check=False,
    )  # fmt: skip


def _healthy(service: c.Service, url: str) -> bool:
    service.check_alive()
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


#: Run inside a machine's namespace: purge the node of DATA_DIR (argv 1) under cgroup parent argv 2 through
#: a helper started for that (its links and nftables table are in that namespace).
PURGE = """
import asyncio, pathlib, pwd, sys
from space.node.local import LocalNode
try:
    uid = pwd.getpwnam("space").pw_uid
except KeyError:
    uid = 0
node = LocalNode(pathlib.Path(sys.argv[1]), agent_user=uid, cgroup_parent=sys.argv[2])
node.start_helper()
asyncio.run(node.stop(purge=True))
"""


def _purge(machines: Machines, name: str, data_dir: pathlib.Path, cgroup_parent: str) -> dict[str, object]:
    """Destroy what the stopped node left, from inside its machine; what is left on the host. A loop
    device the kernel releases late (seen on this loaded machine, tests/support/realcluster.py) is waited
    for, not counted."""
    ids = c.sandbox_ids_in(data_dir)
    found: dict[str, object] = {}
    if data_dir.exists():
        done = subprocess.run(
            machines.inside(name, [sys.executable, "-c", PURGE, str(data_dir), cgroup_parent]),
            capture_output=True, text=True, env=c._child_env(), cwd=c.REPO, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0 and "loop devices still attached" not in done.stderr:
            found["purge"] = done.stderr[-2000:]
    started = time.monotonic()
    while loop_devices_for(str(data_dir)) and time.monotonic() - started < LOOP_RELEASE_S:
        time.sleep(0.5)
    left = {k: v for k, v in c.host_leftovers(data_dir, ids).items() if v}
    traces = network_traces(node_tag(data_dir.resolve()))
    if traces:
        left["network"] = traces
    for group in pathlib.Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}"):
        with contextlib.suppress(OSError):
            group.rmdir()
    return {**found, **left}


def _wait(what: str, check: object, timeout: float) -> None:
    assert callable(check)
    c.wait_for(check, timeout=timeout, interval=0.5, what=what)


def test_three_machines_move_drain_and_back_up(
    machines: Machines, bridge_s3: S3Server, postgres_url: str, root: pathlib.Path
) -> None:
    database = postgres.new_database(postgres_url)
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    run_tag = secrets.token_hex(2)
    config = root / "space.toml"
    config.write_text(
        f'[controlplane]\nnode_token_file = "{token_file}"\nkeys_dir = "{root / "keys"}"\n'
        f'[objects]\nendpoint = "{bridge_s3.endpoint}"\nregion = "us-east-1"\n'
        f'access_key_id = "{DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]}"\n'
        f'secret_access_key = "{DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}"\n'
    )
    config.chmod(0o600)
    objects = "s3://fleet/objects"
    cp_host = machines.address("cp")
    ports = [c.free_port(), c.free_port()]
    replicas = [
        c.Service(
            f"cp{i}",
            machines.inside(
                "cp",
                [
                    sys.executable,
                    "-m",
                    "space.cli.main",
                    "controlplane",
                    "run",
                    "--config",
                    str(config),
                    "--database",
                    database,
                    "--objects",
                    objects,
                    "--listen",
                    f"{cp_host}:{port}",
                    "--data-dir",
                    str(root / f"cp{i}"),
                ],
            ),
            root / f"cp{i}.log",
        )
        for i, port in enumerate(ports)
    ]
    urls = [f"http://{cp_host}:{port}" for port in ports]
    joins: dict[str, subprocess.Popen[bytes]] = {}
    cgroups = {name: f"space-f3{name}-{run_tag}" for name in ("a", "b")}
    restored: c.Service | None = None
    try:
        for replica in replicas:
            replica.start()
        for replica, url in zip(replicas, urls, strict=True):
            _wait(replica.name, lambda r=replica, u=url: _healthy(r, u), c.START_TIMEOUT_S)
        # The first replica's credentials master key is the pair's (docs/operations.md: replicas share it).
        admin_key = _space("controlplane", "admin-key", "create", "--database", database).stdout.strip()
        for name, url in zip(("a", "b"), urls, strict=True):
            token = _space("controlplane", "token", "create", "--database", database).stdout.strip()
            (root / f"token-{name}").write_text(token + "\n")
            (root / f"token-{name}").chmod(0o600)
            node_config = root / f"node-{name}.toml"
            node_config.write_text(config.read_text() + f'[node]\ncgroup_parent = "{cgroups[name]}"\n')
            node_config.chmod(0o600)
            with open(root / f"join-{name}.log", "wb") as log:
                joins[name] = subprocess.Popen(
                    machines.inside(name, [
                        sys.executable, "-m", "space.cli.main", "node", "join", url,
                        "--token-file", str(root / f"token-{name}"), "--data-dir", str(root / f"node-{name}"),
                        "--config", str(node_config), "--objects", objects,
                        "--listen", f"{machines.address(name)}:7070"]),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=c._child_env(), cwd=c.REPO,
                    start_new_session=True,
                )  # fmt: skip
        with Space(url=urls[0], api_key=admin_key) as sp:

            def both_ready() -> bool:
                for name, join in joins.items():
                    assert join.poll() is None, (root / f"join-{name}.log").read_text()[-3000:]
                ready = [
                    n for n in sp.nodes.list() if n.data.get("status") == "ready" and n.data.get("capacity")
                ]
                return len(ready) == 2

            _wait("both nodes ready", both_ready, READY_TIMEOUT_S)
            sandbox = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
            sandbox.files.write("/work/hello", PAYLOAD)
            first = str(sandbox.refresh().data["node_id"])
            # 1. suspended on its node, restored on the other (its own node cordoned)
            assert sandbox.suspend().state == "suspended"
            sp.nodes.cordon(first)
            assert sandbox.restore().state == "running"
            second = str(sandbox.refresh().data["node_id"])
            assert second != first
            assert sandbox.files.read("/work/hello") == PAYLOAD
            sp.nodes.uncordon(first)
            # 2. its new node drained: it comes back to the first one, running, with its file
            sp.nodes.drain(second)
            _wait("drained", lambda: sp.nodes.get(second).admin == "drained", MOVE_TIMEOUT_S)
            _wait("back running", lambda: sandbox.refresh().state == "running", MOVE_TIMEOUT_S)
            assert str(sandbox.data["node_id"]) == first
            assert sandbox.exec("cat /work/hello").stdout == PAYLOAD.decode()
            # 3. its node's machine stops SPACE (SIGTERM, as its service manager would) and joins again
            # without a token: the node keeps its identity and adopts the sandbox, which never stopped
            name = next(n for n in joins if f"SPACE_NODE_ID={first}" in (root / f"join-{n}.log").read_text())
            joins[name].send_signal(signal.SIGTERM)
            assert joins[name].wait(120) == 0, (root / f"join-{name}.log").read_text()[-3000:]
            assert sp.nodes.get(first).data.get("status") == "offline"  # it said goodbye (deregistered)
            with open(root / f"join-{name}.log", "ab") as log:
                joins[name] = subprocess.Popen(
                    machines.inside(name, [
                        sys.executable, "-m", "space.cli.main", "node", "join", urls[1],
                        "--data-dir", str(root / f"node-{name}"), "--config", str(root / f"node-{name}.toml"),
                        "--objects", objects, "--listen", f"{machines.address(name)}:7070"]),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=c._child_env(), cwd=c.REPO,
                    start_new_session=True,
                )  # fmt: skip
            _wait("rejoined", lambda: both_ready() and sp.nodes.get(first).data.get("status") == "ready", 300)
            assert sandbox.exec("cat /work/hello").stdout == PAYLOAD.decode()
            assert sandbox.refresh().state == "running" and sandbox.data["node_id"] == first
        # 4. back up the pair's state, restore it into a fresh database and directory, serve it
        archive = root / "backup.tar.gz"
        made = _space("backup", "create", "--data-dir", str(root / "cp0"), "--database", database,
                      "--node-token-file", str(token_file), "--keys-dir", str(root / "keys"),
                      "--output", str(archive))  # fmt: skip
        assert made.returncode == 0, made.stderr
        fresh = postgres.new_database(postgres_url)
        back = _space("backup", "restore", str(archive), "--data-dir", str(root / "restored"),
                      "--database", fresh, "--node-token-file", str(root / "restored.token"),
                      "--keys-dir", str(root / "restored-keys"))  # fmt: skip
        assert back.returncode == 0, back.stderr
        port = c.free_port()
        restored = c.Service(
            "restored",
            [sys.executable, "-m", "space.cli.main", "controlplane", "run", "--database", fresh,
             "--data-dir", str(root / "restored"), "--node-token-file", str(root / "restored.token"),
             "--listen", f"127.0.0.1:{port}"],
            root / "restored.log",
        )  # fmt: skip
        restored.extra_env = {"SPACE_KEYS_DIR": str(root / "restored-keys")}
        restored.start()
        _wait("restored", lambda: _healthy(restored, f"http://127.0.0.1:{port}"), c.START_TIMEOUT_S)
        with Space(url=f"http://127.0.0.1:{port}", api_key=admin_key) as copy:
            assert sandbox.id in {s.id for s in copy.sandboxes.list()}
            assert {n.id for n in copy.nodes.list()} >= {first, second}
        restored.stop()
        with Space(url=urls[1], api_key=admin_key) as sp:
            sp.sandboxes.get(sandbox.id).delete()
    finally:
        if restored is not None:
            restored.stop()
        for join in joins.values():
            if join.poll() is None:
                join.send_signal(signal.SIGTERM)
        for join in joins.values():
            try:
                join.wait(120)
            except subprocess.TimeoutExpired:
                join.kill()
                join.wait()
        for replica in replicas:
            replica.stop()
        left = {name: _purge(machines, name, root / f"node-{name}", cgroups[name]) for name in ("a", "b")}
    left = {name: found for name, found in left.items() if found}
    assert left == {}, json.dumps(left, indent=1, default=str)[-6000:]
    for name, join in joins.items():
        assert join.returncode == 0, (root / f"join-{name}.log").read_text()[-3000:]
