"""One control plane and two REAL runsc nodes on this machine, sharing one object store (issue 4, "multi-node
on one machine"), as processes the tests may SIGKILL, SIGSTOP and restart.

Layout (everything under one temporary root in /var/tmp):
- `cp/`: the control plane (`python -m space.controlplane.server`, SQLite, its own key service), started
  with `--store-url` = the shared store;
- `node-a/`, `node-b/`: each node's data directory (btrfs image, runsc root, helper socket, staging) with its
  own root helper (started here through LocalNode, own cgroup parent) and its own node agent running as the
  `space` user (setpriv), started with `--control-plane` and the same `--store-url`;
- `objects/`: the local-directory object store (owned by the agent user: the agents write parts into it).

Invariants:
- Both nodes get the python template from the machine's rootfs cache (prepared in parallel, before the
  agents start), so the set-up pays for one template import per node and nothing else.
- The fixture is module scoped: a test module binds it (`two_nodes = realcluster.two_nodes`) and shares it.
- Teardown leaves nothing, even after a failed test or a test that left a process killed or stopped: the
  control plane and agents are SIGCONTed and stopped, both nodes are purged through their helpers at once
  (runtimes, subvolumes, the btrfs mount, its loop device), anything a failed purge left is unmounted,
  detached and killed by hand, then the host is checked (mounts, loop devices, processes, cgroups, network
  namespaces/links/nftables of the node) and the check's findings fail the module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import pathlib
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from space.controlplane.local import _prepare_node
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core.lifecycle import State
from space.node.agent.identity import default_rpc_token_file
from space.node.helper.netaddr import node_tag
from space.node.layout import NodeLayout
from space.node.local import LocalNode, ensure_local_store
from space.objectstore.artifacts import read_manifest
from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore
from space.objectstore.local import TEMP_MARK
from space.sdk import Space
from tests.support import cluster as c
from tests.support.host import (
    cgroups_under,
    loop_devices_for,
    mounts_under,
    network_traces,
    processes_mentioning,
)

AGENT_USER = "space"
NODE_NAMES = ("a", "b")
READY_TIMEOUT_S = 600.0
LOOP_RELEASE_S = 60.0


def _agent_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(AGENT_USER)
    except KeyError:
        return 0, 0  # no `space` user (a machine without `make setup`): the agents run as root
    return entry.pw_uid, entry.pw_gid


@dataclass
class ClusterNode:
    """One real node: its root helper (LocalNode) and its agent process (a killable Service)."""

    name: str
    local: LocalNode
    agent: c.Service
    port: int

    @property
    def token(self) -> str:
        """The node's own RPC token (made by the agent at its first start; ADR 0021)."""
        return default_rpc_token_file(self.data_dir).read_text().strip()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def layout(self) -> NodeLayout:
        return self.local.layout

    @property
    def data_dir(self) -> pathlib.Path:
        return self.local.layout.data_dir

    def rpc(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(
            f"{self.url}/node/v1{path}", headers={"Authorization": f"Bearer {self.token}"}, timeout=15, **kw
        )

    def answers(self) -> bool:
        if not self.agent.alive:
            return False
        with contextlib.suppress(httpx.HTTPError):
            return self.rpc("/info").status_code == 200
        return False

    def listing(self) -> dict[str, str]:
        """sandbox id -> state, from the agent's own listing (it must be up); asserts it holds nothing it
        does not manage and lists nothing twice."""
        self.agent.check_alive()
        answer = self.rpc("/sandboxes", params={"guest": "false"})
        answer.raise_for_status()
        body = answer.json()
        ids = [item["id"] for item in body["sandboxes"]]
        assert len(ids) == len(set(ids)), f"node {self.name} lists a sandbox twice: {ids}"
        assert body.get("unmanaged", []) == [], (
            f"node {self.name} runs unmanaged runtimes: {body['unmanaged']}"
        )
        return {item["id"]: item["state"] for item in body["sandboxes"]}

    def subvolumes(self, sandbox_id: str) -> list[str]:
        """Every btrfs subvolume of this node that belongs to `sandbox_id` (root filesystem, snapshots,
        half-received ones), read from btrfs itself."""
        out = subprocess.run(
            ["btrfs", "subvolume", "list", str(self.layout.fs)], capture_output=True, text=True, check=True
        ).stdout
        return sorted(
            line.split(" path ", 1)[-1]
            for line in out.splitlines()
            if sandbox_id in line.split(" path ", 1)[-1]
        )

    def runtime_processes(self, sandbox_id: str) -> list[str]:
        """Host processes of this node's runsc for `sandbox_id` (runsc, its sandbox and gofer processes all
        name the node's runsc root and the container id)."""
        root = str(self.layout.runsc_root)
        return [p for p in processes_mentioning(sandbox_id) if root in p]

    def staging(self) -> list[str]:
        root = self.layout.staging
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def traces(self, sandbox_id: str) -> dict[str, list[str]]:
        """What this node holds of `sandbox_id` on the host (empty lists: nothing)."""
        return {
            "subvolumes": self.subvolumes(sandbox_id),
            "runtime processes": self.runtime_processes(sandbox_id),
            "staging": [s for s in self.staging() if sandbox_id in s],
        }


@dataclass
class TwoNodeCluster:
    root: pathlib.Path
    store_url: str
    db: Store
    project_id: str
    admin_key: str
    cp: c.ControlPlane
    nodes: list[ClusterNode]
    _node_ids: dict[str, str] = field(default_factory=dict)
    _sdk: Space | None = None

    # -- clients -----------------------------------------------------------------------------------------
    @property
    def sdk(self) -> Space:
        """The org admin's SDK client (one for the module: sandboxes keep a reference to it)."""
        if self._sdk is None:
            transport = httpx.HTTPTransport(verify=False)  # plain HTTP: no TLS context to build
            self._sdk = Space(url=self.cp.url, api_key=self.admin_key, transport=transport)
        return self._sdk

    def objects(self) -> ObjectStore:
        return open_store(self.store_url)

    # -- nodes -------------------------------------------------------------------------------------------
    def node_id(self, node: ClusterNode) -> str:
        if node.name not in self._node_ids:  # registration is idempotent by URL: the id never changes
            self._node_ids[node.name] = next(n.id for n in self.db.list_nodes(None) if n.url == node.url)
        return self._node_ids[node.name]

    def node(self, node_id: str | None) -> ClusterNode:
        found = [n for n in self.nodes if self.node_id(n) == node_id]
        assert found, f"no node of this cluster has id {node_id}"
        return found[0]

    def other(self, node: ClusterNode) -> ClusterNode:
        return next(n for n in self.nodes if n is not node)

    def node_ready(self, node: ClusterNode) -> bool:
        node.agent.check_alive()
        return any(n.url == node.url and n.capacity for n in self.db.list_nodes("ready"))

    def start_agent(self, node: ClusterNode, timeout: float = 120.0) -> float:
        """(Re)start a node's agent and wait until it answers and the control plane has it `ready`;
        returns the seconds that took."""
        started = time.monotonic()
        node.agent.start()
        c.wait_for(lambda: node.answers() and self.node_ready(node), timeout=timeout, interval=0.1,
                   what=f"agent {node.name} up and ready")  # fmt: skip
        return time.monotonic() - started

    @contextlib.contextmanager
    def drained(self, node: ClusterNode) -> Iterator[None]:
        """Keep the scheduler off `node` (status `draining`: not a candidate, its sandboxes stay), set in
        the database: unlike a cordon (ADR 0065, kept across registrations) a node that registers again (an
        agent restart) becomes `ready`, so restart only the OTHER node's agent inside this block."""
        node_id = self.node_id(node)
        self.db.set_node_status(node_id, "draining")
        try:
            yield
        finally:
            current = self.db.get_node(node_id)
            if current is not None and current.status == "draining":
                self.db.set_node_status(node_id, "ready")

    # -- sandboxes ---------------------------------------------------------------------------------------
    def record(self, sandbox_id: str) -> SandboxRecord:
        sb = self.db.load_sandbox(sandbox_id)
        assert sb is not None, f"sandbox {sandbox_id} has no record"
        return sb

    def holding(self, sandbox_id: str) -> dict[str, str]:
        """node name -> state of its copy of `sandbox_id`, from each (live) agent's own listing."""
        found = {}
        for node in self.nodes:
            state = node.listing().get(sandbox_id)
            if state is not None:
                found[node.name] = state
        return found

    def wait_settled(self, sandbox_id: str, state: State, timeout: float = 120.0) -> SandboxRecord:
        """Until the record is in `state` with nothing more desired; fails early if the control plane died."""

        def reached() -> SandboxRecord | None:
            self.cp.check_alive()
            sb = self.record(sandbox_id)
            return sb if sb.state == state and sb.desired_state == state else None

        found = c.wait_for(reached, timeout=timeout, interval=0.1, what=f"{sandbox_id} settled {state.value}")
        assert found is not None
        return found

    def restart_cp(self, failpoints: str | None = None, timeout: float = 60.0) -> None:
        """SIGKILL the control plane (if it runs) and start it again (with SPACE_FAILPOINTS armed)."""
        self.cp.kill()
        self.cp.extra_env = {"SPACE_FAILPOINTS": failpoints} if failpoints else {}
        self.cp.start()

        def up_or_died() -> bool:
            if not self.cp.alive:
                return True  # a failpoint armed at a point the restart reaches at once
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.cp.url}/healthz", timeout=2.0).status_code == 200
            return False

        c.wait_for(up_or_died, timeout=timeout, interval=0.05, what="control plane up")
        if not self.cp.alive:
            # Only an armed failpoint may end it here (it SIGKILLs itself); anything else is a crash at start.
            code = self.cp.proc.returncode if self.cp.proc is not None else None
            print(f"\ncontrol plane ended at start (failpoints {failpoints}, exit {code}):\n{self.logs()}")
            crashed = f"the control plane crashed at start:\n{self.logs()}"
            assert failpoints and code == -signal.SIGKILL, crashed

    # -- object storage ------------------------------------------------------------------------------------
    def store_root(self) -> pathlib.Path:
        return pathlib.Path(self.store_url.removeprefix("file://"))

    def orphan_objects(self, prefix: str = "sandboxes/") -> list[str]:
        """Objects under `prefix` that no manifest accounts for: parts of an upload that never committed,
        or parts a repeated upload no longer lists."""
        objects = self.objects()
        keys = objects.list(prefix)
        prefixes = {k.rsplit("/", 1)[0] for k in keys if k.endswith("/manifest.json")}
        listed: set[str] = set()
        for artifact in prefixes:
            manifest = read_manifest(objects, artifact)
            listed |= {part.key for entry in manifest.entries.values() for part in entry.parts}
        return [k for k in keys if not k.endswith("/manifest.json") and k not in listed]

    def interrupted_writes(self, prefix: str = "sandboxes/") -> list[str]:
        """Temporary files of object writes whose process was killed (never objects; removed with their
        prefix by LocalDirectoryStore.delete_prefix)."""
        base = self.store_root() / prefix
        return sorted(str(p) for p in base.rglob(f"*{TEMP_MARK}*")) if base.is_dir() else []

    def files_in_store(self, prefix: str) -> list[str]:
        """Every file (objects and temporary files) under `prefix` in the store's directory."""
        base = self.store_root() / prefix
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def artifacts_of(self, sb: SandboxRecord) -> list[str]:
        """Prefixes (with a manifest) of this sandbox's artifacts in the store."""
        keys = self.objects().list(f"sandboxes/{sb.project_id}/{sb.id}/")
        return sorted(k.rsplit("/", 1)[0] for k in keys if k.endswith("/manifest.json"))

    def logs(self, chars: int = 2500) -> str:
        parts = [f"--- {s.name} ---\n{s.log_tail(chars)}" for s in (self.cp, *(n.agent for n in self.nodes))]
        return "\n".join(parts)


