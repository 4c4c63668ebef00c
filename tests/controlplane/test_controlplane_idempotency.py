"""Idempotency-Key on mutating routes (docs/api.md): the same key with the same body, replayed, also
concurrently, performs the work once and returns the same status and body; with another body it is a 409."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project

CREATE = {"template": "python", "limits": c.SMALL, "env": {"WHO": "idem"}}


def answer_of(response: httpx.Response) -> tuple[int, Any]:
    return response.status_code, response.json()


def test_a_replayed_create_answers_the_same_and_creates_once(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    first = answer_of(client.post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "create-1"}))
    assert first[0] == 201, first
    assert first[1]["state"] == "running"
    for _ in range(3):
        again = answer_of(client.post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "create-1"}))
        assert again == first
    assert list(fake_cluster.records(project.id)) == [first[1]["id"]]
    assert first[1]["id"] in fake_cluster.node.sandboxes()
    # Another key is another request.
    other = client.post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "create-2"})
    assert other.status_code == 201 and other.json()["id"] != first[1]["id"]
    assert len(fake_cluster.records(project.id)) == 2


def test_concurrent_requests_with_one_key_create_one_sandbox(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    start = threading.Barrier(8)

    def send(_i: int) -> tuple[int, Any]:
        start.wait(10)
        return answer_of(client.post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "together"}))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    assert answers[0][0] == 201, answers[0]
    assert all(a == answers[0] for a in answers), answers
    records = fake_cluster.records(project.id)
    assert list(records) == [answers[0][1]["id"]]
    assert fake_cluster.node.guest_processes().get(answers[0][1]["id"]) == 1
    fake_cluster.wait_converged(10, project.id)


def test_the_same_key_with_another_body_is_a_conflict(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    first = client.post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "k"})
    assert first.status_code == 201
    other = client.post(
        "/v1/sandboxes", json={**CREATE, "env": {"WHO": "else"}}, headers={"Idempotency-Key": "k"}
    )
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "conflict"
    assert len(fake_cluster.records(project.id)) == 1
    # A key belongs to its API key: another key may use the same string for its own request.
    _id, second_key = project.new_key("member")
    mine = fake_cluster.http(second_key).post("/v1/sandboxes", json=CREATE, headers={"Idempotency-Key": "k"})
    assert mine.status_code == 201 and mine.json()["id"] != first.json()["id"]


def test_a_replayed_action_does_not_act_again(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    sb = client.post("/v1/sandboxes", json=CREATE).json()
    path = f"/v1/sandboxes/{sb['id']}"
    paused = answer_of(client.post(f"{path}/pause", headers={"Idempotency-Key": "pause-once"}))
    assert paused[0] == 200 and paused[1]["state"] == "paused", paused
    assert client.post(f"{path}/resume").json()["state"] == "running"
    # The replay answers what the first request answered; it does not pause the sandbox a second time.
    assert answer_of(client.post(f"{path}/pause", headers={"Idempotency-Key": "pause-once"})) == paused
    assert client.get(path).json()["state"] == "running"
    assert fake_cluster.node.sandboxes()[sb["id"]]["state"] == "running"


def test_concurrent_actions_with_one_key_answer_alike(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    sb = client.post("/v1/sandboxes", json=CREATE).json()
    start = threading.Barrier(4)

    def send(_i: int) -> tuple[int, Any]:
        start.wait(10)
        return answer_of(client.post(f"/v1/sandboxes/{sb['id']}/stop", headers={"Idempotency-Key": "stop"}))

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    assert answers[0][0] == 200 and answers[0][1]["state"] == "stopped", answers[0]
    assert all(a == answers[0] for a in answers), answers


def test_a_replayed_delete_answers_the_same(fake_cluster: c.Cluster, project: c.Project) -> None:
    """A client that lost the answer of its DELETE (timeout, connection reset) retries with the same key —
    the SDK does so by itself — and must get the first answer, not a 404 for the sandbox it just deleted."""
    client = project.http()
    sb = client.post("/v1/sandboxes", json=CREATE).json()
    first = answer_of(client.delete(f"/v1/sandboxes/{sb['id']}", headers={"Idempotency-Key": "del"}))
    assert first[0] == 202 and first[1]["desired_state"] == "deleted", first
    again = answer_of(client.delete(f"/v1/sandboxes/{sb['id']}", headers={"Idempotency-Key": "del"}))
    assert again == first


def test_a_replayed_fork_forks_once(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    sb = client.post("/v1/sandboxes", json=CREATE).json()
    first = answer_of(
        client.post(f"/v1/sandboxes/{sb['id']}/fork", json={}, headers={"Idempotency-Key": "f"})
    )
    assert first[0] == 201, first
    again = answer_of(
        client.post(f"/v1/sandboxes/{sb['id']}/fork", json={}, headers={"Idempotency-Key": "f"})
    )
    assert again == first
    assert len(fake_cluster.records(project.id)) == 2
