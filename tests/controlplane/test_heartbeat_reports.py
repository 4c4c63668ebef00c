"""What a heartbeat's sandbox list changes (api/node_routes.py): a copy the node holds `stopped` while its
record says running or paused had its runtime end while the agent was away (an agent restart adopts such
copies as stopped), so it is a crash the reconciler recovers; a copy stopped by a user's stop (`stopping`,
`stopped`) is not; a report assembled before the record's last change changes nothing."""

from __future__ import annotations

import pathlib
import secrets
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from space.controlplane.api import node_admin
from space.controlplane.api.app import create_app
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store, open_store
from space.core.lifecycle import Event, State

BOOTSTRAP = "b" * 40


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[tuple[Store, TestClient]]:
    store = open_store(sqlite_url(tmp_path / "cp"))
    app = create_app(store, node_token=BOOTSTRAP, run_reconciler=False, data_dir=tmp_path,
                     settings=ControlPlaneSettings.from_env({}))  # fmt: skip
    try:
        with TestClient(app) as client:
            yield store, client
    finally:
        store.close()


def _on_node(store: Store, project_id: str, node_id: str, *, then: tuple[Event, ...] = ()) -> str:
    sandbox = store.create_sandbox(project_id, "python")
    record = store.transition(sandbox.id, State.PENDING, 0, Event.CREATE, node_id=node_id)
    record = store.transition(sandbox.id, record.state, record.generation, Event.CREATED)
    for event in then:
        record = store.transition(sandbox.id, record.state, record.generation, event)
    return sandbox.id


def test_a_stopped_copy_of_a_running_or_paused_record_is_a_crash(world: tuple[Store, TestClient]) -> None:
    store, client = world
    body = {"url": f"http://127.0.0.1:1/{secrets.token_hex(6)}", "token": secrets.token_urlsafe(24),
            "capacity": {"cpus": 1, "memory_mb": 64}, "templates": []}  # fmt: skip
    enrolled = client.post("/v1/nodes/register", json=body, headers={"Authorization": f"Bearer {BOOTSTRAP}"})
    assert enrolled.status_code == 200, enrolled.text
    node_id, identity = enrolled.json()["node_id"], enrolled.json()["identity"]
    org = store.create_org("o")
    project = store.create_project(org.id, "p").id
    running = _on_node(store, project, node_id)
    paused = _on_node(store, project, node_id, then=(Event.PAUSE, Event.PAUSED))
    stopping = _on_node(store, project, node_id, then=(Event.STOP,))
    stopped = _on_node(store, project, node_id, then=(Event.STOP, Event.STOPPED))
    stale = _on_node(store, project, node_id)
    assembled_before = time.time() - 60  # a report older than `stale`'s record changes nothing

    def beat(sandbox_ids: list[str], at: float) -> None:
        sandboxes = [{"id": sandbox_id, "state": "stopped"} for sandbox_id in sandbox_ids]
        answer = client.post(f"/v1/nodes/{node_id}/heartbeat", json={"sandboxes": sandboxes, "time": at},
                             headers={"Authorization": f"Bearer {identity}"})  # fmt: skip
        assert answer.status_code == 200, answer.text

    beat([stale], assembled_before)
    beat([running, paused, stopping, stopped], time.time() + 1)
    states = {
        sandbox_id: store.load_sandbox(sandbox_id)
        for sandbox_id in (running, paused, stopping, stopped, stale)
    }
    assert {k: v.state for k, v in states.items() if v} == {
        running: State.CRASHED, paused: State.CRASHED, stopping: State.STOPPING, stopped: State.STOPPED,
        stale: State.RUNNING,
    }  # fmt: skip
    crashed = states[running]
    assert (
        crashed is not None
        and crashed.crash_count == 1
        and "while its agent was away" in (crashed.notice or "")
    )
    assert [event.kind for event in store.list_events(running)] == ["sandbox.crashed"]


@pytest.mark.parametrize(
    ("reported", "kept"),
    [
        ({"space_version": "1.2.3"}, "1.2.3"),
        ({"space_version": "1.0\n{forged"}, None),
        ({"space_version": "x" * 65}, None),
        ({"space_version": ["1.2.3"]}, None),
        ({}, None),  # an older agent reports none
    ],
)
def test_a_heartbeat_s_space_version_is_parsed_not_trusted(
    world: tuple[Store, TestClient], reported: dict[str, object], kept: str | None
) -> None:
    """ADR 0079: the release a node reports is kept beside its runtime descriptor only when it is a version
    token; a version smuggled inside the descriptor itself is dropped with the descriptor's unknown keys."""
    store, client = world
    body = {"url": f"http://127.0.0.1:1/{secrets.token_hex(6)}", "token": secrets.token_urlsafe(24),
            "capacity": {"cpus": 1, "memory_mb": 64}, "templates": []}  # fmt: skip
    enrolled = client.post("/v1/nodes/register", json=body, headers={"Authorization": f"Bearer {BOOTSTRAP}"})
    node_id, identity = enrolled.json()["node_id"], enrolled.json()["identity"]
    beat = {"sandboxes": [], "time": time.time(), "runtime": {"driver": "fake", "space_version": "smuggled"},
            **reported}  # fmt: skip
    answer = client.post(f"/v1/nodes/{node_id}/heartbeat", json=beat,
                         headers={"Authorization": f"Bearer {identity}"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    node = store.get_node(node_id)
    assert node is not None and node.runtime is not None and node.runtime.get("driver") == "fake"
    assert node.space_version == kept and "space_version" not in node.runtime
    assert node_admin.node_view(node, 0)["space_version"] == kept
