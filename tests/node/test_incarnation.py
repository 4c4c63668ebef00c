"""Conditional node operations (docs/adr/0032-lost-nodes-and-incarnations.md): each copy on a node carries
the incarnation it was placed at; a delete naming another incarnation is refused (409 stale_incarnation) and
touches nothing; a restore racing a stale delete keeps the new copy; the map survives an agent restart.
Real node agent routes over the fake driver (no root)."""

from __future__ import annotations

import asyncio
import os
import pathlib
from collections.abc import Iterator

import httpx
import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.crypto.envelope import DataKey
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.incarnations import Incarnations
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from space.objectstore.backends import open_store
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop
from tests.support.node_capability import NodeAuth

loop = fake_agent.loop  # a fresh BackgroundLoop per test

TOKEN = "incarnation-test-node-token-0123"


class Node:
    def __init__(self, loop: BackgroundLoop, base: pathlib.Path, store_url: str) -> None:
        self.base = base
        self.agent = NodeAgent(FakeDriver(base), store=open_store(store_url))
        loop.run(self.agent.prepare(templates=()))
        self.app = create_app(self.agent, TOKEN)
        self.client = NodeClient("http://node", TOKEN, transport=httpx.ASGITransport(app=self.app))

    async def close(self) -> None:
        await self.agent.delete_all()
        await self.client.aclose()
        await self.agent.close()


@pytest.fixture
def store_url(tmp_path: pathlib.Path) -> str:
    return (tmp_path / "objects").as_uri()


@pytest.fixture
def nodes(loop: BackgroundLoop, tmp_path: pathlib.Path, store_url: str) -> Iterator[tuple[Node, Node]]:
    a, b = Node(loop, tmp_path / "a", store_url), Node(loop, tmp_path / "b", store_url)
    yield a, b
    for node in (a, b):
        loop.run(node.close())


def _stale(refusal: pytest.ExceptionInfo[errors.Conflict], held: int, named: int) -> None:
    details = refusal.value.details
    assert (details["reason"], details["incarnation"], details["named"]) == ("stale_incarnation", held, named)


def test_a_delete_naming_another_incarnation_is_refused_and_touches_nothing(
    loop: BackgroundLoop, nodes: tuple[Node, Node]
) -> None:
    a, _b = nodes
    sid = new_sandbox_id()

    async def scenario() -> None:
        await a.client.create_sandbox(sid, incarnation=3)
        await a.client.write_file(sid, "data.txt", b"kept")
        assert await a.client.get_incarnation(sid) == 3
        for stale in (0, 2, 4):
            with pytest.raises(errors.Conflict) as refused:
                await a.client.delete_sandbox(sid, incarnation=stale)
            _stale(refused, 3, stale)
        assert (await a.client.get_sandbox(sid)).state == "running"
        assert await a.client.read_file(sid, "data.txt") == b"kept"
        # Placing another incarnation over this copy is refused too: the stale one is deleted by name first.
        with pytest.raises(errors.Conflict) as refused:
            await a.client.place_incarnation(sid, 9)
        _stale(refused, 3, 9)
        with pytest.raises(errors.Conflict):
            await a.client.create_sandbox(sid, incarnation=9)
        # The right incarnation deletes it, and the node forgets it.
        assert (await a.client.delete_sandbox(sid, incarnation=3)).existed
        with pytest.raises(errors.NotFound):
            await a.client.get_incarnation(sid)
        # A repeated (now stale) delete of a copy that is gone converges, as before.
        assert not (await a.client.delete_sandbox(sid, incarnation=3)).existed

    loop.run(scenario())


def test_a_copy_without_an_incarnation_follows_the_old_rules(
    loop: BackgroundLoop, nodes: tuple[Node, Node]
) -> None:
    a, _b = nodes
    sid, other = new_sandbox_id(), new_sandbox_id()

    async def scenario() -> None:
        await a.client.create_sandbox(sid)  # an older control plane: no incarnation named
        assert await a.client.get_incarnation(sid) is None
        assert (await a.client.delete_sandbox(sid, incarnation=5)).existed  # matches any named one
        await a.client.create_sandbox(other, incarnation=2)
        assert (await a.client.delete_sandbox(other)).existed  # a delete naming none matches any copy

    loop.run(scenario())


def _key() -> DataKey:
    return DataKey(key_id="key-1", wrapped=b"wrapped-by-the-tenant-key", plaintext=os.urandom(32))


