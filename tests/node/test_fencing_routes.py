"""The control plane's side of fencing and clean shutdown (ADR 0033), on an in-process control plane:

- every heartbeat answer grants the lease `fence_after_s` = node_lost_after_s - fence_grace_s and names the
  heartbeat (`beat`); a grace that leaves no lease is refused as a setting;
- `POST /v1/nodes/{id}/deregister` attacked: no identity, another node's identity, the bootstrap token, an
  unknown node id, malformed and encoded ids, a missing, wrong-typed or oversized `beat`, a replay of an
  earlier session's deregistration (409, the node stays as it is), a repeat (idempotent);
- an `offline` node is not revived by a late heartbeat, is never marked lost, is not offered to the
  scheduler, and becomes `ready` when it registers again.
"""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from space.controlplane.api.app import create_app
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store, open_store
from space.core import errors
from space.core.ids import new_node_id

BOOTSTRAP = "b" * 40
SETTINGS = ControlPlaneSettings.from_env({"SPACE_NODE_LOST_AFTER_S": "6", "SPACE_FENCE_GRACE_S": "2"})


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[tuple[Store, TestClient]]:
    store = open_store(sqlite_url(tmp_path / "cp"))
    app = create_app(store, node_token=BOOTSTRAP, run_reconciler=False, data_dir=tmp_path, settings=SETTINGS)
    try:
        with TestClient(app) as client:
            yield store, client
    finally:
        store.close()


def auth(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret is not None else {}


def enrol(client: TestClient) -> tuple[str, str]:
    body = {"url": f"http://127.0.0.1:1/{secrets.token_hex(6)}", "token": secrets.token_urlsafe(24),
            "capacity": {"cpus": 1, "memory_mb": 64}, "templates": []}  # fmt: skip
    answer = client.post("/v1/nodes/register", json=body, headers=auth(BOOTSTRAP))
    assert answer.status_code == 200, answer.text
    return answer.json()["node_id"], answer.json()["identity"]


def beat(client: TestClient, node_id: str, identity: str) -> dict[str, Any]:
    answer = client.post(f"/v1/nodes/{node_id}/heartbeat", json={"sandboxes": []}, headers=auth(identity))
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def deregister(client: TestClient, node_id: str, secret: str | None, body: Any) -> httpx.Response:
    answer: httpx.Response = client.post(f"/v1/nodes/{node_id}/deregister", json=body, headers=auth(secret))
    return answer


def code(answer: httpx.Response, status: int, error_code: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == error_code, answer.text


def test_heartbeats_grant_the_lease_and_name_themselves(world: tuple[Store, TestClient]) -> None:
    store, client = world
    node_id, identity = enrol(client)
    first = beat(client, node_id, identity)
    assert first["fence_after_s"] == pytest.approx(4.0) == SETTINGS.fence_after_s
    second = beat(client, node_id, identity)
    assert second["beat"] != first["beat"]
    record = store.get_node(node_id)
    assert record is not None and second["beat"] == record.last_heartbeat_at.isoformat()


@pytest.mark.parametrize(("lost", "grace"), [(5.0, 5.0), (5.0, 9.0)])
def test_a_grace_that_leaves_no_lease_is_refused(lost: float, grace: float) -> None:
    environ = {"SPACE_NODE_LOST_AFTER_S": str(lost), "SPACE_FENCE_GRACE_S": str(grace)}
    with pytest.raises(errors.InvalidArgument, match="SPACE_FENCE_GRACE_S"):
        ControlPlaneSettings.from_env(environ)


def test_deregistration_attacked(world: tuple[Store, TestClient]) -> None:
    store, client = world
    victim, victim_identity = enrol(client)
    other, other_identity = enrol(client)
    good = {"beat": beat(client, victim, victim_identity)["beat"]}
    code(deregister(client, victim, None, good), 401, "unauthenticated")
    code(deregister(client, victim, other_identity, good), 401, "unauthenticated")  # another node's
    code(deregister(client, victim, BOOTSTRAP, good), 401, "unauthenticated")  # the bootstrap token
    code(deregister(client, new_node_id(), victim_identity, good), 401, "unauthenticated")  # unknown id
    for bad_id in ("node-..%2F..%2Fx", "NODE-" + "A" * 26, "x" * 5000, "%00"):
        answer = deregister(client, bad_id, victim_identity, good)
        assert answer.status_code in (400, 404), (bad_id, answer.text)
    for bad in ({}, {"beat": 12}, {"beat": ""}, {"beat": "x" * 65}, {"beat": None}, [good], "beat"):
        code(deregister(client, victim, victim_identity, bad), 400, "invalid_argument")
    code(deregister(client, victim, victim_identity, {"beat": "2020-01-01T00:00:00+00:00"}), 409, "conflict")
    # The other node's own beat is no use for the victim either.
    code(deregister(client, victim, victim_identity, {"beat": beat(client, other, other_identity)["beat"]}),
         409, "conflict")  # fmt: skip
    assert {n.id: n.status for n in store.list_nodes(None)} == {victim: "ready", other: "ready"}
    # A heartbeat after `good` was answered: `good` names an earlier heartbeat now.
    latest = {"beat": beat(client, victim, victim_identity)["beat"]}
    code(deregister(client, victim, victim_identity, good), 409, "conflict")
    answer = deregister(client, victim, victim_identity, latest)
    assert answer.status_code == 200 and answer.json() == {"node_id": victim, "status": "offline"}
    assert deregister(client, victim, victim_identity, latest).json()["status"] == "offline"  # a repeat
    assert {n.id: n.status for n in store.list_nodes(None)} == {victim: "offline", other: "ready"}


def test_an_offline_node_waits_and_comes_back_on_registration(world: tuple[Store, TestClient]) -> None:
    store, client = world
    node_id, identity = enrol(client)
    session = {"beat": beat(client, node_id, identity)["beat"]}
    assert deregister(client, node_id, identity, session).status_code == 200
    beat(client, node_id, identity)  # a heartbeat that was in flight: it revives nothing
    record = store.get_node(node_id)
    assert record is not None and record.status == "offline"
    assert store.mark_lost(0.0) == []  # never marked lost: its sandboxes are not recovered elsewhere
    assert [n.id for n in store.list_nodes()] == []  # not offered to the scheduler
    body = {"url": record.url, "token": secrets.token_urlsafe(24), "capacity": {"cpus": 1, "memory_mb": 64}}
    again = client.post(f"/v1/nodes/{node_id}/register", headers=auth(identity), json=body)
    assert again.status_code == 200, again.text
    assert [n.id for n in store.list_nodes()] == [node_id]
    # The earlier session's deregistration, replayed, does not take the node down again.
    code(deregister(client, node_id, identity, session), 409, "conflict")
    assert [n.id for n in store.list_nodes()] == [node_id]