# -- set-up and teardown -------------------------------------------------------------------------------------
def _make_node(root: pathlib.Path, name: str, token_file: pathlib.Path, cp_url: str,
               store_url: str, uid: int, gid: int, driver: str = "runsc") -> ClusterNode:  # fmt: skip
    data_dir = root / f"node-{name}"
    data_dir.mkdir()
    data_dir.chmod(0o755)  # the agent user reaches its sockets in here
    # A cgroup parent of its own per node and per run (two runs of this module may overlap on the machine).
    run_tag = "".join(ch for ch in root.name.rsplit("-", 1)[-1].lower() if ch.isalnum())
    local = LocalNode(
        data_dir, agent_user=uid, store_url=store_url, cgroup_parent=f"space-mn{name}-{run_tag}"
    )
    port = c.free_port()
    argv = [sys.executable, "-m", "space.node.agent.server", "--data-dir", str(data_dir),
            "--listen", f"127.0.0.1:{port}", "--bootstrap-token-file", str(token_file),
            "--control-plane", cp_url, "--store-url", store_url, "--log-level", "info"]  # fmt: skip
    if uid:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
    agent = c.Service(f"agent-{name}", argv, root / f"agent-{name}.log")
    agent.extra_env = {"HOME": "/", "SPACE_NODE_DRIVER": driver}  # qemu: a microVM node (ADR 0068, 0076)
    return ClusterNode(name, local, agent, port)


