"""Acting as a node of a fake cluster towards the control plane (ADR 0019, 0021: per-node identities).

A node keeps its identity in its data directory (0600), so a test that needs the identity of the cluster's
node reads it from there (`as_node`): the node keeps using it meanwhile, as it does across restarts. Extra
nodes are enrolled through the API with the cluster's bootstrap token (`register`), each with a url of its
own: a url that a node holds cannot be enrolled again.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import httpx

from tests.support import cluster as c


def enrol(
    cluster: c.Cluster, url: str, *, rpc_token: str | None = None, capacity: dict[str, Any] | None = None,
    templates: list[str] | None = None, bootstrap: str | None = None,
) -> httpx.Response:  # fmt: skip
    """The answer to enrolling `url` through the API (default: with the cluster's bootstrap token)."""
    return cluster.http(bootstrap or cluster.node.token).post(
        "/v1/nodes/register",
        json={"url": url, "token": rpc_token or secrets.token_urlsafe(24),
              "capacity": capacity or {"cpus": 1, "memory_mb": 64}, "templates": templates or []},
    )  # fmt: skip


def register(
    cluster: c.Cluster, url: str, *, rpc_token: str | None = None, capacity: dict[str, Any] | None = None,
    templates: list[str] | None = None, bootstrap: str | None = None,
) -> tuple[str, str]:  # fmt: skip
    """(node id, identity) of enrolling a NEW `url` through the API."""
    answer = enrol(
        cluster, url, rpc_token=rpc_token, capacity=capacity, templates=templates, bootstrap=bootstrap
    )
    assert answer.status_code in (200, 201), answer.text
    body = answer.json()
    assert isinstance(body.get("identity"), str) and len(body["identity"]) >= 32, sorted(body)
    return str(body["node_id"]), str(body["identity"])


def reregister(
    cluster: c.Cluster, node_id: str, credential: str | None, url: str, *, rpc_token: str | None = None
) -> httpx.Response:
    """A node's re-registration (`credential`: what it presents, normally its identity)."""
    return client(cluster, credential).post(
        f"/v1/nodes/{node_id}/register",
        json={"url": url, "token": rpc_token or secrets.token_urlsafe(24),
              "capacity": {"cpus": 1, "memory_mb": 64}, "templates": []},
    )  # fmt: skip


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
    """(node id, identity) of the cluster's node, as the node persisted them at its enrolment."""
    record = cluster.node_record()
    assert record is not None
    node_id, identity = cluster.node.identity
    assert node_id == record.id
    yield node_id, identity
