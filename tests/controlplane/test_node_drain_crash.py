"""A control plane SIGKILLed in the middle of a drain (docs/adr/0065-node-operations.md), as real processes:
one control plane, two fake-driver node agents, a local object store. Three sandboxes run on node A; A is
drained; the control plane is killed once the drain has started moving them, and started again: the drain
goes on from the database alone, A ends `drained` and empty, and every sandbox runs on B with its file.
(The exact crash points between the drain's own writes: tests/controlplane/test_node_drain.py.)"""

from __future__ import annotations

import pathlib

from space.core.lifecycle import State
from space.core.node_states import NodeAdminEvent
from tests.support import cluster as c


def test_a_control_plane_killed_mid_drain_converges(tmp_path: pathlib.Path) -> None:
    with c.start_fake_cluster(tmp_path / "cluster", nodes=2, object_store=True) as cluster:
        c.wait_for(lambda: len(cluster.store.list_nodes("ready")) == 2, timeout=30, what="two nodes ready")
        a, b = (n.id for n in cluster.store.list_nodes("ready"))
        cluster.store.node_admin_event(b, NodeAdminEvent.CORDON)  # everything starts on a
        with cluster.sdk() as sp:
            sandboxes = [sp.sandboxes.create(limits=c.SMALL) for _ in range(3)]
            for i, sb in enumerate(sandboxes):
                sb.files.write("kept.txt", f"sandbox {i}".encode())
            assert {cluster.store.load_sandbox(sb.id).node_id for sb in sandboxes} == {a}  # type: ignore[union-attr]
            admin = cluster.http(cluster.admin_key)
            assert admin.post(f"/v1/cluster/nodes/{b}/uncordon").status_code == 200
            assert admin.post(f"/v1/cluster/nodes/{a}/drain").json()["admin"] == "draining"

            def moving() -> bool:
                records = [cluster.store.load_sandbox(sb.id) for sb in sandboxes]
                return any(r is not None and r.desired_state == State.SUSPENDED for r in records)

            c.wait_for(moving, timeout=30, what="the drain started moving sandboxes")
            cluster.cp.kill()
            cluster.cp.start_and_wait()
            view = lambda: cluster.http(cluster.admin_key).get(f"/v1/cluster/nodes/{a}").json()  # noqa: E731
            c.wait_for(lambda: view()["admin"] == "drained", timeout=60, what="a drained after the restart")
            for i, sb in enumerate(sandboxes):
                record = c.wait_for(
                    lambda sb=sb: (r := cluster.store.load_sandbox(sb.id)) and r.state == State.RUNNING
                    and r.desired_state == State.RUNNING and r,
                    timeout=60, what=f"{sb.id} running again",
                )  # fmt: skip
                assert record.node_id == b
                assert sb.files.read("kept.txt") == f"sandbox {i}".encode()
            assert view()["sandboxes"] == 0 and view()["moving"] == 0