def _force_clean(data_dir: pathlib.Path) -> dict[str, list[str]]:
    """What a failed purge left: kill the node's processes, lazily unmount, detach its loop devices;
    returns what it found."""
    found = {
        "processes": c.processes_in(data_dir),
        "mounts": mounts_under(str(data_dir)),
        "loop devices": loop_devices_for(str(data_dir)),
    }
    c.kill_pids(int(line.split(":")[0]) for line in found["processes"])
    for mountpoint in sorted(found["mounts"], key=len, reverse=True):
        subprocess.run(["umount", "-l", mountpoint], check=False, capture_output=True)
    for line in loop_devices_for(str(data_dir)):
        subprocess.run(["losetup", "-d", line.split(":")[0]], check=False, capture_output=True)
    return {k: v for k, v in found.items() if v}


def _mount_holders(fs: pathlib.Path) -> list[str]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f" {fs} " in (proc / "mountinfo").read_text():
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline[:160]}")
        except OSError:
            continue
    return found


def _purge(node: ClusterNode) -> dict[str, Any]:
    """Purge one node through its helper; never raises (what went wrong is returned, and cleaned by hand).

    A loop device that is still attached when the helper's unmount gives up (10 s) is waited for a while
    longer: on this loaded machine its automatic detach after the unmount has been seen to take longer
    than that, and one that goes away by itself is not a leak (it is reported as a note)."""
    found: dict[str, Any] = {}
    holders: list[str] = []
    # If the purge takes long, note which processes still see the node's filesystem in their mount table
    # (what keeps an unmounted filesystem, and so its loop device, alive).
    watch = threading.Timer(5.0, lambda: holders.extend(_mount_holders(node.layout.fs)))
    watch.start()
    try:
        asyncio.run(node.local.stop(purge=True))
    except Exception as exc:
        watch.cancel()
        node.local.stop_helper()
        started = time.monotonic()
        while loop_devices_for(str(node.data_dir)) and time.monotonic() - started < LOOP_RELEASE_S:
            time.sleep(0.2)
        waited = time.monotonic() - started
        left = _force_clean(node.data_dir)
        if left or "loop devices still attached" not in str(exc):
            found["problem"] = {"purge failed": repr(exc), "cleaned by hand": left}
        else:
            found["note"] = (
                f"its loop device detached {waited:.1f}s after the helper gave up waiting; processes that "
                f"still had its filesystem mounted 5 s into the purge: {holders}"
            )
    watch.cancel()
    left = _force_clean(node.data_dir)  # (nothing, after a good purge)
    if left:
        found["problem"] = {**found.get("problem", {}), "left after the purge": left}
    return found


