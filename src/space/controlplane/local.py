"""One whole SPACE installation on this machine: root helper, node agent (as the `space` user) and control
plane, each its own process, with SQLite and the node's btrfs image under one data directory.

Used by `space up`, the end-to-end tests and the API benchmark.

Invariants:
- Secrets live in the data directory with mode 0600: the cluster node token (readable by the agent's user)
  and the bootstrap admin key (root only). The admin key is created once and reused by later starts.
- Nothing in the data directory is readable by other local users (ADR 0022): the directory is 0710
  root:<agent group> (the agent reaches its own paths by name, no one but root lists it), every process
  started here runs with umask 077, logs, the database (and its WAL) and the btrfs image are 0600, and
  what an older run left with wider modes is tightened at start. No secret is ever written to a log.
- `stop(purge=True)` leaves nothing: every sandbox destroyed, the btrfs image unmounted, every process gone.
- Start-up is idempotent: a data directory from an earlier run (sandboxes included) is adopted.
- Once started, each component can be started again on its own (`supervisor()`, ADR 0037): the control
  plane and the agent with the same arguments (the agent keeps its port and re-registers with its
  persisted identity), the helper on the same socket followed by `node.prepare` (which converges: it
  keeps every running sandbox and the node's network). The agent is not restarted with the helper: it
  opens a helper connection per request, so it reaches the new helper by itself.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import SQLITE_FILENAME, sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.controlplane.supervisor import STATUS_FILENAME, Backoff, Component, Emit, Supervisor
from space.core import errors, process_env
from space.core.settings import NodeSettings
from space.node import filemodes
from space.node.agent.rpc_listen import MAX_SOCKET_PATH, default_rpc_socket
from space.node.agent.settings import NodeAgentSettings
from space.node.local import LocalNode, ensure_local_store

AGENT_USER = "space"
READY_TIMEOUT_S = 600.0
#: Files of the data directory itself (besides logs) that must be owner-only; an older run may have
#: created them with the default umask.
PRIVATE_FILES = (
    "admin.key", "node.token", "up.json", "purge-request", "btrfs.img", STATUS_FILENAME,
    *(SQLITE_FILENAME + suffix for suffix in ("", "-wal", "-shm", "-journal")),
)  # fmt: skip
#: Directories of the data directory whose whole content is private to its owner (root or the agent).
PRIVATE_TREES = ("keys", "objects", "egress")
Progress = Callable[[str], None]


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a restarted agent rebinds its port, and a
    port from that range may meanwhile have become the source port of an outgoing connection."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _attempt in range(200):
        port = secrets.choice(range(10000, max(low, 10001)))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise errors.ResourceExhausted("no free loopback port below the ephemeral range")


def settings_environment() -> dict[str, str]:
    """The settings variables of this process that the control plane and the agent read (each field of
    ControlPlaneSettings and NodeAgentSettings names its own): passed on to the processes started here,
    so that every setting can be given by environment to `space up` as to each role (ADR 0070)."""
    names = {
        field.validation_alias
        for model in (ControlPlaneSettings, NodeAgentSettings)
        for field in model.model_fields.values()
        if isinstance(field.validation_alias, str)
    }
    return {name: os.environ[name] for name in sorted(names) if name in os.environ}


def _secret_file(path: pathlib.Path, make: Callable[[], str], owner_uid: int = 0) -> str:
    if path.exists():
        return path.read_text().strip()
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    os.chown(path, owner_uid, -1)
    return value


@dataclass
class LocalCluster:
    data_dir: pathlib.Path
    port: int = 8470
    node_port: int = 0
    agent_user: str = AGENT_USER
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    api_key: str = ""
    node: LocalNode | None = None
    #: NodeSettings.network: "sandbox" gives every sandbox its own network namespace whose only way out is
    #: the node agent's egress gateway; `egress_config` is the agent's --egress-config (operator settings).
    network: str = field(default_factory=lambda: NodeSettings().network)
    egress_config: pathlib.Path | None = None
    cgroup_parent: str = "space"  # several installations on one machine need their own (space.node.local)
    #: The agent's --pools: warm pool sizes per template, "TEMPLATE=N,..." (ADR 0047); empty: none.
    pools: str = ""
    #: Built-in templates prepared at start (each with its warm start); others are built on their first use.
    templates: tuple[str, ...] = ("python",)
    #: Ports of the E2B front on 127.0.0.1 (docs/e2b.md): its control API and its in-sandbox API, served by
    #: the control plane beside SPACE's API; 0: not served (`space up` serves both).
    e2b_api_port: int = 0
    e2b_sandbox_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def e2b_api_url(self) -> str | None:
        return f"http://127.0.0.1:{self.e2b_api_port}" if self.e2b_api_port else None

    @property
    def e2b_sandbox_url(self) -> str | None:
        return f"http://127.0.0.1:{self.e2b_sandbox_port}" if self.e2b_sandbox_port else None

    def _agent_uid(self) -> tuple[int, int]:
        try:
            entry = pwd.getpwnam(self.agent_user)
        except KeyError:
            return 0, 0  # no such user: the agent runs as root (development machines without `make setup`)
        return entry.pw_uid, entry.pw_gid

    def _spawn(
        self, name: str, argv: list[str], *, user: tuple[int, int] | None = None
    ) -> subprocess.Popen[bytes]:
        log = filemodes.open_private_log(self.data_dir / f"{name}.log")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
               **settings_environment()}  # fmt: skip
        src = pathlib.Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = str(src)
        # `SPACE_LOG_FORMAT=json space up`: JSON lines (ADR 0071), tracing (ADR 0072), version (ADR 0079)
        env.update(process_env.passed_on(os.environ))
        if user is not None and user[0] != 0:
            argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *argv]
            env["HOME"] = "/"
        try:
            self.processes[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
                umask=filemodes.OWNER_ONLY_UMASK,
            )  # fmt: skip
        finally:
            os.close(log)
        return self.processes[name]

    def bootstrap_admin_key(self) -> str:
        """The org admin key of this installation: created with the org and its default project once."""
        store = Store(sqlite_url(self.data_dir))
        try:
            key_file = self.data_dir / "admin.key"
            if key_file.exists():
                return key_file.read_text().strip()
            org = store.get_org_by_name("default") or store.create_org("default")
            if store.get_project_by_name(org.id, "default") is None:
                store.create_project(org.id, "default")
            _record, secret = store.create_api_key(None, org.id, "admin")
            return _secret_file(key_file, lambda: secret)
        finally:
            store.close()

    def start(self, progress: Progress = lambda _line: None) -> None:
        if os.geteuid() != 0:
            raise errors.PermissionDenied("`space up` starts the node's root helper: run it as root")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        uid, gid = self._agent_uid()
        secure_data_dir(self.data_dir, gid)
        _secret_file(self.data_dir / "node.token", lambda: secrets.token_urlsafe(32), owner_uid=uid)
        names = ", ".join(self.templates)
        progress(f"starting the node helper (root) and preparing storage and templates ({names})")
        self.node = LocalNode(
            self.data_dir, agent_user=uid, network=self.network, cgroup_parent=self.cgroup_parent
        )
        self.node.start_helper()
        assert self.node.helper_process is not None
        self.processes["helper"] = self.node.helper_process
        _prepare_node(self.node, progress, templates=self.templates)
        progress("migrating the database")
        filemodes.create_private_file(self.data_dir / SQLITE_FILENAME)  # its WAL copies its mode
        migrate(sqlite_url(self.data_dir))
        self.api_key = self.bootstrap_admin_key()
        # One object store for the control plane and the node (suspend/restore, uploads, templates): a
        # directory the unprivileged agent owns.
        ensure_local_store(self.store_url, uid)
        self.node_port = self.node_port or free_port()  # before the control plane: its --node-socket names it
        progress(f"starting the control plane on {self.url}")
        self.spawn_controlplane()
        progress(f"starting the node agent as user '{self.agent_user}' on 127.0.0.1:{self.node_port}")
        self.spawn_agent()
        self.wait_ready(progress)

    @property
    def store_url(self) -> str:
        return (self.data_dir / "objects").as_uri()

    @property
    def rpc_socket(self) -> pathlib.Path | None:
        """The agent's unix socket, which the control plane reaches it through (ADR 0044); None when the
        data directory's path is too long for a socket address (then TCP only)."""
        path = default_rpc_socket(self.data_dir)
        return path if len(os.fsencode(path)) <= MAX_SOCKET_PATH else None

    def spawn_controlplane(self) -> subprocess.Popen[bytes]:
        extra_args: list[str] = []
        if self.rpc_socket is not None and self.node_port:
            extra_args = ["--node-socket", f"http://127.0.0.1:{self.node_port}={self.rpc_socket}"]
        if self.e2b_api_port:
            extra_args += ["--e2b-api-listen", f"127.0.0.1:{self.e2b_api_port}"]
        if self.e2b_sandbox_port:
            extra_args += ["--e2b-sandbox-listen", f"127.0.0.1:{self.e2b_sandbox_port}"]
        return self._spawn(
            "controlplane",
            [sys.executable, "-m", "space.controlplane.server", "--data-dir", str(self.data_dir),
             "--port", str(self.port), "--node-token-file", str(self.data_dir / "node.token"),
             "--store-url", self.store_url, *extra_args],
        )  # fmt: skip

    def spawn_agent(self) -> subprocess.Popen[bytes]:
        egress_args: list[str] = []
        if self.network == "sandbox" and self.egress_config is not None:
            egress_args = ["--egress-config", str(self.egress_config)]
        return self._spawn(
            "agent",
            [sys.executable, "-m", "space.node.agent.server", "--data-dir", str(self.data_dir),
             "--listen", f"127.0.0.1:{self.node_port}",
             *(["--listen-socket", str(self.rpc_socket)] if self.rpc_socket is not None else []),
             # Enrols the node once; its own RPC token and identity are kept in DATA_DIR/identity (ADR 0021).
             "--bootstrap-token-file", str(self.data_dir / "node.token"),
             # --store-url: templates from the store (warm starts).
             "--control-plane", self.url, "--store-url", self.store_url, *egress_args,
             "--templates", ",".join(self.templates), *(["--pools", self.pools] if self.pools else [])],
            user=self._agent_uid(),
        )  # fmt: skip

    def restart_helper(self) -> subprocess.Popen[bytes]:
        """Start the helper again on the same socket and let `node.prepare` converge (it adopts every
        running sandbox: holders live in their own sessions and the runtimes' state is on disk)."""
        assert self.node is not None, "the helper is restarted only after start()"
        self.node.stop_helper()  # reaps the dead one (or stops a live one)
        self.node.start_helper()
        assert self.node.helper_process is not None
        self.processes["helper"] = self.node.helper_process
        try:
            _prepare_node(self.node, lambda _line: None, templates=())
        except errors.SpaceError:
            self.node.stop_helper()  # a helper that cannot prepare the node is no helper: try again later
            raise
        return self.node.helper_process

    def supervisor(self, emit: Emit, backoff: Backoff | None = None) -> Supervisor:
        """A supervisor of the processes `start()` started (ADR 0037), writing DATA_DIR/status.json."""
        made = Supervisor(
            [Component("helper", self.restart_helper),
             Component("controlplane", self.spawn_controlplane),
             Component("agent", self.spawn_agent)],
            emit=emit, status_file=self.data_dir / STATUS_FILENAME, backoff=backoff,
            extra={"supervisor_pid": os.getpid(), "url": self.url, "data_dir": str(self.data_dir),
                   "e2b_api_url": self.e2b_api_url, "e2b_sandbox_url": self.e2b_sandbox_url},
        )  # fmt: skip
        for name, process in self.processes.items():
            made.adopt(name, process)
        return made

    def wait_ready(self, progress: Progress) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        headers = {"Authorization": f"Bearer {self.api_key}"}
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    tail = (self.data_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise errors.RuntimeFailure(f"{name} exited during start-up:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{self.url}/healthz", timeout=2.0)
                if health.status_code == 200 and self._node_ready(headers):
                    progress("ready")
                    return
            time.sleep(0.2)
        raise errors.Timeout("SPACE did not become ready in time")

    def _node_ready(self, _headers: dict[str, str]) -> bool:
        store = Store(sqlite_url(self.data_dir))
        try:
            return any(node.capacity for node in store.list_nodes("ready"))
        finally:
            store.close()

    def stop(self, *, purge: bool = False) -> None:
        """Stop the agent, then the control plane (sandboxes keep running unless purge), then the helper.

        The agent goes first so that it can deregister while the control plane still answers: the node is
        then `offline`, never lost, and the agent releases its fencing lease (ADR 0033)."""
        for name in ("agent", "controlplane"):
            proc = self.processes.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        helper = self.processes.pop("helper", None)
        if self.node is not None:
            import asyncio

            if purge and (helper is None or helper.poll() is not None):
                # Purging needs a helper (the supervisor may have been waiting to restart it, or nothing
                # runs). node.teardown needs no node.prepare, and without it no network pool is being
                # filled while the node is torn down.
                self.node.stop_helper()
                self.node.start_helper()
            asyncio.run(self.node.stop(purge=purge))
        elif purge:
            raise errors.InvalidArgument("nothing to purge: this cluster was not started here")

    def purge_offline(self) -> None:
        """`space down --purge` with nothing running: a helper started just for this destroys every
        sandbox, the node's network and the btrfs image, then the data directory goes."""
        if os.geteuid() != 0:
            raise errors.PermissionDenied("purging a node needs its root helper: run it as root")
        uid, _gid = self._agent_uid()
        self.node = LocalNode(
            self.data_dir, agent_user=uid, network=self.network, cgroup_parent=self.cgroup_parent
        )
        self.stop(purge=True)  # with no helper running, stop() starts one first


def secure_data_dir(data_dir: pathlib.Path, agent_gid: int) -> None:
    """Make `data_dir` private (ADR 0022) and tighten what an older run created with default modes.

    0710 root:<agent group>: the unprivileged agent must reach the paths it is handed (the helper's and
    the holders' sockets, its token, its own `objects`/`egress` directories, staging) but has no reason to
    list the directory; every other local user can neither list nor enter it. An agent running as root
    (no `space` user) leaves no one to let in: 0700.
    """
    os.chown(data_dir, 0, agent_gid)
    os.chmod(data_dir, 0o710 if agent_gid else 0o700)
    for name in PRIVATE_FILES:
        filemodes.restrict(data_dir / name)
    for log in data_dir.glob("*.log"):
        filemodes.restrict(log)
    for name in PRIVATE_TREES:
        filemodes.restrict_tree(data_dir / name)


def _prepare_node(node: LocalNode, progress: Progress, templates: tuple[str, ...] = ("python",)) -> None:
    import asyncio

    from space.node.agent.helper_client import HelperClient

    async def prepare() -> None:
        helper = HelperClient(str(node.layout.helper_socket))
        try:
            await helper.call("node.prepare", progress=progress, timeout=600.0)
            for name in templates:
                await helper.call("template.ensure", {"name": name}, progress=progress, timeout=1800.0)
        finally:
            await helper.close()

    asyncio.run(prepare())
