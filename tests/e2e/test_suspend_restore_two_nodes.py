"""One control plane, two real runsc nodes on this machine (each its own data directory, btrfs image, helper,
cgroup parent and node agent running as the `space` user), one local-directory object store: suspend on one
node, restore on the other, through the API.

- every file's SHA-256 matches after the move, and a process counting in the background continues from
  where it stopped;
- the control plane is SIGKILLed (space.controlplane.failpoints) after the upload was verified but before
  the source node was freed, and again after the restore on the target but before it was recorded: the
  restarted control plane converges, the sandbox runs on exactly one node, nothing of it is left on the
  other (no runtime, no subvolume), and the store holds exactly its one artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import pwd
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from space.controlplane.local import _prepare_node
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core.lifecycle import State
from space.node.agent.identity import default_rpc_token_file
from space.node.local import LocalNode, ensure_local_store
from space.objectstore.backends import open_store
from space.sdk import NotFound, Sandbox, Space
from tests.support import cluster as c

pytestmark = pytest.mark.root

COUNTER = "i=0; while true; do echo $i > /work/counter; i=$((i+1)); sleep 0.1; done"
HASH = "cd /work && sha256sum big.bin deep/x/y.txt small.txt"


@dataclass
class RealNode:
    name: str
    local: LocalNode
    agent: c.Service
    url: str

    @property
    def data_dir(self) -> pathlib.Path:
        return self.local.layout.data_dir


@dataclass
class TwoNodes:
    root: pathlib.Path
    store: Store
    admin_key: str
    cp: c.ControlPlane
    nodes: list[RealNode]
    store_url: str

    def sdk(self) -> Space:
        return Space(url=self.cp.url, api_key=self.admin_key, transport=httpx.HTTPTransport(verify=False))

    def node_id(self, node: RealNode) -> str:
        return next(n.id for n in self.store.list_nodes(None) if n.url == node.url)

    def holding(self, sandbox_id: str) -> dict[str, str]:
        """node name -> state of its copy, from each node agent's own listing."""
        found = {}
        for node in self.nodes:
            token = default_rpc_token_file(node.data_dir).read_text().strip()  # its own (ADR 0021)
            answer = httpx.get(
                f"{node.url}/node/v1/sandboxes", params={"guest": "false"},
                headers={"Authorization": f"Bearer {token}"}, timeout=10,
            )  # fmt: skip
            answer.raise_for_status()
            for item in answer.json()["sandboxes"]:
                if item["id"] == sandbox_id:
                    found[node.name] = item["state"]
        return found

    def record(self, sandbox_id: str) -> SandboxRecord:
        sb = self.store.load_sandbox(sandbox_id)
        assert sb is not None
        return sb


def _agent_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("space")
    except KeyError:
        return 0, 0
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    if os.geteuid() != 0:
        pytest.fail("two real nodes need their root helpers: run the tests as root")
    uid, gid = _agent_ids()
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-test-2nodes-", dir="/var/tmp"))
    root.chmod(0o755)
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    os.chown(token_file, uid, gid)
    store_url = (root / "objects").as_uri()
    ensure_local_store(store_url, uid)
    cp_dir = root / "cp"
    cp_dir.mkdir()
    store, _org, _project, admin_key = c.bootstrap(sqlite_url(cp_dir))
    cp = c.ControlPlane(cp_dir, token_file, database_url=None, name="controlplane", store_url=store_url)
    nodes: list[RealNode] = []
    try:
        cp.start_and_wait()
        for name in ("a", "b"):
            data_dir = root / f"node-{name}"
            data_dir.mkdir()
            data_dir.chmod(0o755)
            local = LocalNode(data_dir, agent_user=uid, store_url=store_url, cgroup_parent=f"space-cp{name}")
            local.start_helper()
            port = c.free_port()
            argv = [sys.executable, "-m", "space.node.agent.server", "--data-dir", str(data_dir),
                    "--listen", f"127.0.0.1:{port}", "--bootstrap-token-file", str(token_file),
                    "--control-plane", cp.url, "--store-url", store_url,
                    "--log-level", "warning"]  # fmt: skip
            if uid:
                argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
            agent = c.Service(f"agent-{name}", argv, root / f"agent-{name}.log")
            agent.extra_env = {"HOME": "/"}
            node = RealNode(name, local, agent, f"http://127.0.0.1:{port}")
            nodes.append(node)
            _prepare_node(local, lambda _line: None)
            agent.start()
        made = TwoNodes(root, store, admin_key, cp, nodes, store_url)

        def both_ready() -> bool:
            for node in nodes:
                node.agent.check_alive()
            ready = {n.url for n in store.list_nodes("ready") if n.capacity}
            return all(node.url in ready for node in nodes)

        c.wait_for(both_ready, timeout=600, interval=0.5, what="both nodes registered")
        yield made
    finally:
        ids: set[str] = set()
        with contextlib.suppress(Exception):
            for sb in store.list_sandboxes(_project):
                ids.add(sb.id)
        cp.stop(timeout=10)
        for node in nodes:
            ids |= c.sandbox_ids_in(node.data_dir)
            node.agent.stop()
        leftovers: dict[str, object] = {}
        import asyncio

        for node in nodes:
            try:
                asyncio.run(node.local.stop(purge=True))
            except Exception as exc:
                # e.g. "loop devices still attached": the kernel detaches an autoclear loop device a
                # moment after the unmount. Only what is still there after a few seconds is a leak.
                print(f"teardown of node {node.name}: {exc!r}")
            deadline = time.monotonic() + 10
            while True:
                left = {k: v for k, v in c.host_leftovers(node.data_dir, ids).items() if v}
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if left:
                leftovers[node.name] = left
            for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{node.local.cgroup_parent}"):
                with contextlib.suppress(OSError):
                    parent.rmdir()
        store.close()
        left_processes = c.processes_in(root)
        c.kill_pids(int(line.split(":")[0]) for line in left_processes)
        shutil.rmtree(root, ignore_errors=True)
        assert leftovers == {} and left_processes == [], (leftovers, left_processes)


