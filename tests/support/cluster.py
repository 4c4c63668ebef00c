"""Whole control planes for tests: API + reconciler processes over a node agent, as real subprocesses.

- `fake_cluster` (session scope, no root): one control plane (`python -m space.controlplane.server`, SQLite in
  a temp dir) and one node agent with the FAKE driver (sandboxes are plain host processes). Tests share it
  and isolate themselves with `project` (a fresh project + member key per test, its sandboxes deleted after).
- `start_fake_cluster(...)`: the same as a context manager, for tests that kill, stop or restart processes
  (crash convergence, lost nodes) or that run several control planes on one PostgreSQL database.
- `real_cluster` (session scope, root): ONE `space.controlplane.local.LocalCluster` (root helper + runsc node
  agent + control plane) for every module that binds it (a reference count, as for `fake_cluster`), purged
  at the end and checked for leaks on the host. A test that kills or reconfigures a component starts its
  own with `start_real_cluster()`.

Everything the tests wait for is polled with a deadline (`wait_for`); nothing sleeps to assert.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest

from space.controlplane.reconciler.loop import process_start_time
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core.lifecycle import IN_PROGRESS_STATES, State
from space.node.agent.identity import default_identity_file, default_rpc_token_file
from space.sdk import Space
from tests.support.host import cgroups_under, loop_devices_for, mounts_under, processes_mentioning
from tests.support.node_capability import NodeAuth
from tests.support.shared_server import SharedServer

T = TypeVar("T")

REPO = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
#: How often fake nodes sample their sandboxes' metrics (NodeAgentSettings.metrics_interval_s), seconds.
METRICS_INTERVAL_S = "1"
#: Small limits so that many sandboxes fit on a fake node (the scheduler overcommits CPUs 4x only).
SMALL = {"cpus": 0.1, "memory_mb": 64}


def free_port() -> int:
    """A free loopback port BELOW the kernel's ephemeral range. Services the tests kill and start again
    rebind their port; a port from the ephemeral range can meanwhile become the source port of some
    outgoing connection (agents retrying the dead control plane, say), and the restart then fails with
    EADDRINUSE. Ports below the range are never handed out as source ports.

    `make test` runs two pytest sessions side by side (scripts/run_tests.py) and gives each its own part
    of that range in SPACE_TEST_PORTS ("LOW-HIGH"): a port one session checked free, or freed to restart
    its service on it, is never picked by the other (CI once had a control plane fail to bind that way)."""
    low, high = 10000, _ephemeral_low()
    if ports := os.environ.get("SPACE_TEST_PORTS"):
        low, high = (int(part) for part in ports.split("-", 1))
    for _attempt in range(200):
        port = random.randrange(low, max(high, low + 1))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high}")


def _ephemeral_low() -> int:
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_for(check: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Call `check` until it returns something truthy; AssertionError with the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout:.1f}s: {what} (last value: {last!r})")
        time.sleep(interval)


def space_cli(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`space ARGV...` as an operator runs it (the test environment, from the repository); never raises on
    a failing command: the caller asserts on it."""
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", *argv], capture_output=True, text=True, timeout=timeout,
        env=_child_env(), cwd=REPO, check=False,
    )  # fmt: skip


