"""Suspend, restore and crash recovery through the API, for real processes: a control plane and two
fake-driver node agents (each with its own data directory) sharing one local-directory object store.

- suspend frees the node, the snapshot is in the object store (encrypted, manifest present), restore brings
  the files back, on the other node when the first one is not schedulable;
- crash injection: the control plane SIGKILLs itself (space.controlplane.failpoints) at steps of a suspend
  and then of a restore (`make test`: the sample KILLED_AT; `make soak`, SPACE_SOAK=1: every step); each
  restart continues and the sandbox ends suspended with a verified snapshot, then running on exactly one
  node; no orphans on the nodes, no stray objects in the store;
- a runtime that dies is recovered from its checkpoint (recovered_at / recovered_from / notice visible);
- a node that hangs (SIGSTOP) is marked lost and its sandbox with an uploaded checkpoint comes back on the
  other node; when the hung node returns its stale copy is collected: never running twice.

The same logic is covered step by step, in process, by tests/controlplane/test_controlplane_suspend_logic.py.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.controlplane.failpoints import POINTS
from space.controlplane.store.records import SandboxRecord
from space.core.lifecycle import IN_PROGRESS_STATES, State
from space.objectstore.artifacts import read_manifest
from space.objectstore.backends import open_store
from tests.support import cluster as c

#: The control plane's SPACE_NODE_LOST_AFTER_S (production 15 s; a setting, shorter here so the lost-node test
#: waits less; fake nodes do not fence themselves, as in tests/e2e/test_restart_converges.py).
LOST_AFTER_S = 8.0
LOSS_ENV = {"SPACE_NODE_LOST_AFTER_S": str(LOST_AFTER_S), "SPACE_FENCE_GRACE_S": "2"}
SUSPEND_POINTS = ["suspend.recorded", "suspend.row", "suspend.uploaded", "suspend.verified", "suspend.marked"]
RESTORE_POINTS = ["restore.placed", "restore.done"]
#: The steps `make test` kills the control plane at: the two no other test kills a process at (before the
#: node is called), one after the upload and one after the restore on the target. The others are killed at
#: on real runsc nodes (tests/e2e/test_multinode.py: suspend.uploaded, suspend.marked, restore.placed;
#: tests/crash: suspend.uploaded) and in process, step by step (test_controlplane_suspend_logic.py).
KILLED_AT = {"suspend.recorded", "suspend.row", "suspend.verified", "restore.done"}
SOAK = os.environ.get("SPACE_SOAK", "") not in ("", "0")


def killed_at(points: list[str]) -> list[str]:
    """The steps of `points` (in order) this run kills the control plane at."""
    return points if SOAK else [p for p in points if p in KILLED_AT]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    # Scheduled snapshots every second (the production minimums are 60/300 s, ADR 0027).
    fast = ("--snapshot-min-intervals", "1,1")
    with c.start_fake_cluster(
        tmp_path_factory.mktemp("suspend"), nodes=2, object_store=True, control_plane_args=fast,
        control_plane_env=LOSS_ENV,
    ) as made:  # fmt: skip
        yield made


def node_of(cluster: c.Cluster, node_id: str) -> c.FakeNode:
    urls = {n.id: n.url for n in cluster.store.list_nodes(None)}
    return next(n for n in cluster.nodes if n.url == urls[node_id])


def node_id_of(cluster: c.Cluster, node: c.FakeNode) -> str:
    return next(n.id for n in cluster.store.list_nodes(None) if n.url == node.url)


def copies(cluster: c.Cluster, sandbox_id: str) -> dict[str, str]:
    """node id -> state, for every node that holds this sandbox."""
    found = {}
    for node in cluster.nodes:
        held = node.sandboxes()
        if sandbox_id in held:
            found[node_id_of(cluster, node)] = held[sandbox_id]["state"]
    return found


def record(cluster: c.Cluster, sandbox_id: str) -> SandboxRecord:
    sb = cluster.store.load_sandbox(sandbox_id)
    assert sb is not None
    return sb


def stored_prefixes(cluster: c.Cluster, sb: SandboxRecord) -> set[str]:
    assert cluster.store_url is not None
    objects = open_store(cluster.store_url)
    return {"/".join(k.split("/")[:4]) for k in objects.list(f"sandboxes/{sb.project_id}/{sb.id}/")}


def check_suspended(cluster: c.Cluster, sandbox_id: str) -> None:
    sb = record(cluster, sandbox_id)
    assert sb.state == State.SUSPENDED and sb.node_id is None, (sb.state, sb.error)
    # Its paused copy goes right after the record says suspended (or, after a crash, with the orphans).
    c.wait_for(lambda: copies(cluster, sandbox_id) == {}, timeout=30, interval=0.1, what="node copy freed")
    snap = cluster.store.get_snapshot(sb.suspended_snapshot_id or "")
    assert snap is not None and snap.restorable and snap.prefix == sb.suspended_prefix
    assert cluster.store_url is not None and snap.prefix is not None
    manifest = read_manifest(open_store(cluster.store_url), snap.prefix)
    assert manifest.encryption is not None, "the uploaded checkpoint is encrypted"
    assert stored_prefixes(cluster, sb) == {snap.prefix}, "exactly one artifact: no stray objects"


def check_running_once(cluster: c.Cluster, sandbox_id: str) -> str:
    sb = record(cluster, sandbox_id)
    assert sb.state == State.RUNNING and sb.node_id is not None, (sb.state, sb.error)
    assert copies(cluster, sandbox_id) == {sb.node_id: "running"}, "on exactly its node"
    return sb.node_id


def wait_state(cluster: c.Cluster, sandbox_id: str, state: State, timeout: float = 120) -> SandboxRecord:
    def reached() -> SandboxRecord | None:
        sb = record(cluster, sandbox_id)
        return sb if sb.state == state and sb.desired_state == state else None

    try:
        found = c.wait_for(reached, timeout=timeout, interval=0.05, what=f"{sandbox_id} {state}")
        assert found is not None
        return found
    except AssertionError:
        sb = record(cluster, sandbox_id)
        raise AssertionError(
            f"{sandbox_id}: {sb.state} -> {sb.desired_state} ({sb.error})\n{cluster.logs()}"
        ) from None


def no_orphans(cluster: c.Cluster) -> None:
    """Every copy on a node belongs to a live record that names that node."""
    for node in cluster.nodes:
        node_id = node_id_of(cluster, node)
        for sandbox_id, item in node.sandboxes().items():
            sb = cluster.store.load_sandbox(sandbox_id)
            known = sb and (sb.state, sb.node_id)
            assert sb is not None and sb.node_id == node_id and sb.state != State.DELETED, (
                f"orphan {sandbox_id} ({item['state']}) on {node.name}: record {known}"
            )


def test_failpoints_named_here_exist() -> None:
    assert set(SUSPEND_POINTS + RESTORE_POINTS) <= POINTS
    assert set(SUSPEND_POINTS + RESTORE_POINTS) >= KILLED_AT


def test_suspend_and_restore_on_the_other_node(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        payload = os.urandom(200_000)
        sb.files.write("data.bin", payload)
        first = record(cluster, sb.id).node_id
        assert first is not None
        started = time.monotonic()
        assert sb.suspend().state == "suspended"
        suspend_s = time.monotonic() - started
        check_suspended(cluster, sb.id)
        listed = sb.snapshots.list()
        suspended_to = record(cluster, sb.id).suspended_snapshot_id
        entry = next(s for s in listed if s.id == suspended_to)
        assert entry.locations == ["objectstore"] and entry.kind == "full"
        # The first node takes no new work: the restore must land on the other one.
        cluster.store.set_node_status(first, "draining")
        try:
            started = time.monotonic()
            assert sb.restore().state == "running"
            restore_s = time.monotonic() - started
        finally:
            cluster.store.set_node_status(first, "ready")
        second = check_running_once(cluster, sb.id)
        assert second != first
        assert sb.files.read("data.bin") == payload
        assert sb.exec("echo back").stdout == "back\n"
        print(f"\nfake nodes: suspend {suspend_s:.2f}s, restore on the other node {restore_s:.2f}s")
        sb.delete()
    no_orphans(cluster)


def test_a_suspended_sandbox_comes_back_on_first_use(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"kept")
        sb.suspend()
        assert sp.sandboxes.get(sb.id).files.read("f") == b"kept"
        assert record(cluster, sb.id).state == State.RUNNING
        sb.delete()


def test_suspend_is_refused_by_state_with_409(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.stop()
        answer = cluster.http(cluster.admin_key).post(f"/v1/sandboxes/{sb.id}/suspend")
        assert answer.status_code == 409, answer.text
        assert "stopped" in answer.json()["error"]["message"]
        sb.delete()


def test_policy_is_validated_and_shown(cluster: c.Cluster) -> None:
    http = cluster.http(cluster.admin_key)
    bad = http.post("/v1/sandboxes", json={"limits": c.SMALL, "snapshot_policy": {"disk_every_s": 0}})
    assert bad.status_code in (400, 422), bad.text
    assert bad.json()["error"]["code"] == "validation_error"  # the API's code for a malformed body
    bad = http.post("/v1/sandboxes", json={"limits": c.SMALL, "snapshot_policy": {"tiers": []}})
    assert bad.status_code in (400, 422), bad.text
    made = http.post("/v1/sandboxes", json={"limits": c.SMALL, "snapshot_policy": {"disk_every_s": 600}})
    assert made.status_code == 201, made.text
    view = made.json()
    assert view["snapshot_policy"]["disk_every_s"] == 600 and view["snapshot_policy"]["tiers"]
    assert {"notice", "recovered_at", "recovered_from", "crash_count"} <= set(view)
    cleared = http.patch(f"/v1/sandboxes/{view['id']}", json={"snapshot_policy": None})
    assert cleared.status_code == 200 and cleared.json()["snapshot_policy"] is None
    assert http.delete(f"/v1/sandboxes/{view['id']}").status_code == 202


def restart_with(cluster: c.Cluster, failpoint: str | None) -> None:
    """Kill the control plane and start it again, armed to die at `failpoint`: the restarted process may
    reach that point (resuming the step in flight) before it even answers /healthz."""
    cluster.cp.kill()
    armed = {"SPACE_FAILPOINTS": failpoint} if failpoint else {}
    cluster.cp.extra_env = {**LOSS_ENV, **armed}  # the same loss timeout after every restart
    cluster.cp.start()

    def up_or_died() -> str | None:
        if not cluster.cp.alive:
            return "died"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{cluster.cp.url}/healthz", timeout=2.0).status_code == 200:
                return "up"
        return None

    c.wait_for(up_or_died, timeout=c.START_TIMEOUT_S, interval=0.05, what="control plane up (or killed)")


def wait_died(cluster: c.Cluster, what: str) -> None:
    c.wait_for(
        lambda: not cluster.cp.alive, timeout=90, interval=0.05, what=f"control plane killed at {what}"
    )


def test_sigkill_at_the_steps_of_suspend_and_restore_converges(cluster: c.Cluster) -> None:
    http = cluster.http(cluster.admin_key, timeout=30)
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"survives every crash")
    report = []
    suspend_points, restore_points = killed_at(SUSPEND_POINTS), killed_at(RESTORE_POINTS)
    try:
        # Each restart arms the next point: the suspend continues from where the previous process died.
        restart_with(cluster, suspend_points[0])
        answer = http.post(f"/v1/sandboxes/{sb.id}/suspend", params={"wait": "false"})
        assert answer.status_code == 202, answer.text
        for point, following in zip(suspend_points, [*suspend_points[1:], None], strict=True):
            wait_died(cluster, point)
            mid = record(cluster, sb.id)
            report.append(f"killed at {point}: {mid.state}, on {len(copies(cluster, sb.id))} node(s)")
            assert mid.state in (State.SUSPENDING, State.SUSPENDED), mid.state
            restart_with(cluster, following)
        wait_state(cluster, sb.id, State.SUSPENDED)
        check_suspended(cluster, sb.id)

        restart_with(cluster, restore_points[0])
        answer = cluster.http(cluster.admin_key, timeout=30).post(
            f"/v1/sandboxes/{sb.id}/restore", params={"wait": "false"}
        )
        assert answer.status_code == 202, answer.text
        for point, following in zip(restore_points, [*restore_points[1:], None], strict=True):
            wait_died(cluster, point)
            mid = record(cluster, sb.id)
            report.append(f"killed at {point}: {mid.state}, copies {copies(cluster, sb.id)}")
            assert mid.state in (State.RESTORING, State.RUNNING), mid.state
            assert len(copies(cluster, sb.id)) <= 1, "never on two nodes"
            restart_with(cluster, following)
        wait_state(cluster, sb.id, State.RUNNING)
        check_running_once(cluster, sb.id)
    finally:
        if cluster.cp.extra_env or not cluster.cp.alive:
            restart_with(cluster, None)
        print("\n" + "\n".join(report))
    with cluster.sdk() as sp:
        again = sp.sandboxes.get(sb.id)
        assert again.files.read("f") == b"survives every crash"
        again.delete()
    no_orphans(cluster)


def guest_pids(node: c.FakeNode, sandbox_id: str) -> list[int]:
    base = str(node.data_dir / "sandboxes" / sandbox_id)
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (
                os.readlink(proc / "cwd").startswith(base)
                and b"space.guest" in (proc / "cmdline").read_bytes()
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_crashed_runtime_is_recovered_from_its_checkpoint(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"checkpointed")
        snap = sb.snapshots.create(full=True)
        sb.files.write("f", b"after the checkpoint (lost by the crash)")
        rec = record(cluster, sb.id)
        node = node_of(cluster, rec.node_id or "")
        pids = guest_pids(node, sb.id)
        assert pids, "the fake driver's guest daemon of the sandbox"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

        def recovered() -> SandboxRecord | None:
            now = record(cluster, sb.id)
            return now if now.recovered_at is not None and now.state == State.RUNNING else None

        after = c.wait_for(recovered, timeout=120, interval=0.1, what="crash recovered")
        assert after is not None and after.recovered_from == snap.id and after.crash_count >= 1
        view = sb.refresh().data
        assert view["recovered_from"] == snap.id and view["recovered_at"] and view["notice"]
        assert sb.files.read("f") == b"checkpointed"
        sb.delete()


def test_a_crash_without_checkpoint_restarts_on_the_kept_disk(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("kept.txt", b"on disk")
        node = node_of(cluster, record(cluster, sb.id).node_id or "")
        for pid in guest_pids(node, sb.id):
            os.kill(pid, signal.SIGKILL)

        def restarted() -> SandboxRecord | None:
            now = record(cluster, sb.id)
            return now if now.crash_count >= 1 and now.state == State.RUNNING else None

        after = c.wait_for(restarted, timeout=120, interval=0.1, what="restarted after the crash")
        assert after is not None and after.notice and "no usable checkpoint" in after.notice
        assert after.recovered_from is None
        assert sb.files.read("kept.txt") == b"on disk"
        check_running_once(cluster, sb.id)
        sb.delete()


def test_a_lost_nodes_sandbox_with_an_uploaded_checkpoint_moves(cluster: c.Cluster) -> None:
    policy: dict[str, Any] = {"full_every_s": 3600, "upload_full": True}
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL, snapshot_policy=policy)
        rec = record(cluster, sb.id)
        assert rec.snapshot_policy is not None and rec.snapshot_policy["upload_full"] is True

        def uploaded() -> bool:
            return any(s.restorable for s in cluster.store.list_snapshots(sb.id))

        c.wait_for(uploaded, timeout=60, interval=0.1, what="the scheduled checkpoint uploaded")
        listed = sb.snapshots.list()
        assert any(
            "objectstore" in s.locations and any(x.startswith("node:") for x in s.locations) for s in listed
        )
        first = rec.node_id
        assert first is not None
        hung = node_of(cluster, first)
        hung.signal(signal.SIGSTOP)
        try:

            def elsewhere() -> SandboxRecord | None:
                now = record(cluster, sb.id)
                return now if now.state == State.RUNNING and now.node_id != first else None

            moved = c.wait_for(
                elsewhere, timeout=LOST_AFTER_S + 45, interval=0.2, what="recovered on the other node"
            )
        finally:
            hung.signal(signal.SIGCONT)
        assert moved is not None
        assert moved.notice and "lost" not in (moved.error or "")
        # The hung node comes back with its stale copy: collected, never running twice.
        c.wait_for(lambda: copies(cluster, sb.id) == {moved.node_id: "running"}, timeout=60, interval=0.2,
                   what="the stale copy collected")  # fmt: skip
        assert sb.exec("echo moved").stdout == "moved\n"
        sb.delete()
    no_orphans(cluster)


def test_scheduled_snapshots_are_taken_and_pruned_on_the_node(cluster: c.Cluster) -> None:
    policy = {"disk_every_s": 1, "tiers": [{"every_s": 3600, "for_s": 7200}]}
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        user = sb.snapshots.create()  # a user's snapshot is never pruned
        assert sb.set_snapshot_policy(policy).data["snapshot_policy"]["disk_every_s"] == 1
        seen: set[str] = set()

        def scheduled() -> list[str]:
            ids = [s.id for s in cluster.store.list_snapshots(sb.id) if s.origin == "policy"]
            seen.update(ids)
            return ids

        def four_taken() -> bool:
            scheduled()
            return len(seen) >= 4

        c.wait_for(four_taken, timeout=60, interval=0.1, what="four scheduled snapshots taken")
        sb.set_snapshot_policy(None)
        node = node_of(cluster, record(cluster, sb.id).node_id or "")

        def pruned_everywhere() -> bool:
            kept = {s.id for s in cluster.store.list_snapshots(sb.id, include_deleting=True)}
            answer = node.get(f"/sandboxes/{sb.id}/snapshots")
            on_node = {item["snapshot_id"] for item in answer.json()["snapshots"]}
            return on_node == kept and len(set(scheduled())) <= 2 and user.id in kept

        c.wait_for(pruned_everywhere, timeout=40, interval=0.2, what="pruned in the database and on the node")
        listed = sb.snapshots.list()
        assert all(s.locations == [f"node:{node_id_of(cluster, node)}"] for s in listed)
        assert {s.data["origin"] for s in listed} <= {"user", "policy"}
        sb.delete()


def test_sigkill_while_recovering_converges(cluster: c.Cluster) -> None:
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"v1")
        snap = sb.snapshots.create(full=True)
        node = node_of(cluster, record(cluster, sb.id).node_id or "")
        try:
            restart_with(cluster, "recover.begun")
            for pid in guest_pids(node, sb.id):
                os.kill(pid, signal.SIGKILL)
            wait_died(cluster, "recover.begun")
            assert record(cluster, sb.id).state == State.RECOVERING
        finally:
            restart_with(cluster, None)
        after = wait_state(cluster, sb.id, State.RUNNING)
        assert after.recovered_from == snap.id and after.recovered_at is not None
        check_running_once(cluster, sb.id)
        assert sp.sandboxes.get(sb.id).files.read("f") == b"v1"
        sb.delete()


def stray_objects(cluster: c.Cluster) -> list[str]:
    """Stored artifacts no snapshot row (of a live sandbox) accounts for."""
    assert cluster.store_url is not None
    objects = open_store(cluster.store_url)
    stray = []
    for key in objects.list("sandboxes/"):
        _root, _project, sandbox_id, snapshot_id = key.split("/")[:4]
        sb = cluster.store.load_sandbox(sandbox_id)
        snap = cluster.store.get_snapshot(snapshot_id)
        if sb is None or sb.state == State.DELETED or snap is None or snap.state == "deleting":
            stray.append(key)
    return stray


def test_everything_converged(cluster: c.Cluster) -> None:
    # A delete answers before its teardown ends (ADR 0073): the last ones may still be `deleting`.
    c.wait_for(
        lambda: all(sb.state not in IN_PROGRESS_STATES for sb in cluster.records().values()),
        timeout=30, interval=0.1, what="no step in flight",
    )  # fmt: skip
    no_orphans(cluster)
    # Deleted sandboxes and pruned snapshots leave nothing in the object store (after a collector round).
    c.wait_for(lambda: stray_objects(cluster) == [], timeout=15, interval=0.2, what="no stray objects")