def counter(sb: Sandbox) -> int:
    """The background counter's value (0 before its first write; a torn read of the rewritten file is
    retried)."""
    for _ in range(50):
        try:
            text = sb.files.read("/work/counter").decode().strip()
        except NotFound:
            return 0
        if text.isdigit():
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the counter file never held a number")


def guest_hashes(sb: Sandbox) -> dict[str, str]:
    result = sb.exec(HASH)
    assert result.exit_code == 0, result.stderr
    return {name: digest for digest, name in (line.split() for line in result.stdout.splitlines())}


def other(two: TwoNodes, node_id: str) -> RealNode:
    return next(n for n in two.nodes if two.node_id(n) != node_id)


def restart_cp(two: TwoNodes, failpoint: str | None) -> None:
    two.cp.kill()
    two.cp.extra_env = {"SPACE_FAILPOINTS": failpoint} if failpoint else {}
    two.cp.start()

    def up_or_died() -> bool:
        if not two.cp.alive:
            return True
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{two.cp.url}/healthz", timeout=2.0).status_code == 200
        return False

    c.wait_for(up_or_died, timeout=60, interval=0.05, what="control plane up (or killed)")


def wait_record(two: TwoNodes, sandbox_id: str, state: State, timeout: float = 120) -> SandboxRecord:
    def reached() -> SandboxRecord | None:
        sb = two.record(sandbox_id)
        return sb if sb.state == state and sb.desired_state == state else None

    found = c.wait_for(reached, timeout=timeout, interval=0.1, what=f"{sandbox_id} {state}")
    assert found is not None
    return found


def test_suspend_on_one_node_restore_on_the_other(two_nodes: TwoNodes) -> None:
    two = two_nodes
    with two.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            data = {"/work/big.bin": os.urandom(4 << 20), "/work/small.txt": b"hi\n",
                    "/work/deep/x/y.txt": b"deep" * 1000}  # fmt: skip
            for path, content in data.items():
                sb.files.write(path, content)
            expected = {p.removeprefix("/work/"): hashlib.sha256(d).hexdigest() for p, d in data.items()}
            assert guest_hashes(sb) == expected
            sb.processes.start(COUNTER, tag="counter")
            c.wait_for(lambda: counter(sb) >= 5, timeout=20, what="counting")
            source = two.record(sb.id).node_id
            assert source is not None

            before = counter(sb)  # the counter keeps going until the suspend pauses it
            started = time.monotonic()
            assert sb.suspend().state == "suspended"
            suspend_s = time.monotonic() - started
            c.wait_for(lambda: two.holding(sb.id) == {}, timeout=30, interval=0.1, what="source freed")
            two.store.set_node_status(source, "draining")  # the restore must go to the other node
            try:
                started = time.monotonic()
                assert sb.restore().state == "running"
                restore_s = time.monotonic() - started
            finally:
                two.store.set_node_status(source, "ready")
            target = two.record(sb.id).node_id
            assert target is not None and target != source
            assert two.holding(sb.id) == {other(two, source).name: "running"}
            assert guest_hashes(sb) == expected, "every file's SHA-256 matches on the other node"
            resumed_at = counter(sb)
            assert resumed_at >= before >= 5, "the counter continued, it did not start again from 0"
            c.wait_for(lambda: counter(sb) > resumed_at, timeout=20, what="still counting")
            print(f"\ntwo runsc nodes: suspend {suspend_s:.2f}s, restore on the other node {restore_s:.2f}s")
        finally:
            sb.delete()


