"""Fencing with a real runsc node (ADR 0033): a node that cannot reach the control plane for longer than its
lease stops its own sandboxes BEFORE the control plane may mark it lost (and recover them elsewhere), and
when it is back, everything converges: one copy, running, its files kept.

The control plane runs inside a network namespace this module creates; the node (root helper, runsc, btrfs
image, agent as `space`) reaches it only through a veth pair into that namespace, and the control plane
calls the agent back over it. Short timings (settings, not code): node_lost_after_s 5, fence_grace_s 2, so
the lease is 3 s from the SEND time of the last acknowledged heartbeat; heartbeats every 0.5 s.

1. a frozen agent (SIGSTOP): its helper, which holds the lease, pauses and tears down the sandbox on its
   own; the node is marked lost only after that; SIGCONT: the node is ready again, the sandbox is restarted
   on its kept disk, and it is the only copy;
2. a partition (`ip link set <veth> down`): the same, with the agent running but cut off; the link back up
   heals it the same way.

At the moment the control plane is first seen to have marked the node lost, the helper must already have
reported the fence done (read just before), and the sandbox's runtime must be gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from space.controlplane.local import _prepare_node
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from space.node.agent.helper_client import HelperClient
from space.node.helper.fence_verbs import LIVE
from space.node.local import ensure_local_store
from space.sdk import Space
from tests.support import cluster as c
from tests.support import realcluster
from tests.support.realcluster import ClusterNode

pytestmark = pytest.mark.root

LOST_AFTER_S = 5.0
GRACE_S = 2.0
HEARTBEAT_S = 0.5


@dataclass
class Partitioned:
    """A control plane in network namespace `netns` and one real node reaching it through `veth`."""

    root: pathlib.Path
    netns: str
    veth: str  # the host side of the pair
    cp: c.ControlPlane
    cp_url: str
    node: ClusterNode
    db: Store
    sdk: Space

    def helper(self, verb: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            client = HelperClient(str(self.node.layout.helper_socket))
            try:
                return await client.call(verb, args, timeout=30)
            finally:
                await client.close()

        return asyncio.run(call())

    def node_status(self) -> str:
        (record,) = self.db.list_nodes(None)
        return record.status

    def runtime(self, sandbox_id: str) -> str:
        return str(self.helper("sandbox.state", {"sandbox_id": sandbox_id})["runtime"])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _cp_up(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    return False


@pytest.fixture(scope="module")
def world() -> Iterator[Partitioned]:
    if os.geteuid() != 0:
        pytest.fail("a real node and a network namespace need root: run the tests as root")
    uid, gid = realcluster._agent_ids()
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-test-fence-", dir="/var/tmp"))
    root.chmod(0o755)
    tag = secrets.token_hex(3)
    netns, veth, peer = f"spfence{tag}", f"vfh{tag}", f"vfn{tag}"
    subnet = 64 + secrets.randbelow(128)
    host_ip, cp_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    os.chown(token_file, uid, gid)
    store_url = (root / "objects").as_uri()
    ensure_local_store(store_url, uid)
    cp_dir = root / "cp"
    cp_dir.mkdir()
    cp = c.ControlPlane(cp_dir, token_file, database_url=None, name="controlplane")
    cp.argv = ["ip", "netns", "exec", netns, *cp.argv, "--host", cp_ip]
    cp.extra_env = {"SPACE_NODE_LOST_AFTER_S": str(LOST_AFTER_S), "SPACE_FENCE_GRACE_S": str(GRACE_S)}
    cp_url = f"http://{cp_ip}:{cp.port}"
    node = realcluster._make_node(root, "f", token_file, cp_url, store_url, uid, gid)
    listen = node.agent.argv.index("--listen")
    node.agent.argv[listen + 1] = f"{host_ip}:{node.port}"
    node.agent.argv += ["--advertise-url", f"http://{host_ip}:{node.port}"]
    node.agent.extra_env.update(
        SPACE_NODE_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S), SPACE_NODE_CONTROL_PLANE_TIMEOUT_S="1"
    )
    db: Store | None = None
    sdk: Space | None = None
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", netns)
        _ip("addr", "add", f"{host_ip}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", netns, "addr", "add", f"{cp_ip}/30", "dev", peer)
        _ip("-n", netns, "link", "set", peer, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        db, _org, _project, admin_key = c.bootstrap(sqlite_url(cp_dir))
        cp.start()
        node.local.start_helper()
        _prepare_node(node.local, lambda _line: None)
        c.wait_for(lambda: _cp_up(cp_url), timeout=c.START_TIMEOUT_S, interval=0.1, what="control plane up")
        node.agent.start()
        store = db
        c.wait_for(
            lambda: [n.status for n in store.list_nodes(None)] == ["ready"], timeout=300, interval=0.2,
            what="the node registered",
        )  # fmt: skip
        sdk = Space(url=cp_url, api_key=admin_key, transport=httpx.HTTPTransport(verify=False))
        yield Partitioned(root, netns, veth, cp, cp_url, node, db, sdk)
    finally:
        if sdk is not None:
            sdk.close()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "set", veth, "up")  # a failed test may have left it down: let the agent deregister
        problems = realcluster._teardown(None, root, cp, [node], db)
        # Deleting our end deletes both now; the namespace's deletion would take them only in the kernel's
        # asynchronous clean-up.
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", veth)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", netns)
        leftover = [p.name for p in pathlib.Path("/sys/class/net").iterdir() if p.name in (veth, peer)]
        assert problems == {} and leftover == [], (problems, leftover)


def _fenced_before_lost(world: Partitioned, sandbox_id: str, started: float) -> dict[str, float]:
    """Poll (helper first, then the database) until the node is marked lost; assert that by then the
    fence was done and the runtime gone. Returns the fence's and the loss's times after `started`."""
    deadline = time.monotonic() + 4 * LOST_AFTER_S
    fence: dict[str, Any] = {}
    while time.monotonic() < deadline:
        fence = world.helper("node.fence_status")
        if world.node_status() == "lost":
            lost_seen = time.time()
            assert fence["fenced"] and fence["last"].get("stopped") == [sandbox_id], (
                f"the node was marked lost before its fence was done: {fence}"
            )
            assert fence["last"]["done_at"] < lost_seen and fence["last"]["left"] == []
            assert world.runtime(sandbox_id) not in LIVE
            return {
                "paused_after_s": fence["last"]["paused_at"] - started,
                "fenced_after_s": fence["last"]["done_at"] - started,
                "teardown_s": fence["last"]["done_at"] - fence["last"]["started_at"],
                "lost_seen_after_s": lost_seen - started,
            }
        time.sleep(0.05)
    raise AssertionError(f"the node was not marked lost: fence {fence}\n{world.cp.log_tail()}")


def _converged(world: Partitioned, sandbox_id: str, generation: int) -> None:
    """Node ready, fence lifted, the sandbox restarted on its kept disk, one copy, its file there."""

    def restarted() -> bool:
        record = world.db.load_sandbox(sandbox_id)
        return (
            world.node_status() == "ready"
            and record is not None
            and record.state.value == "running"
            and record.generation > generation
        )

    c.wait_for(restarted, timeout=90, interval=0.2, what="the fenced sandbox running again")
    status = world.helper("node.fence_status")
    assert status["armed"] and not status["fenced"]
    sandbox = world.sdk.sandboxes.get(sandbox_id)
    assert sandbox.exec("cat /work/kept").stdout == "kept\n"
    live = [s["sandbox_id"] for s in world.helper("sandbox.list")["sandboxes"] if s["runtime"] in LIVE]
    assert live == [sandbox_id]


def _scenario(world: Partitioned, cut: Callable[[], None], heal: Callable[[], None]) -> dict[str, float]:
    sandbox = world.sdk.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
    try:
        sandbox.exec("echo kept > /work/kept")
        record = world.db.load_sandbox(sandbox.id)
        assert record is not None and world.runtime(sandbox.id) == "running"
        started = time.time()
        cut()
        try:
            timings = _fenced_before_lost(world, sandbox.id, started)
        finally:
            heal()
        _converged(world, sandbox.id, record.generation)
        return timings
    finally:
        sandbox.delete()


def test_a_frozen_agent_is_fenced_by_its_helper(world: Partitioned) -> None:
    agent = world.node.agent
    timings = _scenario(world, lambda: agent.signal(signal.SIGSTOP), lambda: agent.signal(signal.SIGCONT))
    print(f"\nfrozen agent: {timings}")
    assert timings["fenced_after_s"] < LOST_AFTER_S


def test_a_partitioned_node_fences_itself(world: Partitioned) -> None:
    timings = _scenario(
        world, lambda: _ip("link", "set", world.veth, "down"), lambda: _ip("link", "set", world.veth, "up")
    )
    print(f"\npartitioned node: {timings}")
    assert timings["fenced_after_s"] < LOST_AFTER_S
