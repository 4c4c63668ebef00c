"""A sandbox's isolation through the HTTP API on the fake cluster (issue 15, ADR 0076): the record's field
and its default, the refusals (a value that is not exactly an isolation's name; an isolation no ready node
runs; what a microVM cannot do), forks keeping their source's, and another tenant seeing nothing new. The
fake node counts as gVisor; the real microVM is tests/e2e/test_isolation_mixed_cluster.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from space.core import isolation
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project

DISK_POLICY = {"disk_every_s": 86400}


def _error(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    return dict(answer.json()["error"])


def _microvm_record(cluster: c.Cluster, project: c.Project) -> str:
    """A microvm sandbox's record (never running: the fake cluster has no node that runs microVMs)."""
    return cluster.store.create_sandbox(project.id, "python", isolation="microvm").id


def test_the_record_says_gvisor_by_default(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    made = client.post("/v1/sandboxes", json={"limits": c.SMALL})
    assert made.status_code == 201, made.text
    assert made.json()["isolation"] == "gvisor"
    explicit = client.post("/v1/sandboxes", json={"limits": c.SMALL, "isolation": "gvisor", "wait": False})
    assert explicit.status_code == 201 and explicit.json()["isolation"] == "gvisor"
    assert client.get(f"/v1/sandboxes/{made.json()['id']}").json()["isolation"] == "gvisor"
    listed = client.get("/v1/sandboxes").json()["sandboxes"]
    assert {item["isolation"] for item in listed} == {"gvisor"} and len(listed) == 2
    with project.sdk() as sp:
        assert sp.sandboxes.get(made.json()["id"]).isolation == "gvisor"


def test_an_isolation_no_ready_node_runs_is_refused_at_once(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    answer = project.http().post("/v1/sandboxes", json={"limits": c.SMALL, "isolation": "microvm"})
    error = _error(answer, 503)
    assert error["code"] == "unavailable"
    assert "no node runs microvm sandboxes" in error["message"] and "gvisor" in error["message"]
    assert error["details"]["reason"] == "no_node_for_isolation"
    assert fake_cluster.store.list_sandboxes(project.id) == []  # nothing recorded, nothing waits


@pytest.mark.parametrize(
    "forged",
    ["microvm\n", "kvm", "", "MICROVM", "qemu", "runsc", " gvisor", "gvisor\x00", None, 1, ["microvm"]],
)
def test_a_forged_isolation_is_422(fake_cluster: c.Cluster, project: c.Project, forged: object) -> None:
    answer = project.http().post("/v1/sandboxes", json={"limits": c.SMALL, "isolation": forged})
    error = _error(answer, 422)
    assert error["code"] == "validation_error" and "isolation" in str(error["details"]["fields"])
    assert fake_cluster.store.list_sandboxes(project.id) == []


def test_forks_and_sandboxes_from_snapshots_keep_their_sources(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    with project.sdk() as sp:
        source = sp.sandboxes.create(limits=c.SMALL)
        snap = source.snapshots.create(full=True)
    refused = client.post("/v1/sandboxes", json={"from_snapshot": snap.id, "isolation": "gvisor"})
    assert _error(refused, 400)["details"]["field"] == "isolation"
    child = client.post("/v1/sandboxes", json={"from_snapshot": snap.id})
    assert child.status_code == 201 and child.json()["isolation"] == "gvisor"
    forks = client.post(f"/v1/sandboxes/{source.id}/fork", json={"count": 1})
    assert forks.status_code == 201, forks.text
    assert [item["isolation"] for item in forks.json()["sandboxes"]] == ["gvisor"]
    vm = _microvm_record(fake_cluster, project)
    assert fake_cluster.store.create_sandbox(project.id, "python", forked_from=vm).isolation == "microvm"


def test_what_a_microvm_cannot_do_is_409_naming_it(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    vm = _microvm_record(fake_cluster, project)
    assert client.get(f"/v1/sandboxes/{vm}").json()["isolation"] == "microvm"
    disk = _error(client.post(f"/v1/sandboxes/{vm}/snapshots", json={"full": False}), 409)
    assert disk["code"] == "not_supported"
    assert disk["message"] == "disk snapshots are not supported for microvm sandboxes; take a full snapshot"
    assert disk["details"] == {"isolation": "microvm", "operation": "disk_snapshot"}
    policy = _error(client.patch(f"/v1/sandboxes/{vm}", json={"snapshot_policy": DISK_POLICY}), 409)
    assert policy["code"] == "not_supported"
    assert isolation.unsupported("microvm", "suspend") is None  # ADR 0081: suspend and uploads work
    assert isolation.unsupported("microvm", "upload") is None
    create = client.post("/v1/sandboxes", json={"isolation": "microvm", "snapshot_policy": DISK_POLICY})
    assert _error(create, 409)["code"] == "not_supported"  # before placement is even asked about
    record = fake_cluster.store.load_sandbox(vm)
    # The refused patch changed nothing (the reconciler may have moved the record on meanwhile: it tries,
    # and fails, to place it).
    assert (
        record is not None
        and record.snapshot_policy is None
        and record.state.value in {"pending", "creating"}
    )
    assert fake_cluster.store.list_snapshots(vm) == []
    assert [sb.id for sb in fake_cluster.store.list_sandboxes(project.id)] == [vm]


def test_another_tenant_learns_nothing_of_a_microvm(fake_cluster: c.Cluster, project: c.Project) -> None:
    vm = _microvm_record(fake_cluster, project)
    attacker = c.new_project(fake_cluster)
    try:
        theirs = attacker.http()
        # 404 like a missing sandbox, never the 409 that would tell a microVM is there.
        for answer in (
            theirs.get(f"/v1/sandboxes/{vm}"),
            theirs.post(f"/v1/sandboxes/{vm}/snapshots", json={"full": False}),
            theirs.patch(f"/v1/sandboxes/{vm}", json={"snapshot_policy": DISK_POLICY}),
            theirs.post(f"/v1/sandboxes/{vm}/fork", json={"count": 1}),
            theirs.post(f"/v1/sandboxes/{vm}/suspend"),
        ):
            assert answer.status_code in (400, 404), answer.text  # 400: suspend needs object storage here
            assert "microvm" not in answer.text
        # A create from "their snapshot" with an isolation is refused for the field, as for any name.
        for ref in (vm, "snap-00000000000000000000000000"):
            answer = theirs.post("/v1/sandboxes", json={"from_snapshot": ref, "isolation": "microvm"})
            assert _error(answer, 400)["details"]["field"] == "isolation"
        assert vm not in theirs.get("/v1/sandboxes").text
    finally:
        c.delete_all(fake_cluster, attacker)
