"""Acting as a node of a fake cluster towards the control plane (ADR 0019: per-node identities).

A node's identity lives only in its process's memory, so a test that needs the identity of the cluster's
node registers that node's url again itself, exactly as the node does after a restart, and uses the fresh
identity. To keep the node from registering again meanwhile (its next heartbeat is refused once the
identity rotated), the node process is frozen (SIGSTOP, like a hung node; the control plane marks a node
lost only after 15 s) for the duration. On exit it continues, finds its identity refused and registers
again, which also ends the test's identity: `as_node` waits for exactly that.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import httpx

from tests.support import cluster as c


def register(
    cluster: c.Cluster, url: str, *, rpc_token: str = "unused", capacity: dict[str, Any] | None = None,
    templates: list[str] | None = None, bootstrap: str | None = None,
) -> tuple[str, str]:  # fmt: skip
    """(node id, identity) of registering `url` through the API with the cluster's bootstrap token."""
    answer = cluster.http(bootstrap or cluster.node.token).post(
        "/v1/nodes/register",
        json={"url": url, "token": rpc_token, "capacity": capacity or {"cpus": 1, "memory_mb": 64},
              "templates": templates or []},
    )  # fmt: skip
    assert answer.status_code in (200, 201), answer.text
    body = answer.json()
    assert isinstance(body.get("identity"), str) and len(body["identity"]) >= 32, sorted(body)
    return str(body["node_id"]), str(body["identity"])


def client(cluster: c.Cluster, identity: str | None) -> httpx.Client:
    """A client of the control plane presenting `identity` (None: no Authorization header)."""
    return cluster.http(identity) if identity is not None else cluster.http()


def heartbeat(cluster: c.Cluster, node_id: str, identity: str | None) -> httpx.Response:
    return client(cluster, identity).post(
        f"/v1/nodes/{node_id}/heartbeat", json={"sandboxes": [], "templates": ["python"]}
    )


def fetch(cluster: c.Cluster, node_id: str, sandbox_id: str, identity: str | None) -> httpx.Response:
    return client(cluster, identity).get(f"/v1/nodes/{node_id}/sandboxes/{sandbox_id}/credentials")


def audit(
    cluster: c.Cluster, node_id: str, identity: str | None, events: list[dict[str, Any]]
) -> httpx.Response:
    return client(cluster, identity).post(f"/v1/nodes/{node_id}/audit", json={"events": events})


@contextlib.contextmanager
def as_node(cluster: c.Cluster) -> Iterator[tuple[str, str]]:
    """(node id, identity) of the cluster's node, held by the test while the node process is frozen."""
    record = cluster.node_record()
    assert record is not None
    cluster.node.signal(signal.SIGSTOP)
    try:
        node_id, identity = register(
            cluster, cluster.node.url, rpc_token=cluster.node.token, capacity=dict(record.capacity),
            templates=list(record.templates),
        )  # fmt: skip
        assert node_id == record.id  # idempotent by url
        yield node_id, identity
    finally:
        cluster.node.signal(signal.SIGCONT)
    # The node's next heartbeat is refused (401), it registers again: a new identity replaces the test's.
    c.wait_for(
        lambda: cluster.store.authenticate_node(node_id, identity) is None,
        timeout=15,
        what="the node registered again (the test's identity rotated away)",
    )
    before = cluster.node_record().last_heartbeat_at  # type: ignore[union-attr]
    c.wait_for(
        lambda: cluster.node_ready() and cluster.node_record().last_heartbeat_at > before,  # type: ignore[union-attr]
        timeout=15,
        what="heartbeats with the node's new identity",
    )
