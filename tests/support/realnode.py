"""One real node for tests (root helper + runsc + btrfs image) and the checks around it: `RealNode` (the
node, its agent and the loop it runs on), `require_root`, a fresh data directory under /var/tmp, and
`assert_no_leaks`, which fails if a node left mounts, loop devices, processes, cgroups or network traces
of its own data directory (other test sessions may share the machine, so only this node's traces count).
The session fixture `node` (tests/conftest.py) is built from these."""

from __future__ import annotations

import os
import pathlib
import tempfile
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
