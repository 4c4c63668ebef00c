"""The direct create path (docs/adr/0046-direct-create-path.md): POST /v1/sandboxes drives the node itself,
with the sandbox's work lease held, instead of waiting for a reconciler pass; the reconciler finishes what
it leaves undone. The real API app over a SQLite store and in-memory nodes (tests/support/reconciler_world),
with the reconciler's loop NOT running unless a test runs a pass itself."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from space.controlplane.api.app import create_app
from space.controlplane.reconciler.plan import backoff
from space.controlplane.settings import ControlPlaneSettings
from space.core import errors
from space.core.lifecycle import State
from tests.support.reconciler_world import FakeNodeApi, Killed, World


class PoolNode(FakeNodeApi):
    """An in-memory node that says how it made each sandbox (SandboxObserved.created_from), and can die
    (`Killed`) as the control plane is about to call it."""

    made_from: str | None = "pool"
    die_before_create = False

    async def create_sandbox(self, sandbox_id: str, **kw: Any) -> Any:
        if self.die_before_create:
            self.die_before_create = False
            raise Killed("create_sandbox")
        observed, made = await super().create_sandbox(sandbox_id, **kw)
        return observed.model_copy(update={"created_from": self.made_from}), made


@pytest.fixture
def world(tmp_path: pathlib.Path) -> Iterator[World]:
    made = World(tmp_path)
    made.use_nodes(PoolNode)
    yield made
    made.close()


def api(world: World) -> tuple[httpx.AsyncClient, Any]:
    """An API client on the real app whose services use the world's store, nodes and reconciler."""
    settings = ControlPlaneSettings(wait_timeout_s=30)
    app = create_app(world.store, node_token="n" * 32, run_reconciler=False, settings=settings)
    services = app.state.services
    services.nodes, services.reconciler = world.pool, world.reconciler
    _key, secret = world.store.create_api_key(world.project, world.org_id, "member")
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://cp.test",
        headers={"Authorization": f"Bearer {secret}"},
    )
    return client, services


def nodes(world: World) -> dict[str, PoolNode]:
    return {node_id: node for node_id, node in world.api.items() if isinstance(node, PoolNode)}


def test_a_create_is_answered_by_the_request_itself_without_a_reconciler_pass(world: World) -> None:
    async def go() -> dict[str, Any]:
        client, services = api(world)
        async with client:
            answer = await client.post("/v1/sandboxes", json={"template": "python"})
            assert services.reconciler._task is None  # no loop ran: the request did the work
            assert answer.status_code == 201, answer.text
            await services.reconciler.stop()  # the lease is given back after the answer; a stop waits for it
            return dict(answer.json())

    body = asyncio.run(go())
    assert (body["state"], body["desired_state"], body["created_from"]) == ("running", "running", "pool")
    record = world.store.load_sandbox(body["id"])
    assert record is not None and record.state == State.RUNNING and record.node_id == body["node_id"]
    # The node and the incarnation were written with the `create` swap (generation 1), before the node call.
    assert (record.generation, record.incarnation, record.created_from) == (2, 1, "pool")
    assert record.lease_owner is None and record.lease_until is None  # the request gave the lease back
    assert world.copies(body["id"]) == {body["node_id"]: "running"}
    assert [n.calls.count("create_sandbox") for n in nodes(world).values()].count(1) == 1
    assert world.store.list_events(body["id"]) == []  # a pooled sandbox: nothing to explain


@pytest.mark.parametrize("made_from", ["warm", "cold"])
def test_a_create_without_a_pooled_sandbox_records_how_and_says_the_pool_was_empty(
    world: World, made_from: str
) -> None:
    for node in nodes(world).values():
        node.made_from = made_from

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        client, _services = api(world)
        async with client:
            created = (await client.post("/v1/sandboxes", json={"template": "python"})).json()
            shown = (await client.get(f"/v1/sandboxes/{created['id']}")).json()
            return created, shown

    created, shown = asyncio.run(go())
    assert created["created_from"] == shown["created_from"] == made_from
    (event,) = world.store.list_events(created["id"])
    assert event.kind == "pool.empty" and "no pooled sandbox of template 'python'" in event.message
    assert event.detail == {"template": "python", "node_id": created["node_id"], "created_from": made_from}


def test_a_node_that_does_not_say_leaves_created_from_empty(world: World) -> None:
    for node in nodes(world).values():
        node.made_from = None

    async def go() -> dict[str, Any]:
        client, _services = api(world)
        async with client:
            return dict((await client.post("/v1/sandboxes", json={"template": "python"})).json())

    body = asyncio.run(go())
    assert body["state"] == "running" and body["created_from"] is None
    assert world.store.list_events(body["id"]) == []


