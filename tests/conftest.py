"""Shared fixtures. `node` is one real node (root helper + runsc + btrfs image) for the whole session;
its finalizer destroys everything and then checks the host for leaks (mounts, loop devices, processes,
cgroups), so a leak fails the run instead of breaking the next one."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from space.node.agent.agent import NodeAgent
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode
from tests.support.host import (
    cgroups_under,
    loop_devices_for,
    mounts_under,
    network_traces,
    processes_mentioning,
)
from tests.support.loop import BackgroundLoop
from tests.support.s3server import s3_server  # noqa: F401 - session fixture: S3+KMS server on loopback


@dataclass
class RealNode:
    node: LocalNode
    agent: NodeAgent
    loop: BackgroundLoop

    @property
    def data_dir(self) -> pathlib.Path:
        return self.node.layout.data_dir

    def run(self, coro, timeout: float = 300.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (runsc, btrfs, the node helper); CI runs as root")


@pytest.fixture(scope="session")
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop()
    yield background
    background.close()


def make_data_dir(tag: str) -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix=f"space-test-{tag}-", dir="/var/tmp"))


def sandbox_ids_in(data_dir: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for sub in ("fs/sandboxes", "run"):
        root = data_dir / sub
        if root.is_dir():
            found.update(p.name for p in root.iterdir() if p.name.startswith("sb-"))
    return found


def assert_no_leaks(data_dir: pathlib.Path, sandbox_ids: set[str]) -> None:
    """Only this node's traces count: other test sessions may share the machine."""
    prefix = str(data_dir)
    assert mounts_under(prefix) == [], "mounts left behind"
    assert loop_devices_for(prefix) == [], "loop devices left behind"
    assert processes_mentioning(prefix) == [], "processes left behind"
    leftover = [g for g in cgroups_under("space") if pathlib.Path(g).name.rsplit("-", 1)[0] in sandbox_ids]
    assert leftover == [], "cgroups left behind"
    assert network_traces(node_tag(data_dir.resolve())) == [], "network namespaces, links or nft table left"


@pytest.fixture(scope="session")
def node(loop: BackgroundLoop) -> Iterator[RealNode]:
    require_root()
    data_dir = make_data_dir("node")
    # SPACE_TEST_NETWORK=sandbox|none overrides NodeSettings.network for the session's node.
    local = LocalNode(data_dir, network=os.environ.get("SPACE_TEST_NETWORK") or None)
    agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
    real = RealNode(local, agent, loop)
    try:
        yield real
    finally:
        sandbox_ids = sandbox_ids_in(data_dir) | set(agent.sandboxes)
        loop.run(agent.delete_all(), timeout=300)
        loop.run(local.stop(purge=True), timeout=300)
        assert_no_leaks(data_dir, sandbox_ids)