def _teardown(made: TwoNodeCluster | None, root: pathlib.Path, cp: c.ControlPlane,
              nodes: list[ClusterNode], db: Store | None) -> dict[str, Any]:  # fmt: skip
    problems: dict[str, Any] = {}
    if made is not None and made._sdk is not None:
        made._sdk.close()
    ids: set[str] = set()
    if db is not None and made is not None:
        with contextlib.suppress(Exception):
            ids |= {sb.id for sb in db.list_sandboxes(made.project_id)}
    cp.stop(timeout=10)
    for node in nodes:
        ids |= c.sandbox_ids_in(node.data_dir)
        node.agent.stop(timeout=15)  # SIGCONT first: a test may have left it stopped
    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
        purged = dict(zip([n.name for n in nodes], pool.map(_purge, nodes), strict=True))
    for name, found in purged.items():
        if "note" in found:
            print(f"\nnode {name}: {found['note']}")
        if "problem" in found:
            problems[f"purge of node {name}"] = found["problem"]
    for node in nodes:
        left = {k: v for k, v in c.host_leftovers(node.data_dir, ids).items() if v}
        traces = network_traces(node_tag(node.data_dir.resolve()))
        if traces:
            left["network"] = traces
        if left:
            problems[f"node {node.name}"] = left
        for group in pathlib.Path("/sys/fs/cgroup").glob(f"*/{node.local.cgroup_parent}"):
            for _attempt in range(50):  # the (now empty) parent; the kernel may lag a moment
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                problems[f"cgroup {group}"] = cgroups_under(node.local.cgroup_parent)
    if db is not None:
        db.close()
    left_processes = c.processes_in(root)
    c.kill_pids(int(line.split(":")[0]) for line in left_processes)
    if left_processes:
        problems["processes"] = left_processes
    shutil.rmtree(root, ignore_errors=True)
    return problems