def test_control_plane_killed_mid_suspend_and_mid_restore_on_two_nodes(two_nodes: TwoNodes) -> None:
    two = two_nodes
    http = httpx.Client(base_url=two.cp.url, headers={"Authorization": f"Bearer {two.admin_key}"}, timeout=60)
    with two.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        sb.files.write("/work/f.txt", b"through two crashes")
    try:
        restart_cp(two, "suspend.verified")
        assert http.post(f"/v1/sandboxes/{sb.id}/suspend", params={"wait": "false"}).status_code == 202
        c.wait_for(lambda: not two.cp.alive, timeout=120, what="killed after the verified upload")
        assert two.record(sb.id).state == State.SUSPENDING
        assert len(two.holding(sb.id)) == 1, "the source is kept until the copy is verified"
        restart_cp(two, "restore.done")
        wait_record(two, sb.id, State.SUSPENDED)
        c.wait_for(lambda: two.holding(sb.id) == {}, timeout=30, interval=0.2, what="source freed")
        snap_prefix = two.record(sb.id).suspended_prefix
        assert http.post(f"/v1/sandboxes/{sb.id}/restore", params={"wait": "false"}).status_code == 202
        c.wait_for(lambda: not two.cp.alive, timeout=120, what="killed after the node restored")
        assert two.record(sb.id).state == State.RESTORING
        restart_cp(two, None)
        running = wait_record(two, sb.id, State.RUNNING)
        holder = next(n.name for n in two.nodes if two.node_id(n) == running.node_id)
        assert two.holding(sb.id) == {holder: "running"}, "never on two nodes"
        objects = open_store(two.store_url)
        keys = objects.list(f"sandboxes/{running.project_id}/{sb.id}/")
        assert keys and all(k.startswith(f"{snap_prefix}/") for k in keys), "exactly its one artifact"
        with two.sdk() as sp:
            assert sp.sandboxes.get(sb.id).files.read("/work/f.txt") == b"through two crashes"
    finally:
        if two.cp.extra_env or not two.cp.alive:
            restart_cp(two, None)
        http.close()
        with two.sdk() as sp:
            sp.sandboxes.get(sb.id).delete(wait=True)  # the teardown done, not only begun (ADR 0073)
    for node in two.nodes:
        assert sb.id not in c.sandbox_ids_in(node.data_dir), f"{node.name} keeps something of {sb.id}"


def test_a_hung_nodes_sandbox_comes_back_on_the_other_node(two_nodes: TwoNodes) -> None:
    """Its scheduled, uploaded checkpoint is restored on the other node once the hung node is marked lost;
    when the hung node answers again its stale copy is collected at its first heartbeat."""
    two = two_nodes
    policy = {"full_every_s": 3600, "upload_full": True}
    with two.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256}, snapshot_policy=policy)
        try:
            sb.files.write("/work/before.txt", b"in the uploaded checkpoint")

            def uploaded() -> bool:
                return any(s.restorable for s in two.store.list_snapshots(sb.id))

            # The first scheduled checkpoint was taken at once; take it again after the write.
            c.wait_for(uploaded, timeout=60, interval=0.2, what="the scheduled checkpoint uploaded")
            first = two.store.list_snapshots(sb.id)[0]
            two.store.delete_snapshot(first.id)  # the next round takes a new one, with before.txt
            c.wait_for(
                lambda: any(s.restorable and s.id != first.id for s in two.store.list_snapshots(sb.id)),
                timeout=60, interval=0.2, what="a checkpoint with the file uploaded",
            )  # fmt: skip
            source = two.record(sb.id).node_id
            hung = next(n for n in two.nodes if two.node_id(n) == source)
            hung.agent.signal(signal.SIGSTOP)
            started = time.monotonic()
            try:

                def elsewhere() -> SandboxRecord | None:
                    now = two.record(sb.id)
                    return now if now.state == State.RUNNING and now.node_id != source else None

                moved = c.wait_for(elsewhere, timeout=90, interval=0.2, what="recovered on the other node")
                moved_s = time.monotonic() - started
            finally:
                hung.agent.signal(signal.SIGCONT)
            assert moved is not None and moved.recovered_from is not None and moved.notice
            c.wait_for(
                lambda: two.holding(sb.id) == {other(two, source or "").name: "running"},
                timeout=60, interval=0.2, what="the hung node's stale copy collected",
            )  # fmt: skip
            assert sb.files.read("/work/before.txt") == b"in the uploaded checkpoint"
            print(f"\nhung node: sandbox running on the other node {moved_s:.1f}s after SIGSTOP")
        finally:
            sb.set_snapshot_policy(None)
            sb.delete()
