"""Sandbox events (store/events.py): append-only, ordered, bounded, kinds validated; and the snapshot
scheduler's listing of sandboxes with a policy."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from space.controlplane.store import Store, open_store, sqlite_url
from space.controlplane.store.events import LIST_LIMIT, MESSAGE_LENGTH
from space.core.errors import InvalidArgument
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    with open_store(sqlite_url(tmp_path)) as opened:
        yield opened


def _sandbox(store: Store) -> str:
    org = store.create_org("o")
    project = store.create_project(org.id, "p")
    return store.create_sandbox(project.id, "python", {}, SandboxLimits()).id


def test_events_read_back_in_order_and_after_a_cursor(store: Store) -> None:
    sandbox_id = _sandbox(store)
    first = store.record_event(sandbox_id, "node.lost", "node n1 was lost", {"node_id": "n1"})
    second = store.record_event(sandbox_id, "sandbox.recovered", "from snap-1")
    assert [e.kind for e in store.list_events(sandbox_id)] == ["node.lost", "sandbox.recovered"]
    assert store.list_events(sandbox_id)[0].detail == {"node_id": "n1"}
    assert [e.id for e in store.list_events(sandbox_id, after=first.id)] == [second.id]
    assert [e.id for e in store.list_events(sandbox_id, kind="node.lost")] == [first.id]
    assert store.list_events("sb-unknown") == []


@pytest.mark.parametrize("kind", ["", "Node.Lost", "node..lost", "x" * 33, "node lost", "1abc", "a/b"])
def test_malformed_kinds_are_refused(store: Store, kind: str) -> None:
    sandbox_id = _sandbox(store)
    with pytest.raises(InvalidArgument):
        store.record_event(sandbox_id, kind, "m")
    with pytest.raises(InvalidArgument):
        store.list_events(sandbox_id, kind=kind)


def test_messages_are_bounded_and_limits_checked(store: Store) -> None:
    sandbox_id = _sandbox(store)
    event = store.record_event(sandbox_id, "step.replanned", "x" * (MESSAGE_LENGTH * 3))
    assert len(event.message) == MESSAGE_LENGTH
    assert store.record_event(sandbox_id, "step.replanned", "").message == "step.replanned"
    for limit in (0, LIST_LIMIT + 1):
        with pytest.raises(InvalidArgument):
            store.list_events(sandbox_id, limit=limit)


def test_only_sandboxes_with_a_policy_are_listed_for_the_snapshot_scheduler(store: Store) -> None:
    org = store.create_org("policies")
    project = store.create_project(org.id, "p")
    with_policy = store.create_sandbox(project.id, "python", snapshot_policy={"every_s": 60, "keep": 2})
    without = store.create_sandbox(project.id, "python")
    for sandbox in (with_policy, without):
        store.transition(sandbox.id, State.PENDING, 0, Event.CREATE)
        store.transition(sandbox.id, State.CREATING, 1, Event.CREATED)
    # A row written before "no policy" was SQL NULL holds the JSON document null: not a policy either.
    with store.engine.begin() as connection:
        connection.execute(sa.text("UPDATE sandboxes SET snapshot_policy = 'null' WHERE id = :id"),
                           {"id": without.id})  # fmt: skip
    assert [sb.id for sb in store.list_sandboxes_with_policy()] == [with_policy.id]
