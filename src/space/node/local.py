"""A whole node on this machine: the root helper as a child process plus an agent talking to it.

Used by `make demo`, the benchmarks, the tests and `space up`. The helper needs root; the agent side
(`connect_agent`) needs only the helper socket, so it can run as an unprivileged user in another process.

Several nodes can run on one machine (tests: suspend on one, restore on another): each has its own data
directory (btrfs image, runsc root, sockets, holders) and must be given its own `cgroup_parent`; they may
share one object store (`store_url`).

Invariants:
- The helper runs with umask 077, its log is 0600, and it gets only the environment it needs
  (`HELPER_ENV`), never the caller's whole environment: runsc and the holders inherit it, and a
  sandbox's runtime processes should not carry, say, an exported SPACE_API_KEY (ADR 0022).
- `stop(purge=True)` leaves nothing behind: every sandbox destroyed (runtimes, holders, cgroups,
  subvolumes), the btrfs image unmounted and its loop device detached, the helper process gone.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

from space.core import errors, process_env
from space.core.settings import NodeSettings
from space.node import filemodes
from space.node.agent.agent import NodeAgent
from space.node.agent.helper_client import HelperClient
from space.node.agent.settings import NodeAgentSettings
from space.node.drivers.base import Progress
from space.node.drivers.qemu import QemuDriver
from space.node.drivers.runsc import RunscDriver
from space.node.layout import NodeLayout
from space.objectstore.backends import open_store

#: What the helper takes from its starter's environment: where to find programs and Python code, the
#: locale, and an HTTP proxy for debootstrap's mirror (template builds). Nothing else, secrets included.
HELPER_ENV = (
    "PATH", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "LANG", "LC_ALL", "TMPDIR",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    *process_env.PASSED_ON,  # log format, tracing, reported version (ADR 0071, 0072, 0079)
)  # fmt: skip


def connect_agent(
    data_dir: pathlib.Path,
    helper_socket: pathlib.Path | None = None,
    *,
    store_url: str | None = None,
    settings: NodeAgentSettings | None = None,
) -> NodeAgent:
    """An agent whose runsc driver talks to the node helper at `helper_socket` (default: the data
    directory's)."""
    settings = settings or NodeAgentSettings()
    layout = NodeLayout(data_dir)
    helper = HelperClient(
        str(helper_socket or layout.helper_socket),
        pool_size=settings.helper_pool_size,
        default_timeout=settings.helper_call_timeout_s,
    )
    driver = QemuDriver(layout, helper) if settings.driver == "qemu" else RunscDriver(layout, helper)
    return NodeAgent(driver, store=open_store(store_url) if store_url else None)


def ensure_local_store(store_url: str | None, owner_uid: int) -> None:
    """Create a `file://` store's directory for the agent (which may not create it under a root-owned
    parent itself); other stores need nothing here."""
    if not store_url or not store_url.startswith("file://"):
        return
    root = pathlib.Path(open_store(store_url).url.removeprefix("file://"))
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.stat(root).st_uid != owner_uid:
        os.chown(root, owner_uid, -1)


class LocalNode:
    def __init__(
        self,
        data_dir: pathlib.Path,
        *,
        agent_user: str | int = 0,
        platform: str = "ptrace",
        runsc: str = "runsc",
        network: str | None = None,
        store_url: str | None = None,
        cgroup_parent: str = "space",
        rootfs_cache: pathlib.Path | None = None,
        settings: NodeAgentSettings | None = None,
    ) -> None:
        self.layout = NodeLayout(pathlib.Path(data_dir).resolve())
        self.agent_user = str(agent_user)
        self.platform = platform
        self.runsc = runsc
        self.store_url = store_url
        self.cgroup_parent = cgroup_parent
        #: Where the helper caches the template base's stream (None: the machine-wide default); a node given
        #: an empty cache and a store that holds the base gets the base from the store.
        self.rootfs_cache = rootfs_cache
        # "none" | "sandbox"; None: NodeSettings' default (docs/adr/0015-sandbox-network.md)
        self.network = network or NodeSettings().network
        self.helper_process: subprocess.Popen[bytes] | None = None
        self.agent: NodeAgent | None = None
        #: The tunables (None: read from the environment when the helper starts).
        self.settings = settings

    def start_helper(self) -> None:
        if not self.layout.data_dir.exists():
            # A new data directory is private from the start: 0710 root:<agent's group>, so the agent
            # reaches its own paths by name and no one else can enter (ADR 0022). An existing one is the
            # caller's (`space up` tightens its own).
            self.layout.data_dir.mkdir(mode=0o700, parents=True)
            agent_gid = _gid_of(self.agent_user)
            os.chown(self.layout.data_dir, 0, agent_gid)
            os.chmod(self.layout.data_dir, 0o710 if agent_gid else 0o700)
        sock = self.layout.helper_socket
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        log = filemodes.open_private_log(self.layout.data_dir / "helper.log")
        env = {name: os.environ[name] for name in HELPER_ENV if name in os.environ}
        env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        settings = self.settings or NodeAgentSettings()
        rootfs_cache = self.rootfs_cache or settings.rootfs_cache
        if rootfs_cache is not None:
            env["SPACE_ROOTFS_CACHE"] = str(rootfs_cache)
        try:
            self.helper_process = subprocess.Popen(
                [sys.executable, "-m", "space.node.helper.server", "--data-dir", str(self.layout.data_dir),
                 "--agent-user", self.agent_user, "--platform", self.platform, "--runsc", self.runsc,
                 "--network", self.network, "--cgroup-parent", self.cgroup_parent,
                 "--favor-cgroup-moves" if settings.favor_cgroup_moves else "--no-favor-cgroup-moves"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env,
                umask=filemodes.OWNER_ONLY_UMASK,
            )  # fmt: skip
        finally:
            os.close(log)
        deadline = time.monotonic() + settings.helper_start_timeout_s
        # Listening, not merely bound: the socket file appears at bind(), and a call made between bind() and
        # listen() is refused (a supervised restart of the helper failed that way).
        while not _accepts(sock):
            if self.helper_process.poll() is not None:
                tail = (self.layout.data_dir / "helper.log").read_text(errors="replace")[-2000:]
                raise errors.RuntimeFailure(f"node helper exited at start: {tail}")
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure("node helper did not open its socket")
            time.sleep(0.01)

    async def start(
        self, progress: Progress | None = None, templates: tuple[str, ...] = ("python",)
    ) -> NodeAgent:
        self.start_helper()
        uid = int(self.agent_user) if self.agent_user.isdigit() else _uid_of(self.agent_user)
        ensure_local_store(self.store_url, uid)
        self.agent = connect_agent(self.layout.data_dir, store_url=self.store_url, settings=self.settings)
        await self.agent.prepare(templates, progress)
        return self.agent

    async def stop(self, *, purge: bool = False) -> None:
        helper = HelperClient(str(self.layout.helper_socket))
        try:
            if self.agent is not None:
                await self.agent.close()
            if purge:
                await helper.call("node.teardown", timeout=300.0)
        finally:
            await helper.close()
            self.stop_helper()
            if purge:
                shutil.rmtree(self.layout.data_dir, ignore_errors=True)

    def stop_helper(self) -> None:
        if self.helper_process is not None and self.helper_process.poll() is None:
            self.helper_process.terminate()
            try:
                self.helper_process.wait(10)
            except subprocess.TimeoutExpired:
                self.helper_process.kill()
                self.helper_process.wait()
        self.helper_process = None


def _accepts(path: pathlib.Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _uid_of(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid


def _gid_of(user: str) -> int:
    """The primary group of the agent's user (0 for root or a uid without a passwd entry)."""
    import pwd

    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return 0
    return entry.pw_gid if entry.pw_uid else 0
