"""Disk bounds through the public API (issue 9, item 6; ADR 0027) on the shared fake-driver cluster: a disk no
node can hold is refused at once with 507 naming the numbers (and nothing is recorded), snapshot policies
below the minimum intervals are 422 naming the field, and the node's disk reaches the control plane in its
heartbeat."""

from __future__ import annotations

from typing import Any

from space.core.settings import SandboxLimits
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project


def node_capacity(cluster: c.Cluster) -> dict[str, Any]:
    def reported() -> dict[str, Any] | None:
        record = cluster.node_record()
        capacity = record.capacity if record is not None else {}
        return capacity if "disk_mb" in capacity else None

    found = c.wait_for(reported, timeout=30, interval=0.2, what="the node's disk in its heartbeat")
    assert found is not None
    return found


def test_the_node_reports_its_disk(fake_cluster: c.Cluster) -> None:
    capacity = node_capacity(fake_cluster)
    assert capacity["disk_mb"] > 0 and 0 <= capacity["disk_free_mb"] <= capacity["disk_mb"]
    assert 0 < capacity["disk_reserve_mb"] <= 2048


def test_a_disk_larger_than_every_node_is_refused_at_once(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    capacity = node_capacity(fake_cluster)
    room = capacity["disk_mb"] - capacity["disk_reserve_mb"]
    too_big = room + 1
    assert too_big <= 1048576, "the fake node's disk is larger than the largest disk_mb: nothing to test"
    http = project.http()
    answer = http.post("/v1/sandboxes", json={"limits": {**c.SMALL, "disk_mb": too_big}, "wait": False})
    assert answer.status_code == 507, answer.text
    error = answer.json()["error"]
    assert error["code"] == "storage_exhausted"
    assert error["details"]["disk_mb"] == too_big and error["details"]["largest_node_disk_mb"] == room
    assert "more than any node can hold" in error["message"]
    assert fake_cluster.records(project.id) == {}, "nothing is recorded for a refused create"
    # The SDK raises the typed error.
    from space.sdk import StorageExhausted

    with project.sdk() as sp:
        try:
            sp.sandboxes.create(limits={**c.SMALL, "disk_mb": too_big})
        except StorageExhausted as exc:
            assert exc.details["largest_node_disk_mb"] == room
        else:
            raise AssertionError("the SDK accepted a disk no node can hold")


def test_a_sandbox_records_its_storage_budget(fake_cluster: c.Cluster, project: c.Project) -> None:
    http = project.http()
    made = http.post("/v1/sandboxes", json={"limits": {**c.SMALL, "disk_mb": 100}})
    assert made.status_code == 201, made.text
    assert made.json()["limits"]["storage_mb"] == 200  # 2 x disk_mb by default
    bad = http.post("/v1/sandboxes", json={"limits": {**c.SMALL, "storage_mb": 10}})
    assert bad.status_code == 422 and "storage_mb" in bad.text
    assert SandboxLimits(disk_mb=100).storage_mb == 200


def test_policies_below_the_minimum_intervals_are_refused(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    http = project.http()
    for policy, field, words in (
        ({"disk_every_s": 1}, "disk_every_s", "no more often than every 60 s"),
        ({"full_every_s": 299}, "full_every_s", "no more often than every 300 s"),
        ({"disk_every_s": 60, "max_retained": 100000}, "max_retained", "max_retained"),
    ):
        answer = http.post(
            "/v1/sandboxes", json={"limits": c.SMALL, "snapshot_policy": policy, "wait": False}
        )
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "validation_error" and words in error["message"], error
        assert any(field in f for f in error["details"]["fields"]), error
    assert fake_cluster.records(project.id) == {}
    made = http.post("/v1/sandboxes", json={"limits": c.SMALL, "snapshot_policy": {"disk_every_s": 60}})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["id"]
    patched = http.patch(f"/v1/sandboxes/{sandbox_id}", json={"snapshot_policy": {"full_every_s": 10}})
    assert patched.status_code == 422 and "300 s" in patched.text


def test_a_snapshot_over_the_budget_is_507_through_the_api(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    # The fake driver keeps whole copies: each snapshot of a 25 MiB sandbox keeps 25 MiB more.
    http = project.http()
    made = http.post("/v1/sandboxes", json={"limits": {**c.SMALL, "storage_mb": 64}})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["id"]
    with project.sdk() as sp:
        wrote = sp.sandboxes.get(sandbox_id).exec(f"head -c {25 << 20} /dev/zero > blob")
        assert wrote.exit_code == 0, wrote.stderr
    assert http.post(f"/v1/sandboxes/{sandbox_id}/snapshots", json={}).status_code == 201
    refused = http.post(f"/v1/sandboxes/{sandbox_id}/snapshots", json={})
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert error["code"] == "storage_exhausted" and error["details"]["reason"] == "storage_budget"
    assert error["details"]["budget_bytes"] == 64 << 20 and error["details"]["used_bytes"] > 64 << 20
    listed = http.get(f"/v1/sandboxes/{sandbox_id}/snapshots").json()["snapshots"]
    assert len(listed) == 1, "the refused snapshot is recorded nowhere"
