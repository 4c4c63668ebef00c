"""Per-node identities (ADR 0019, 0021) through the real API and node processes of a fake-driver cluster of
its own (it registers extra nodes, which other modules' cluster must not see): enrolment issues a secret per
node, kept by the node across restarts; heartbeats, re-registrations, credential fetches and audit posts
accept only the identity of the node named in the path; the cluster's bootstrap token only enrols."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core.ids import new_node_id
from tests.support import cluster as c
from tests.support import node_identity as ni


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path_factory.mktemp("node-identity")) as made:
        yield made


@pytest.fixture
def project(cluster: c.Cluster) -> Iterator[c.Project]:
    made = c.new_project(cluster)
    try:
        yield made
    finally:
        c.delete_all(cluster, made)


@pytest.fixture
def sandbox(project: c.Project) -> dict[str, Any]:
    """A running sandbox (on the cluster's node) bound to a credential holding a canary value."""
    client = project.http()
    value = "CANARY-" + secrets.token_hex(16)
    manager = project.http(project.new_key("admin")[1])  # credentials are made by admin keys (ADR 0026)
    answer = manager.put("/v1/credentials/tok", json={"value": value, "hosts": ["api.example.com"]})
    assert answer.status_code == 200, answer.text
    answer = client.post(
        "/v1/sandboxes", json={"limits": c.SMALL, "allow": ["api.example.com"], "credentials": ["tok"]}
    )
    assert answer.status_code == 201, answer.text
    return dict(answer.json()) | {"value": value}


def refused(answer: httpx.Response, status: int = 401) -> None:
    assert answer.status_code == status, answer.text
    code = {401: "unauthenticated", 403: "permission_denied"}[status]
    assert answer.json()["error"]["code"] == code, answer.text


def other_node(cluster: c.Cluster) -> tuple[str, str]:
    """A second node registered through the API (nothing listens at its url), never scheduled onto."""
    node_id, identity = ni.register(cluster, f"http://127.0.0.1:1/{secrets.token_hex(4)}")
    cluster.store.set_node_status(node_id, "draining")
    return node_id, identity


def node_id(cluster: c.Cluster) -> str:
    record = cluster.node_record()
    assert record is not None
    return record.id


def test_the_running_node_heartbeats_with_its_identity_and_the_bootstrap_token_only_registers(
    cluster: c.Cluster, sandbox: dict[str, Any]
) -> None:
    node = node_id(cluster)
    # The real node process registered and heartbeats with the identity it holds in memory.
    first = cluster.node_record().last_heartbeat_at  # type: ignore[union-attr]
    c.wait_for(
        lambda: cluster.node_record().last_heartbeat_at > first,  # type: ignore[union-attr]
        timeout=10, what="a heartbeat authenticated by the node's identity",
    )  # fmt: skip
    bootstrap = cluster.node.token
    refused(ni.heartbeat(cluster, node, bootstrap))
    refused(ni.fetch(cluster, node, sandbox["id"], bootstrap))
    refused(ni.audit(cluster, node, bootstrap, []))
    for wrong in (None, "", "nope", secrets.token_urlsafe(30)):
        refused(ni.heartbeat(cluster, node, wrong))
        refused(ni.fetch(cluster, node, sandbox["id"], wrong))
    refused(ni.heartbeat(cluster, new_node_id(), secrets.token_urlsafe(30)))  # an unknown node
    # An API key is no node identity either, and an identity is no API key.
    refused(ni.fetch(cluster, node, sandbox["id"], cluster.admin_key))
    _other, identity = other_node(cluster)
    refused(cluster.http(identity).get("/v1/sandboxes"))
    # Registering needs the bootstrap token (and an identity does not do).
    for wrong in ("not-the-cluster-token", identity):
        answer = cluster.http(wrong).post(
            "/v1/nodes/register", json={"url": "http://127.0.0.1:1/x", "token": "t"}
        )
        refused(answer)


def test_register_heartbeat_fetch_and_audit_as_the_node(cluster: c.Cluster, sandbox: dict[str, Any]) -> None:
    with ni.as_node(cluster) as (node, identity):
        answer = ni.heartbeat(cluster, node, identity)
        assert answer.status_code == 200, answer.text
        answer = ni.fetch(cluster, node, sandbox["id"], identity)
        assert answer.status_code == 200, answer.text
        (cred,) = answer.json()["credentials"]
        assert cred["name"] == "tok" and cred["value"] == sandbox["value"]
        event = {"sandbox_id": sandbox["id"], "action": "injected", "credential": "tok",
                 "host": "api.example.com", "at": time.time()}  # fmt: skip
        answer = ni.audit(cluster, node, identity, [event])
        assert answer.status_code == 200 and answer.json() == {"accepted": 1, "rejected": 0}, answer.text
    # The identity is the node's for good (ADR 0021): the node itself keeps heartbeating with it.
    before = cluster.node_record().last_heartbeat_at  # type: ignore[union-attr]
    c.wait_for(
        lambda: cluster.node_record().last_heartbeat_at > before,  # type: ignore[union-attr]
        timeout=10, what="the node's own heartbeats with the same identity",
    )  # fmt: skip
    assert cluster.node.identity == (node, identity)


def test_a_nodes_identity_gets_nothing_of_another_nodes_sandboxes(
    cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    node = node_id(cluster)
    other, identity = other_node(cluster)
    # As itself: the sandbox is not assigned to it.
    refused(ni.fetch(cluster, other, sandbox["id"], identity), 403)
    event = {"sandbox_id": sandbox["id"], "action": "injected", "credential": "tok"}
    answer = ni.audit(cluster, other, identity, [event])
    assert answer.status_code == 200 and answer.json() == {"accepted": 0, "rejected": 1}, answer.text
    # Posing as the sandbox's node: its identity is not that node's.
    refused(ni.fetch(cluster, node, sandbox["id"], identity))
    refused(ni.audit(cluster, node, identity, [event]))
    refused(ni.heartbeat(cluster, node, identity))
    # Its own heartbeat is fine.
    answer = ni.heartbeat(cluster, other, identity)
    assert answer.status_code == 200, answer.text
    # Nothing was handed out or recorded for it.
    entries = project.http().get("/v1/credentials/tok/audit").json()["entries"]
    assert not [e for e in entries if e["actor"] == f"node:{other}"], entries


def test_a_held_url_is_not_enrolled_again_and_reregistering_keeps_the_identity(cluster: c.Cluster) -> None:
    url = f"http://127.0.0.1:1/{secrets.token_hex(4)}"
    node, first = ni.register(cluster, url)
    cluster.store.set_node_status(node, "draining")
    assert ni.heartbeat(cluster, node, first).status_code == 200
    # The bootstrap token enrols new nodes only: the url is taken (ADR 0021).
    answer = ni.enrol(cluster, url)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "already_exists", answer.text
    # Its node re-registers with its identity, keeps id and identity.
    answer = ni.reregister(cluster, node, first, url)
    assert answer.status_code == 200 and answer.json()["node_id"] == node, answer.text
    cluster.store.set_node_status(node, "draining")
    assert ni.heartbeat(cluster, node, first).status_code == 200
    refused(ni.reregister(cluster, node, cluster.node.token, url))  # the bootstrap token is no identity
    # The identity is stored hashed only: it does not appear in the nodes table.
    with cluster.store.engine.connect() as db:
        rows = db.exec_driver_sql("SELECT * FROM nodes").all()
    assert first not in repr(rows)


def test_a_restarted_node_keeps_its_id_and_identity(cluster: c.Cluster) -> None:
    with ni.as_node(cluster) as (node, held):
        pass
    before = cluster.node_record().last_heartbeat_at  # type: ignore[union-attr]
    cluster.node.stop()
    cluster.node.start()  # its new process re-registers with the identity in its data directory
    c.wait_for(
        lambda: cluster.node_ready() and cluster.node_record().last_heartbeat_at > before,  # type: ignore[union-attr]
        timeout=30, what="the restarted node heartbeating again",
    )  # fmt: skip
    assert [n.id for n in cluster.store.list_nodes("ready")] == [node]
    assert cluster.node.identity == (node, held)
    assert ni.heartbeat(cluster, node, held).status_code == 200
