"""A real one-node cluster whose three processes are armed with kill points, and a supervisor that restarts
whichever of them died (the crash-injection harness, tests/crash/test_crash_injection.py).

Processes (each a killable `cluster.Service`, under one temporary root in /var/tmp):
- the root helper (`python -m space.node.helper.server`, real runsc and btrfs, network namespaces),
- the node agent (as the `space` user when it exists), with the shared local-directory object store,
- the control plane (SQLite, its own key service).
Each is started with `SPACE_FAILPOINTS=<arm>` and its own fire-once journal (`SPACE_FAILPOINTS_ONCE`,
space.faults.failpoints): a process dies at a kill point by appending its name to its journal and SIGKILLing
itself; the supervisor (a thread, every 50 ms) sees it dead, reads which point it died at from the journal,
and starts it again with the same environment, so the new process goes past that point.

Invariants:
- A death the journal does not explain (the process ended without journaling a point) is recorded as an
  unexplained death; the harness fails on one.
- The node is prepared (template imported) with an UNARMED helper, and the helper is restarted unarmed
  before teardown, so set-up and purge never die; teardown is realcluster's (purge and host leak check).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from space.controlplane.local import _prepare_node
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from space.faults.failpoints import ARM_VARIABLE, JOURNAL_VARIABLE, read_journal
from space.node.local import ensure_local_store
from space.objectstore.backends import open_store
from tests.support import cluster as c
from tests.support import invariants
from tests.support.realcluster import ClusterNode, _agent_ids, _make_node, _teardown

COMPONENTS = ("helper", "agent", "controlplane")
KEPT_LOGS = pathlib.Path("/var/tmp/space-crash-last-logs")


@dataclass
class Death:
    component: str
    point: str | None  # None: not explained by a kill point (a real crash)
    restart_s: float
    at: float = field(default_factory=time.monotonic)  # when the death was seen


@dataclass
class CrashCluster:
    root: pathlib.Path
    store_url: str
    db: Store
    project_id: str
    admin_key: str
    cp: c.ControlPlane
    helper: c.Service
    node: ClusterNode
    arm: str
    deaths: list[Death] = field(default_factory=list)
    _seen: dict[str, frozenset[str]] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- arming ------------------------------------------------------------------------------------------
    def journal(self, component: str) -> pathlib.Path:
        return self.root / f"fired-{component}"

    def armed_env(self, component: str) -> dict[str, str]:
        return {ARM_VARIABLE: self.arm, JOURNAL_VARIABLE: str(self.journal(component))}

    def fired(self) -> dict[str, frozenset[str]]:
        """component -> the points its processes died at so far."""
        return {name: read_journal(str(self.journal(name))) for name in COMPONENTS}

    def services(self) -> dict[str, c.Service]:
        return {"helper": self.helper, "agent": self.node.agent, "controlplane": self.cp}

    # -- supervision -------------------------------------------------------------------------------------
    def start_component(self, name: str) -> None:
        """Start `name` and wait until it serves, or died again (at its next kill point)."""
        service = self.services()[name]
        service.start()
        if name == "helper":
            self.node.local.helper_process = service.proc  # so a purge stops this one
            ready = self.helper_answers
        elif name == "agent":
            ready = self.agent_answers
        else:
            ready = self.cp_answers
        c.wait_for(lambda: not service.alive or ready(), timeout=120, interval=0.05, what=f"{name} up")

    def helper_answers(self) -> bool:
        if not self.helper.alive:
            return False
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.node.layout.helper_socket))
            return True
        return False

    def agent_answers(self) -> bool:
        with contextlib.suppress(OSError):  # (its RPC token is written at its first start)
            return self.node.answers()
        return False

    def cp_answers(self) -> bool:
        if not self.cp.alive:
            return False
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.cp.url}/healthz", timeout=2.0).status_code == 200
        return False

    def supervise_once(self) -> None:
        """Restart every dead component (the helper first: the agent's steps need it)."""
        with self._lock:
            for name, service in self.services().items():
                if service.alive:
                    continue
                if service.proc is None:  # never started (or stopped on purpose): a start, not a death
                    self._started_at[name] = time.monotonic()
                    self.start_component(name)
                    continue
                fired = read_journal(str(self.journal(name)))
                new = sorted(fired - self._seen.get(name, frozenset()))
                self._seen[name] = fired
                point = new[-1] if new else self._dependent_death(name)
                started = time.monotonic()
                self.start_component(name)
                elapsed = time.monotonic() - started
                self._started_at[name] = started
                self.deaths.append(Death(name, point, elapsed))
                if len(new) > 1:  # (only one thread fires per process: never expected)
                    self.deaths.append(Death(name, f"journal grew by {new}", 0.0))

    def _dependent_death(self, name: str) -> str | None:
        """An agent that ended without a kill point of its own, after its helper died at one since the
        agent's last start: the agent gives up when a helper call fails while it starts (reported in ADR
        0038), so its death is the helper's (a supervisor restarts both). None: unexplained."""
        if name != "agent":
            return None
        since = self._started_at.get("agent", 0.0)
        helper_points = [
            d.point for d in self.deaths if d.component == "helper" and d.at >= since and d.point
        ]
        return f"its helper died at {helper_points[-1]}" if helper_points else None

    @contextlib.contextmanager
    def supervised(self) -> Iterator[None]:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.supervise_once()
                except Exception as exc:  # a start that timed out: try again, and say so
                    print(f"\nsupervisor: {exc}", file=sys.stderr)
                self._stop.wait(0.05)

        self._stop.clear()
        thread = threading.Thread(target=loop, name="crash-supervisor", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(180)

    def unexplained(self) -> list[Death]:
        return [d for d in self.deaths if d.point is None or d.point.startswith("journal grew")]

    # -- the checker ---------------------------------------------------------------------------------------
    def node_id(self) -> str:
        return next(n.id for n in self.db.list_nodes(None) if n.url == self.node.url)

    def sweep(self) -> list[str]:
        view = invariants.NodeView(self.node_id(), self.node.layout, self.node.listing())
        store_root = pathlib.Path(self.store_url.removeprefix("file://"))
        return invariants.sweep(self.db, self.project_id, [view], open_store(self.store_url), store_root)

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.log_tail(chars)}" for s in self.services().values())


def lease_env(arm: str) -> dict[str, str]:
    """The node lease of the control plane: with a few kill points (`make test`) a long one, so a restart
    that is slow on a loaded machine does not also fence the node (fencing has its own tests, ADR 0033)
    and each kill is converged from on its own; with every point (`make soak`) the production default."""
    return {} if arm == "*" else {"SPACE_NODE_LOST_AFTER_S": "120", "SPACE_FENCE_GRACE_S": "5"}


def _helper_service(root: pathlib.Path, node: ClusterNode, uid: int) -> c.Service:
    local = node.local
    argv = [sys.executable, "-m", "space.node.helper.server", "--data-dir", str(local.layout.data_dir),
            "--agent-user", str(uid), "--platform", local.platform, "--runsc", local.runsc,
            "--network", local.network, "--cgroup-parent", local.cgroup_parent]  # fmt: skip
    return c.Service("helper", argv, root / "helper.log")


@contextlib.contextmanager
def start_crash_cluster(arm: str) -> Iterator[CrashCluster]:
    """The cluster of the module docstring, every process armed with `arm` (SPACE_FAILPOINTS)."""
    if os.geteuid() != 0:
        pytest.fail("the crash harness runs a real node (root helper, runsc, btrfs): run the tests as root")
    uid, gid = _agent_ids()
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-test-crash-", dir="/var/tmp"))
    root.chmod(0o755)
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    os.chown(token_file, uid, gid)
    store_url = (root / "objects").as_uri()
    ensure_local_store(store_url, uid)
    cp_dir = root / "cp"
    cp_dir.mkdir()
    cp = c.ControlPlane(cp_dir, token_file, database_url=None, name="controlplane", store_url=store_url)
    node = _make_node(root, "a", token_file, cp.url, store_url, uid, gid)
    helper = _helper_service(root, node, uid)
    helper.extra_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    db: Store | None = None
    made: CrashCluster | None = None
    try:
        db, _org, project_id, admin_key = c.bootstrap(sqlite_url(cp_dir))
        made = CrashCluster(root, store_url, db, project_id, admin_key, cp, helper, node, arm)
        (root / "fired-agent").touch()
        os.chown(root / "fired-agent", uid, gid)  # the agent runs as `space` and journals its own deaths
        made.start_component("helper")  # unarmed: preparing the node must not die
        _prepare_node(node.local, lambda _line: None)
        helper.kill()
        helper.proc = None  # stopped on purpose: the supervisor starts it armed, and counts no death
        helper.extra_env = {**helper.extra_env, **made.armed_env("helper")}
        node.agent.extra_env = {**node.agent.extra_env, **made.armed_env("agent")}
        cp.extra_env = {**made.armed_env("controlplane"), **lease_env(arm)}
        with made.supervised():
            c.wait_for(lambda: made is not None and made.cp_answers() and made.agent_answers(),
                       timeout=300, interval=0.2, what="armed cluster up")  # fmt: skip
            yield made
    finally:
        failing = sys.exc_info()[0] is not None  # logs are kept for a look only when the run fails
        for log in [*root.glob("*.log"), *root.glob("*/*.log"), *root.glob("fired-*")] if failing else []:
            with contextlib.suppress(OSError):  # kept for a look after the run (the root is removed)
                KEPT_LOGS.mkdir(exist_ok=True)
                (KEPT_LOGS / log.name).write_bytes(log.read_bytes())
        if made is not None:
            made._stop.set()
        helper.kill()  # teardown purges through an UNARMED helper
        helper.extra_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        cp.extra_env = {}
        node.agent.extra_env = {"HOME": "/"}
        helper.start()
        node.local.helper_process = helper.proc
        c.wait_for(lambda: made is None or made.helper_answers(), timeout=60, what="helper up for teardown")
        problems = _teardown(None, root, cp, [node], db)
        assert problems == {}, f"the crash cluster left things behind: {problems}"