@contextlib.contextmanager
def root_scratch(name: str) -> Iterator[pathlib.Path]:
    """A directory under /var/tmp for a test whose node runs its root helper (root only), removed after."""
    if os.geteuid() != 0:
        pytest.fail("a joined node runs its root helper: run the tests as root")
    made = pathlib.Path("/var/tmp") / f"space-test-{name}-{secrets.token_hex(4)}"
    made.mkdir(mode=0o755)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _child_env(**extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    env.update(extra)
    return env


class Service:
    """One subprocess (its own session, output in a log file) that tests may kill, stop and restart."""

    def __init__(self, name: str, argv: list[str], log_path: pathlib.Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        #: Extra environment for the next start (e.g. SPACE_FAILPOINTS for crash injection).
        self.extra_env: dict[str, str] = {}

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is already running"
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_child_env(**self.extra_env),
                cwd=REPO, start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing gets to clean up."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (and SIGCONT, in case a test left it stopped), then SIGKILL if it does not exit."""
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if not self.alive:
            raise AssertionError(
                f"{self.name} exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}"
            )


class ControlPlane(Service):
    def __init__(
        self,
        data_dir: pathlib.Path,
        token_file: pathlib.Path,
        *,
        database_url: str | None,
        name: str,
        store_url: str | None = None,
        keys_dir: pathlib.Path | None = None,
    ) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "space.controlplane.server", "--data-dir", str(data_dir),
                "--port", str(self.port), "--node-token-file", str(token_file),
                "--log-level", "warning"]  # fmt: skip
        if database_url is not None:
            argv += ["--database-url", database_url]
        if store_url is not None:
            argv += ["--store-url", store_url]
        if keys_dir is not None:
            argv += ["--keys-dir", str(keys_dir)]
        super().__init__(name, argv, data_dir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def owner(self) -> str:
        """The reconciler's lease owner name in this process (Reconciler's default: host, pid, start time)."""
        return f"{socket.gethostname()}:{self.pid}:{process_start_time(self.pid)}"

    def healthy(self) -> bool:
        self.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200
        return False

    def start_and_wait(self) -> None:
        self.start()
        wait_for(self.healthy, timeout=START_TIMEOUT_S, interval=0.1, what=f"{self.name} healthy")


class FakeNode(Service):
    def __init__(
        self,
        data_dir: pathlib.Path,
        token_file: pathlib.Path,
        control_plane: str,
        *,
        store_url: str | None = None,
        name: str = "node",
    ) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.token = token_file.read_text().strip()  # the cluster's bootstrap token: enrols, nothing else
        argv = [sys.executable, "-m", "space.node.agent.server", "--driver", "fake",
                "--data-dir", str(data_dir), "--listen", f"127.0.0.1:{self.port}",
                "--bootstrap-token-file", str(token_file), "--control-plane", control_plane,
                "--log-level", "warning"]  # fmt: skip
        if store_url is not None:
            argv += ["--store-url", store_url]
        super().__init__(name, argv, data_dir / "node.log")
        # Metrics every second (default 5): the tests of the metrics history wait for samples (ADR 0053).
        self.extra_env["SPACE_NODE_METRICS_INTERVAL_S"] = METRICS_INTERVAL_S

    @property
    def url(self) -> str:
        """The URL it registers: the agent's default advertised URL (https when it serves TLS)."""
        scheme = "https" if "--tls-cert" in self.argv else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def rpc_token(self) -> str:
        """The node's own RPC token (made by the node at its first start; ADR 0021)."""
        return default_rpc_token_file(self.data_dir).read_text().strip()

    @property
    def identity(self) -> tuple[str, str]:
        """(node id, identity) the node persisted at its enrolment."""
        data = json.loads(default_identity_file(self.data_dir).read_text())
        return str(data["node_id"]), str(data["identity"])

    def get(self, path: str, **kw: Any) -> httpx.Response:
        # NodeAuth: the token, and a capability for the sandbox the path names (as the control plane sends)
        return httpx.get(f"{self.url}/node/v1{path}", auth=NodeAuth(self.rpc_token), timeout=10, **kw)

    def sandboxes(self) -> dict[str, dict[str, Any]]:
        """What the node runs: id -> observed (from GET /node/v1/sandboxes?guest=false)."""
        answer = self.get("/sandboxes", params={"guest": "false"})
        answer.raise_for_status()
        body = answer.json()
        assert body.get("unmanaged", []) == [], f"the node holds unmanaged leftovers: {body['unmanaged']}"
        items = body["sandboxes"]
        ids = [item["id"] for item in items]
        assert len(ids) == len(set(ids)), f"the node lists a sandbox twice: {ids}"
        return {item["id"]: item for item in items}

    def guest_processes(self) -> dict[str, int]:
        """sandbox id -> number of `spaced` processes running in its directory (the fake driver's sandboxes
        are host processes whose cwd is <data dir>/sandboxes/<id>/work)."""
        base = str(self.data_dir / "sandboxes") + "/"
        counts: dict[str, int] = {}
        for proc in pathlib.Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cwd = os.readlink(proc / "cwd")
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cwd.startswith(base) and b"space.guest" in cmdline:
                sandbox_id = cwd[len(base) :].split("/")[0]
                counts[sandbox_id] = counts.get(sandbox_id, 0) + 1
        return counts


def processes_in(directory: pathlib.Path) -> list[str]:
    """Processes whose command line or working directory is under `directory`."""
    prefix = str(directory)
    found = processes_mentioning(prefix)
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(proc / "cwd").startswith(prefix):
                found.append(f"{proc.name}: cwd {os.readlink(proc / 'cwd')}")
    return found


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Cluster:
    """Control plane(s) + one fake node, and direct access to their database (for checks only)."""

    root: pathlib.Path
    database_url: str
    token_file: pathlib.Path
    store: Store
    org_id: str
    project_id: str
    admin_key: str
    control_planes: list[ControlPlane]
    node: FakeNode
    clients: list[httpx.Client] = field(default_factory=list)
    #: More fake nodes (start_fake_cluster(nodes=N)); all share `store_url`, the cluster's object store.
    more_nodes: list[FakeNode] = field(default_factory=list)
    store_url: str | None = None

    @property
    def nodes(self) -> list[FakeNode]:
        return [self.node, *self.more_nodes]

    @property
    def cp(self) -> ControlPlane:
        return self.control_planes[0]

    @property
    def url(self) -> str:
        return self.cp.url

    def http(self, key: str | None = None, cp: int = 0, **kw: Any) -> httpx.Client:
        """A client of control plane `cp` sending `key` (closed with the cluster). Plain HTTP only, so no
        TLS context is built: making an httpx client with one costs ~60 ms of CPU."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kw.pop("headers", {}))
        client = httpx.Client(
            base_url=self.control_planes[cp].url, headers=headers, timeout=kw.pop("timeout", 60.0),
            verify=False, **kw,
        )  # fmt: skip
        self.clients.append(client)
        return client

    def sdk(self, key: str | None = None, cp: int = 0, **kw: Any) -> Space:
        """An SDK client (plain HTTP: its transport is built without a TLS context, see `http`)."""
        kw.setdefault("transport", httpx.HTTPTransport(verify=False))
        return Space(url=self.control_planes[cp].url, api_key=key or self.admin_key, **kw)

    # -- database views ----------------------------------------------------------------------------------
    def node_record(self) -> NodeRecord | None:
        nodes = [n for n in self.store.list_nodes(None) if n.url == self.node.url]
        return nodes[0] if nodes else None

    def node_ready(self) -> bool:
        self.node.check_alive()
        record = self.node_record()
        return record is not None and record.status == "ready" and bool(record.capacity)

    def records(self, project_id: str | None = None) -> dict[str, SandboxRecord]:
        """Live (not deleted) sandbox records of a project (default: the org's default project)."""
        return {sb.id: sb for sb in self.store.list_sandboxes(project_id or self.project_id)}

    def converged(self, project_id: str | None = None) -> str | None:
        """None when the database and the node agree and nothing is in flight; else what is not yet so."""
        records = self.records(project_id)
        problems = []
        for sb in records.values():
            if sb.state in IN_PROGRESS_STATES or sb.state != sb.desired_state or sb.state == State.PENDING:
                problems.append(f"{sb.id}: {sb.state} -> {sb.desired_state} ({sb.error})")
        on_node = self.node.sandboxes()
        mine = {sid for sid, sb in records.items() if sb.node_id is not None}
        everyone = {sb.id for sb in self.store.list_sandboxes_on_node(self.node_record().id)}  # type: ignore[union-attr]
        for sid in mine - set(on_node):
            problems.append(f"{sid}: in the database ({records[sid].state}) but not on the node")
        for sid in set(on_node) - everyone:
            problems.append(f"{sid}: orphan on the node ({on_node[sid]['state']})")
        for sid in mine & set(on_node):
            if on_node[sid]["state"] != records[sid].state.value:
                problems.append(f"{sid}: node says {on_node[sid]['state']}, database {records[sid].state}")
        return "; ".join(problems) or None

    def wait_converged(self, timeout: float, project_id: str | None = None) -> float:
        """Seconds it took until `converged` (AssertionError naming what is not after `timeout`)."""
        started = time.monotonic()
        last: str | None = "not checked"
        while time.monotonic() - started < timeout:
            last = self.converged(project_id)
            if last is None:
                return time.monotonic() - started
            time.sleep(0.1)
        raise AssertionError(f"not converged within {timeout:.0f}s: {last}\n{self.logs()}")

    def logs(self) -> str:
        services = [*self.control_planes, *self.nodes]
        parts = [f"--- {s.name} log ---\n{s.log_tail(1500)}" for s in services]
        return "\n".join(parts)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for cp in self.control_planes:
            cp.stop(timeout=5)  # uvicorn waits for open requests (long polls of `wait`) on SIGTERM
        for node in self.nodes:
            node.stop()
        self.store.close()


def bootstrap(database_url: str) -> tuple[Store, str, str, str]:
    """Migrate, then org "default", project "default" and an org admin key, straight in the store."""
    migrate(database_url)
    store = Store(database_url)
    org = store.create_org("default")
    project = store.create_project(org.id, "default")
    _record, secret = store.create_api_key(None, org.id, "admin")
    return store, org.id, project.id, secret


@contextlib.contextmanager
def start_fake_cluster(
    root: pathlib.Path,
    *,
    database_url: str | None = None,
    control_planes: int = 1,
    node_reports_to: int = 0,
    nodes: int = 1,
    object_store: bool = False,
    control_plane_args: tuple[str, ...] = (),
    control_plane_env: dict[str, str] | None = None,
    node_args: tuple[str, ...] = (),
    node_env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """Control plane(s) over `database_url` (default: SQLite in `root`) + fake node(s) that register with
    and heartbeat to control plane number `node_reports_to`; everything is killed at the end and nothing
    may be left running in `root`. With `object_store`, the control plane(s) and every node share a local
    directory store (`cluster.store_url`, under `root/objects`): suspend, restore, uploads.
    `control_plane_args`: extra arguments of the control planes (e.g. --snapshot-min-intervals 1,1); they
    survive restarts, unlike `extra_env`. `control_plane_env`: environment of the control planes' first
    start (e.g. SPACE_NODE_LOST_AFTER_S). `node_args`, `node_env`: the same for the fake nodes."""
    root.mkdir(parents=True, exist_ok=True)
    url = database_url or sqlite_url(root / "cp")
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    store, org_id, project_id, admin_key = bootstrap(url)
    cps = []
    for i in range(control_planes):
        cp_dir = root / f"cp{i}" if i else root / "cp"
        cp_dir.mkdir(parents=True, exist_ok=True)
    store_url = None
    if object_store:
        (root / "objects").mkdir(exist_ok=True)
        store_url = (root / "objects").as_uri()
    for i in range(control_planes):
        cp_dir = root / f"cp{i}" if i else root / "cp"
        cp_dir.mkdir(parents=True, exist_ok=True)
        keys_dir = root / "keys" if object_store else None  # shared by the replicas
        cps.append(
            ControlPlane(
                cp_dir,
                token_file,
                database_url=database_url,
                name=f"controlplane{i}",
                store_url=store_url,
                keys_dir=keys_dir,
            )
        )
    for cp in cps:
        cp.argv += list(control_plane_args)
        cp.extra_env.update(control_plane_env or {})
    fake_nodes = []
    for i in range(nodes):
        node_dir = root / ("node" if i == 0 else f"node{i}")
        node_dir.mkdir()
        fake_nodes.append(
            FakeNode(
                node_dir, token_file, cps[node_reports_to].url, store_url=store_url,
                name="node" if i == 0 else f"node{i}",
            )
        )  # fmt: skip
    for each in fake_nodes:
        each.argv += list(node_args)
        each.extra_env.update(node_env or {})
    node = fake_nodes[0]
    cluster = Cluster(root, url, token_file, store, org_id, project_id, admin_key, cps, node)
    cluster.more_nodes = fake_nodes[1:]
    cluster.store_url = store_url
    try:
        for cp in cps:
            cp.start()
        for each in fake_nodes:
            each.start()
        for cp in cps:
            wait_for(cp.healthy, timeout=START_TIMEOUT_S, interval=0.1, what=f"{cp.name} healthy")
        wait_for(cluster.node_ready, timeout=START_TIMEOUT_S, interval=0.1, what="node registered")
        for each in fake_nodes[1:]:

            def registered(n: FakeNode = each) -> bool:
                n.check_alive()  # a node that died at start says why (its log), instead of a timeout
                return any(r.url == n.url and r.status == "ready" for r in store.list_nodes(None))

            wait_for(registered, timeout=START_TIMEOUT_S, interval=0.1, what=f"{each.name} registered")
        yield cluster
    finally:
        cluster.close()
        left = processes_in(root)
        kill_pids(int(line.split(":")[0]) for line in left)
        assert left == [], f"processes left behind by the cluster: {left}"


_shared_lock = threading.Lock()
_shared: tuple[Cluster, contextlib.ExitStack] | None = None
_shared_users = 0


@pytest.fixture(scope="session")
def fake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the whole run. Test modules bind this fixture at module level
    (`fake_cluster = tests.support.cluster.fake_cluster`), which makes one fixture per module: they share
    the cluster through a reference count, so it starts once and stops after the last user."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            stack = contextlib.ExitStack()
            cluster = stack.enter_context(start_fake_cluster(tmp_path_factory.mktemp("fake-cluster")))
            _shared = (cluster, stack)
        _shared_users += 1
        cluster = _shared[0]
    try:
        yield cluster
    finally:
        with _shared_lock:
            _shared_users -= 1
            if _shared_users == 0 and _shared is not None:
                stack, _shared = _shared[1], None
                stack.close()


@dataclass
class Project:
    """A fresh project of the shared cluster with a member key (its sandboxes deleted at the end)."""

    id: str
    name: str
    key: str
    cluster: Cluster

    def http(self, key: str | None = None) -> httpx.Client:
        return self.cluster.http(key or self.key)

    def sdk(self, **kw: Any) -> Space:
        return self.cluster.sdk(self.key, **kw)

    def new_key(self, role: str) -> tuple[str, str]:
        """(key id, secret) of a new key of this project, made through the API with the org admin key."""
        answer = self.cluster.http(self.cluster.admin_key).post(
            "/v1/keys", json={"project": self.name, "role": role}
        )
        assert answer.status_code == 201, answer.text
        return answer.json()["id"], answer.json()["key"]


def new_project(cluster: Cluster, name: str | None = None) -> Project:
    name = name or f"p-{secrets.token_hex(4)}"
    admin = cluster.http(cluster.admin_key)
    answer = admin.post("/v1/projects", json={"name": name})
    assert answer.status_code == 201, answer.text
    project_id = answer.json()["id"]
    project = Project(project_id, name, "", cluster)
    _key_id, project.key = project.new_key("member")
    return project


def delete_all(cluster: Cluster, project: Project) -> None:
    client = cluster.http(project.key)
    for sb in cluster.store.list_sandboxes(project.id):
        client.delete(f"/v1/sandboxes/{sb.id}", params={"wait": "false"})
    wait_for(
        lambda: not cluster.store.list_sandboxes(project.id),
        timeout=30,
        what=f"sandboxes of {project.name} deleted",
    )


@contextlib.contextmanager
def two_tenants(cluster: Cluster) -> Iterator[tuple[Project, str, Project, str]]:
    """(victim, its sandbox id, attacker, its sandbox id): two projects with one small sandbox each,
    deleted afterwards."""
    victim, attacker = new_project(cluster), new_project(cluster)
    try:
        with victim.sdk() as sp:
            victim_sb = sp.sandboxes.create(limits=SMALL).id
        with attacker.sdk() as sp:
            attacker_sb = sp.sandboxes.create(limits=SMALL).id
        yield victim, victim_sb, attacker, attacker_sb
    finally:
        delete_all(cluster, victim)
        delete_all(cluster, attacker)


@pytest.fixture
def project(fake_cluster: Cluster) -> Iterator[Project]:
    made = new_project(fake_cluster)
    try:
        yield made
    finally:
        delete_all(fake_cluster, made)


# -- the real thing (root) -----------------------------------------------------------------------------------
@dataclass
class RealCluster:
    local: Any  # space.controlplane.local.LocalCluster
    data_dir: pathlib.Path

    @property
    def url(self) -> str:
        return str(self.local.url)

    @property
    def api_key(self) -> str:
        return str(self.local.api_key)

    def sdk(self) -> Space:
        return Space(url=self.url, api_key=self.api_key, transport=httpx.HTTPTransport(verify=False))

    @property
    def e2b_api_url(self) -> str:
        """E2B's control API of this installation (served as `space up` serves it, docs/e2b.md)."""
        return str(self.local.e2b_api_url)

    @property
    def e2b_sandbox_url(self) -> str:
        return str(self.local.e2b_sandbox_url)


def sandbox_ids_in(data_dir: pathlib.Path) -> set[str]:
    """Ids of the sandboxes a node data directory holds (to attribute cgroups: other test sessions may
    run sandboxes on this machine at the same time)."""
    found: set[str] = set()
    for sub in ("fs/sandboxes", "run"):
        root = data_dir / sub
        if root.is_dir():
            found.update(p.name for p in root.iterdir() if p.name.startswith("sb-"))
    return found


def host_leftovers(data_dir: pathlib.Path, sandbox_ids: set[str]) -> dict[str, list[str]]:
    """What is left on the host of an installation in `data_dir` (empty lists when nothing)."""
    prefix = str(data_dir)
    return {
        "mounts": mounts_under(prefix),
        "loop devices": loop_devices_for(prefix),
        "processes": processes_in(data_dir),
        "cgroups": [
            g for g in cgroups_under("space") if pathlib.Path(g).name.rsplit("-", 1)[0] in sandbox_ids
        ],
    }


@contextlib.contextmanager
def start_real_cluster() -> Iterator[RealCluster]:
    """A LocalCluster in a fresh data directory under /var/tmp; purged at the end and the host checked."""
    from space.controlplane.local import LocalCluster

    if os.geteuid() != 0:
        pytest.fail("real_cluster starts the node's root helper: run the tests as root")
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-cluster-", dir="/var/tmp"))
    local = LocalCluster(
        data_dir=data_dir, port=free_port(), e2b_api_port=free_port(), e2b_sandbox_port=free_port()
    )
    try:
        local.start()
        yield RealCluster(local, data_dir)
    finally:
        sandbox_ids = sandbox_ids_in(data_dir)
        local.stop(purge=True)
        left = {k: v for k, v in host_leftovers(data_dir, sandbox_ids).items() if v}
        assert left == {}, f"left on the host by the cluster: {left}"


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    """ONE real installation for the whole run, shared like `fake_cluster`: test modules bind this fixture
    at module level (`real_cluster = tests.support.cluster.real_cluster`), which makes one session fixture
    per module, and a reference count makes them all the same cluster (started by the first user, purged
    after the last). Each test isolates itself (its own sandboxes, projects or keys, deleted at its end);
    a test that kills, stops or reconfigures a component owns its cluster (`start_real_cluster`)."""
    with _shared_real.use() as (made, _stack):
        yield made


def _start_shared_real() -> tuple[RealCluster, contextlib.ExitStack]:
    stack = contextlib.ExitStack()
    return stack.enter_context(start_real_cluster()), stack


_shared_real = SharedServer(_start_shared_real, lambda made: made[1].close())