def test_a_failed_node_call_is_left_to_the_reconciler_which_converges(world: World) -> None:
    for node in nodes(world).values():
        node.fail["create_sandbox"] = errors.Unavailable("node busy")

    async def go() -> tuple[int, dict[str, Any], Any]:
        client, _services = api(world)
        async with client:
            started = world.store.now()
            request = asyncio.create_task(client.post("/v1/sandboxes", json={"template": "python"}))
            failed = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the request's own attempt fails: recorded, lease given back
                await asyncio.sleep(0.01)
                rows = world.store.list_sandboxes(world.project)
                if rows and rows[0].attempts == 1 and rows[0].lease_owner is None:
                    failed = rows[0]
                    break
            assert failed is not None, "the direct attempt's failure was never recorded"
            assert not request.done()  # the request waits for the reconciler now
            assert failed.state == State.CREATING and failed.node_id is not None and failed.incarnation == 1
            assert failed.error is not None and "node busy" in failed.error
            # Back-off, as for any step: counted from the failure, which came after `started` (not compared
            # with the clock now: on a loaded machine the 0.5 s of a first back-off may be over already).
            assert failed.next_attempt_at >= started + timedelta(seconds=backoff(0))  # the shortest one
            world.store.update_observed(failed.id, next_attempt_at=world.store.now())  # its back-off passed
            assert await world.reconciler.run_once() == 1  # one pass of the loop finishes the create
            answer = await asyncio.wait_for(request, 30)
            return answer.status_code, dict(answer.json()), failed

    status, body, failed = asyncio.run(go())
    assert status == 201 and body["state"] == "running" and body["id"] == failed.id
    assert body["node_id"] == failed.node_id  # the same node and incarnation, asked again
    assert world.copies(failed.id) == {failed.node_id: "running"}


def test_a_request_that_dies_before_the_node_call_is_finished_by_the_reconciler(world: World) -> None:
    for node in nodes(world).values():
        node.die_before_create = True

    async def go() -> None:
        client, _services = api(world)
        async with client:
            with pytest.raises(Killed):
                await client.post("/v1/sandboxes", json={"template": "python"})

    asyncio.run(go())
    (row,) = world.store.list_sandboxes(world.project)
    # What the dead request recorded: the step in progress, its node and incarnation; nothing on any node.
    assert row.state == State.CREATING and row.node_id is not None and row.incarnation == row.generation
    assert world.copies(row.id) == {}
    # A killed process keeps its lease until it expires, or its host's next start frees it (clear_leases).
    world.store.clear_leases(world.reconciler.owner)
    assert asyncio.run(world.reconciler.run_once()) == 1
    after = world.store.load_sandbox(row.id)
    assert after is not None and after.state == State.RUNNING and after.node_id == row.node_id
    assert after.created_from == "pool" and world.copies(row.id) == {row.node_id: "running"}


def test_the_direct_path_never_drives_a_sandbox_whose_lease_another_owner_holds(world: World) -> None:
    """Another replica's reconciler (or request) is on it: driving it too would run the same step twice."""
    sb = world.store.create_sandbox(world.project, "python")
    assert world.store.hold(sb.id, "other-replica:1:1", 60)
    assert asyncio.run(world.reconciler.drive(sb)) is None
    assert [n.calls for n in nodes(world).values()] == [[], []]
    after = world.store.load_sandbox(sb.id)
    assert after is not None and after.state == State.PENDING and after.lease_owner == "other-replica:1:1"
    assert world.store.release(sb.id, "other-replica:1:1")

    async def drive() -> Any:
        done = await world.reconciler.drive(sb)  # free again: driven to the end
        await world.reconciler.stop()  # ...and its lease given back (just after the answer)
        return done

    done = asyncio.run(drive())
    assert done is not None and done.state == State.RUNNING
    stored = world.store.load_sandbox(sb.id)
    assert stored is not None and stored.state == State.RUNNING and stored.lease_owner is None


def test_the_loop_leaves_a_sandbox_to_the_request_of_its_own_process_that_drives_it(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop and the requests of one process share a lease owner: a claim that lands between a request's
    row and its hold must not make the loop work on the sandbox too (nor give the lease back under it)."""
    sb = world.store.create_sandbox(world.project, "python")
    hold = world.store.hold

    def slow_hold(*args: Any) -> bool:
        time.sleep(0.3)  # the loop's claim lands first
        return hold(*args)

    monkeypatch.setattr(world.store, "hold", slow_hold)

    async def go() -> tuple[int, Any]:
        driving = asyncio.create_task(world.reconciler.drive(sb))
        await asyncio.sleep(0)  # the request has begun: its hold is under way
        claimed = await world.reconciler.run_once()
        done = await driving
        await world.reconciler.stop()
        return claimed, done

    claimed, done = asyncio.run(go())
    assert claimed == 0  # claimed by the same owner, but left to the request
    assert done is not None and done.state == State.RUNNING
    assert sum(n.calls.count("create_sandbox") for n in nodes(world).values()) == 1
    stored = world.store.load_sandbox(sb.id)
    assert stored is not None and stored.lease_owner is None


def test_a_created_sandbox_is_ready_for_its_first_exec_without_a_database_round_trip(world: World) -> None:
    """The record the create wrote is the gateway's cached running sandbox, and its creation counts as its
    last activity: the first data-plane call neither reads nor writes the database for it. A delete drops
    the cached record at once."""
    from space.controlplane.api import deps

    async def go() -> None:
        client, services = api(world)
        async with client:
            body = (await client.post("/v1/sandboxes", json={"template": "python"})).json()
            await services.reconciler.stop()
            reads, writes = [], []
            world.store.get_sandbox = lambda *a, **k: reads.append(a)  # type: ignore[method-assign]
            world.store.record_activity = lambda *a, **k: writes.append(a)  # type: ignore[method-assign]
            who = next(iter(services.keys.values()))[0]
            principal = deps.Principal(key=who, project_id=world.project)
            found = await deps.running_sandbox(services, principal, body["id"])
            await deps._note_activity(services, body["id"])
            assert found.id == body["id"] and found.node_id == body["node_id"]
            assert (reads, writes) == ([], [])
            del world.store.get_sandbox, world.store.record_activity
            assert (await client.delete(f"/v1/sandboxes/{body['id']}?wait=false")).status_code == 202
            assert (world.project, body["id"]) not in services.running

    asyncio.run(go())