@contextlib.contextmanager
def start_two_nodes(drivers: tuple[str, str] = ("runsc", "runsc")) -> Iterator[TwoNodeCluster]:
    """The cluster; `drivers`: each node's SPACE_NODE_DRIVER (a qemu node makes its microVM template
    checkpoint while its agent prepares, before it registers)."""
    if os.geteuid() != 0:
        pytest.fail("two real nodes need their root helpers (runsc, btrfs): run the tests as root")
    uid, gid = _agent_ids()
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-test-multinode-", dir="/var/tmp"))
    root.chmod(0o755)
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    os.chown(token_file, uid, gid)
    store_url = (root / "objects").as_uri()
    ensure_local_store(store_url, uid)
    cp_dir = root / "cp"
    cp_dir.mkdir()
    db: Store | None = None
    made: TwoNodeCluster | None = None
    cp = c.ControlPlane(cp_dir, token_file, database_url=None, name="controlplane", store_url=store_url)
    nodes = [
        _make_node(root, name, token_file, cp.url, store_url, uid, gid, driver)
        for name, driver in zip(NODE_NAMES, drivers, strict=True)
    ]
    try:
        db, _org, project_id, admin_key = c.bootstrap(sqlite_url(cp_dir))
        cp.start()
        for node in nodes:
            node.local.start_helper()
        # Both template imports at once: mostly btrfs receive (I/O), so they overlap well even on 2 cores.
        with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
            for done in [pool.submit(_prepare_node, n.local, lambda _line: None) for n in nodes]:
                done.result()
        c.wait_for(cp.healthy, timeout=c.START_TIMEOUT_S, interval=0.1, what="control plane healthy")
        made = TwoNodeCluster(root, store_url, db, project_id, admin_key, cp, nodes)
        for node in nodes:
            node.agent.start()
        cluster = made
        for node in nodes:

            def registered(node: ClusterNode = node) -> bool:
                return cluster.node_ready(node)

            c.wait_for(registered, timeout=READY_TIMEOUT_S, interval=0.2, what=f"node {node.name} registered")
        yield made
    finally:
        problems = _teardown(made, root, cp, nodes, db)
        assert problems == {}, "the two-node cluster left things behind:\n" + json.dumps(problems, indent=1)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodeCluster]:
    """One control plane + two real nodes for a test module (see the module docstring)."""
    started = time.monotonic()
    with start_two_nodes() as made:
        print(f"\ntwo-node cluster up in {time.monotonic() - started:.1f}s")
        yield made