def test_a_restore_racing_a_stale_delete_keeps_the_new_copy(
    loop: BackgroundLoop, nodes: tuple[Node, Node], store_url: str
) -> None:
    """Node B holds an old copy (incarnation 1) of a sandbox that was suspended from A; the control plane
    restores it onto B at generation 7: the old copy is deleted by its own incarnation, 7 is announced, the
    restore runs, and the late delete of the old copy (a suspend's background free, an orphan sweep that
    read the record before the restore) arrives before, during and after: refused every time."""
    a, b = nodes
    sid, snap, key = new_sandbox_id(), new_snapshot_id(), _key()
    prefix = f"sandboxes/{sid}/{snap}"

    async def stale_delete() -> str:
        try:
            await b.client.delete_sandbox(sid, incarnation=1)
        except errors.Conflict as exc:
            return str(exc.details["reason"])
        return "deleted"

    async def scenario() -> None:
        await a.client.create_sandbox(sid, incarnation=4)
        await a.client.write_file(sid, "state.txt", b"from A")
        await a.client.suspend(sid, store_url=store_url, prefix=prefix, snapshot_id=snap, data_key=key)
        await b.client.create_sandbox(sid, incarnation=1)  # the stale copy on B
        # The control plane's restore onto B (reconciler/suspension.py _restore_on_node):
        assert await b.client.get_incarnation(sid) == 1
        assert (await b.client.delete_sandbox(sid, incarnation=1)).existed
        await b.client.place_incarnation(sid, 7)
        before = await stale_delete()
        restore = asyncio.create_task(
            b.client.restore(sid, store_url=store_url, prefix=prefix, data_key=key.plaintext)
        )
        during = await asyncio.gather(*(stale_delete() for _ in range(5)))
        await restore
        after = await stale_delete()
        assert [before, *during, after] == ["stale_incarnation"] * 7
        assert (await b.client.get_sandbox(sid)).state == "running"
        assert await b.client.get_incarnation(sid) == 7
        assert await b.client.read_file(sid, "state.txt") == b"from A"

    loop.run(scenario())


def test_incarnations_are_adopted_across_an_agent_restart(
    loop: BackgroundLoop, tmp_path: pathlib.Path, store_url: str
) -> None:
    first = Node(loop, tmp_path / "n", store_url)
    kept, announced = new_sandbox_id(), new_sandbox_id()
    loop.run(first.client.create_sandbox(kept, incarnation=5))
    loop.run(first.client.place_incarnation(announced, 6))  # a restore that never made its copy
    loop.run(first.client.stop(kept))
    loop.run(first.client.aclose())
    loop.run(first.agent.close())
    # The persisted map (0600, in the agent's own directory) is what a new agent starts from.
    path = FakeDriver(tmp_path / "n").state_file("incarnations.json")
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert Incarnations(path).get(kept) == 5

    second = Node(loop, tmp_path / "n", store_url)
    try:
        assert loop.run(second.agent.recover()) == [kept]
        assert loop.run(second.client.get_incarnation(kept)) == 5
        with pytest.raises(errors.NotFound):  # no copy was ever made: dropped when the agent adopted
            loop.run(second.client.get_incarnation(announced))
        with pytest.raises(errors.Conflict):
            loop.run(second.client.delete_sandbox(kept, incarnation=4))
        assert loop.run(second.client.delete_sandbox(kept, incarnation=5)).existed
    finally:
        loop.run(second.close())


def test_an_unreadable_incarnations_file_starts_empty(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "incarnations.json"
    for garbage in (b"{", b'{"incarnations": {"not-an-id": 1}}', b'{"incarnations": {"x": -1}}', b"[]"):
        path.write_bytes(garbage)
        assert Incarnations(path).get(new_sandbox_id()) is None


def test_incarnation_inputs_are_bounded(loop: BackgroundLoop, nodes: tuple[Node, Node]) -> None:
    a, _b = nodes
    sid = new_sandbox_id()
    loop.run(a.client.create_sandbox(sid, incarnation=1))
    http = httpx.Client(transport=_SyncAsgi(loop, a.app), base_url="http://node", auth=NodeAuth(TOKEN))
    try:
        for bad in ("-1", str(2**63), "1.5", "true", "x" * 5000, "%00"):
            answer = http.delete(f"/node/v1/sandboxes/{sid}", params={"incarnation": bad})
            assert (answer.status_code, answer.json()["error"]["code"]) == (422, "validation_error"), bad
        for body in ({"incarnation": -1}, {"incarnation": 2**63}, {"incarnation": "1"}, {"incarnation": True},
                     {}, {"incarnation": 1, "extra": 1}):  # fmt: skip
            answer = http.put(f"/node/v1/sandboxes/{sid}/incarnation", json=body)
            assert (answer.status_code, answer.json()["error"]["code"]) == (422, "validation_error"), body
        for path in ("/node/v1/sandboxes/..%2f/incarnation", "/node/v1/sandboxes/sb-%2e%2e/incarnation"):
            assert http.get(path).status_code in {400, 403, 404}
        assert loop.run(a.client.get_incarnation(sid)) == 1  # nothing above changed it
    finally:
        http.close()


class _SyncAsgi(httpx.BaseTransport):
    """A synchronous httpx transport into the ASGI app, run on the test's loop (raw requests)."""

    def __init__(self, loop: BackgroundLoop, app: object) -> None:
        self.loop = loop
        self.inner = httpx.ASGITransport(app=app)  # type: ignore[arg-type]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def go() -> httpx.Response:
            request.read()
            response = await self.inner.handle_async_request(request)
            content = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=content)

        return self.loop.run(go())
