"""Sandbox capabilities (space.core.capability) and their enforcement by the node RPC (fake driver, a real
uvicorn on 127.0.0.1): with the node token alone, or with a capability for sandbox X, nothing can be done
to sandbox Y; expired, tampered, duplicated and foreign-key capabilities are refused; every node route is
classified (a new unclassified route is refused, and fails this file)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.routing import APIRoute, APIWebSocketRoute
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from space.core import errors
from space.core.capability import CAPABILITY_HEADER, MAX_LIFETIME_S, mint, verify
from space.core.ids import new_sandbox_id, new_snapshot_id, parse_process_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.rpc_auth import capability_scope
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from tests.support.loop import BackgroundLoop

TOKEN = "capability-test-node-token-0123456789"
NOW = 1_800_000_000.0


# -- the pure module -----------------------------------------------------------------------------------------
def test_a_capability_grants_its_sandbox_until_it_expires() -> None:
    sandbox_id = new_sandbox_id()
    capability = mint(TOKEN, sandbox_id, now=NOW, ttl_s=60)
    assert verify(TOKEN, capability, sandbox_id=sandbox_id, now=NOW) == sandbox_id
    assert verify(TOKEN, capability, sandbox_id=sandbox_id, now=NOW + 59.9) == sandbox_id
    for later in (NOW + 60, NOW + 61, NOW + 10_000):
        with pytest.raises(errors.PermissionDenied, match="expired"):
            verify(TOKEN, capability, sandbox_id=sandbox_id, now=later)


def test_a_capability_grants_no_other_sandbox() -> None:
    mine, other = new_sandbox_id(), new_sandbox_id()
    capability = mint(TOKEN, mine, now=NOW)
    with pytest.raises(errors.PermissionDenied, match="another sandbox"):
        verify(TOKEN, capability, sandbox_id=other, now=NOW)
    # a route's raw text (not even ASCII) is compared safely, never raises anything but the refusal
    for text in ("sb-../x", "sb-\u00e9" * 10, "", mine.upper(), mine + "\n"):
        with pytest.raises(errors.PermissionDenied):
            verify(TOKEN, capability, sandbox_id=text, now=NOW)


def _tampered(capability: str) -> list[str]:
    sandbox_id, expiry, mac = capability.split(".")
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    other = new_sandbox_id()
    return [
        f"{sandbox_id}.{expiry}.{flipped}",  # one MAC digit
        f"{sandbox_id}.{int(expiry) + 100}.{mac}",  # a longer life
        f"{other}.{expiry}.{mac}",  # another sandbox, same MAC
        f"{sandbox_id}.{expiry}.{mac.upper()}",  # another spelling
        f"{sandbox_id}.{expiry}.{mac}.",
        f"{sandbox_id}.{expiry}",
        f"{sandbox_id}..{mac}",
        f" {capability}",
        f"{capability}\n",
        f"{sandbox_id}.0{expiry}.{mac}",
        capability * 2,
        "x" * 100_000,
        "",
    ]


def test_tampered_or_malformed_capabilities_are_refused() -> None:
    sandbox_id = new_sandbox_id()
    capability = mint(TOKEN, sandbox_id, now=NOW)
    for bad in _tampered(capability):
        with pytest.raises(errors.PermissionDenied):
            verify(TOKEN, bad, sandbox_id=bad.split(".")[0] if bad.count(".") >= 2 else sandbox_id, now=NOW)
    with pytest.raises(errors.PermissionDenied):
        verify(TOKEN, None, sandbox_id=sandbox_id, now=NOW)


def test_a_capability_of_another_node_key_is_refused() -> None:
    sandbox_id = new_sandbox_id()
    with pytest.raises(errors.PermissionDenied, match="does not verify"):
        verify(TOKEN, mint("another node's token", sandbox_id, now=NOW), sandbox_id=sandbox_id, now=NOW)


def test_lifetimes_are_bounded_on_both_sides() -> None:
    sandbox_id = new_sandbox_id()
    with pytest.raises(errors.InvalidArgument):
        mint(TOKEN, sandbox_id, now=NOW, ttl_s=MAX_LIFETIME_S + 1)
    with pytest.raises(errors.InvalidArgument):
        mint(TOKEN, sandbox_id, now=NOW, ttl_s=0)
    with pytest.raises(errors.InvalidArgument):
        mint(TOKEN, "sb-not-an-id", now=NOW)
    with pytest.raises(errors.InvalidArgument):
        mint("", sandbox_id, now=NOW)
    # one minted with the longest lifetime, checked by a node whose clock is behind: refused as too long
    capability = mint(TOKEN, sandbox_id, now=NOW, ttl_s=MAX_LIFETIME_S)
    with pytest.raises(errors.PermissionDenied, match="longer"):
        verify(TOKEN, capability, sandbox_id=sandbox_id, now=NOW - 10)


def test_process_ids_are_what_the_guest_makes_and_nothing_else() -> None:
    for _ in range(200):
        made = os.urandom(8).hex()  # as space.guest.processes makes them
        assert parse_process_id(made) == made
    for bad in ("", "nope", "p-1", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0",
                "0123456789abcde\n", "..", "%2e%2e", "0123456789abcd/f", "0123456789abc%2f", "\u0660" * 16,
                None, 12345):  # fmt: skip
        with pytest.raises(errors.InvalidArgument):
            parse_process_id(bad)


# -- the node enforces it ------------------------------------------------------------------------------------
@dataclass
class Node:
    loop: BackgroundLoop
    url: str
    client: NodeClient
    app: Any
    x: str  # two sandboxes on the node: the capability is always for X, the target is Y
    y: str

    def call(self, method: str, path: str, capability: str | list[str] | None, **kw: Any) -> httpx.Response:
        headers = [("Authorization", f"Bearer {TOKEN}")]
        for value in [capability] if isinstance(capability, str) else capability or []:
            headers.append((CAPABILITY_HEADER, value))
        with httpx.Client(verify=False, timeout=30) as http:  # plain HTTP: no TLS context to build
            return http.request(method, f"{self.url}/node/v1{path}", headers=headers, **kw)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    loop = BackgroundLoop()
    agent = NodeAgent(FakeDriver(tmp_path_factory.mktemp("node")))
    loop.run(agent.prepare())
    app = create_app(agent, TOKEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)

    async def make_client() -> NodeClient:
        return NodeClient(url, TOKEN)

    client = loop.run(make_client())
    x, y = new_sandbox_id(), new_sandbox_id()
    for sandbox_id in (x, y):
        loop.run(client.create_sandbox(sandbox_id))
        loop.run(client.write_file(sandbox_id, "owner.txt", sandbox_id.encode()))
    try:
        yield Node(loop, url, client, app, x, y)
    finally:
        loop.run(client.aclose())
        server.should_exit = True
        future.result(15)
        loop.run(agent.delete_all())
        loop.run(agent.close())
        loop.close()


def y_untouched(node: Node) -> None:
    observed = node.loop.run(node.client.get_sandbox(node.y))
    assert observed.state == "running", observed
    assert node.loop.run(node.client.read_file(node.y, "owner.txt")) == node.y.encode()
    names = {entry["name"] for entry in node.loop.run(node.client.list_files(node.y, "."))}
    assert names == {"owner.txt"}, names
    assert node.loop.run(node.client.list_snapshots(node.y)) == []
    assert [p for p in node.loop.run(node.client.list_processes(node.y)) if p.get("running")] == []


def _routes(app: Any) -> list[tuple[str, str]]:
    found = []
    pending = list(app.routes)
    while pending:
        route = pending.pop(0)
        included = getattr(route, "original_router", None)  # FastAPI >= 0.16x keeps included routers whole
        if included is not None:
            pending.extend(included.routes)
        elif isinstance(route, APIRoute):
            found.extend((method, route.path) for method in sorted(route.methods))
        elif isinstance(route, APIWebSocketRoute):
            found.append(("WEBSOCKET", route.path))
    return found


def test_every_node_route_is_classified(node: Node) -> None:
    routes = [(m, p) for m, p in _routes(node.app) if not p.endswith("/openapi.json")]
    assert len(routes) > 30, routes  # the node's routes were found (guards against scanning nothing)
    scopes = {f"{m} {p}": capability_scope("GET" if m == "WEBSOCKET" else m, p) for m, p in routes}
    unclassified = [route for route, scope in scopes.items() if scope == "unclassified"]
    assert unclassified == [], (
        f"node routes without a capability rule (add them to rpc_auth.py): {unclassified}"
    )
    node_level = sorted(route for route, scope in scopes.items() if scope == "node")
    assert node_level == [
        "DELETE /node/v1/templates/{name}", "GET /node/v1/info", "GET /node/v1/sandboxes",
        "GET /node/v1/templates", "POST /node/v1/templates/{name}/build",
    ]  # fmt: skip


# Minimal bodies that the routes would accept (so a refusal is the capability's, not a 422's).
BODIES: dict[str, Any] = {
    "PUT /node/v1/sandboxes/{sandbox_id}": {"template": "python"},
    "POST /node/v1/sandboxes/{sandbox_id}/snapshots": {"full": False},
    "POST /node/v1/sandboxes/{sandbox_id}/suspend": {"store_url": "file:///nowhere", "prefix": "p",
                                                     "snapshot_id": "{snap}"},
    "POST /node/v1/sandboxes/{sandbox_id}/snapshots/{snapshot_id}/upload": {"store_url": "file:///x",
                                                                             "prefix": "p"},
    "POST /node/v1/sandboxes/{sandbox_id}/recover": {},
    "POST /node/v1/sandboxes/{sandbox_id}/rollback": {"snapshot_id": "{snap}"},
    "POST /node/v1/sandboxes/{sandbox_id}/fork": {"count": 1},
    "PUT /node/v1/sandboxes/{sandbox_id}/egress": {"policy": {"allow": ["example.com"]}, "credentials": []},
    "POST /node/v1/sandboxes/{sandbox_id}/exec": {"cmd": "echo pwned > pwned.txt"},
    "POST /node/v1/sandboxes/{sandbox_id}/processes": {"cmd": "echo pwned > pwned.txt"},
    "POST /node/v1/sandboxes/{sandbox_id}/processes/{process_id}/signal": {"signal": "SIGKILL"},
    "POST /node/v1/sandboxes/{sandbox_id}/processes/{process_id}/resize": {"rows": 5, "cols": 5},
    "POST /node/v1/sandboxes/{sandbox_id}/files/mkdir": {"path": "pwned"},
    "POST /node/v1/sandboxes/{sandbox_id}/files/rename": {"src": "owner.txt", "dst": "pwned.txt"},
    "PUT /node/v1/sandboxes/{sandbox_id}/files/xattrs": {"path": "owner.txt", "attribute": "user.pwned",
                                                         "value_b64": "cHduZWQ="},
}  # fmt: skip


def _fill(text: str, node: Node, snapshot_id: str) -> str:
    return (
        text.replace("{sandbox_id}", node.y)
        .replace("{snapshot_id}", snapshot_id)
        .replace("{process_id}", "0123456789abcdef")
        .replace("{snap}", snapshot_id)
    )


def test_no_sandbox_route_answers_without_a_capability_for_its_sandbox(node: Node) -> None:
    snapshot_id = new_snapshot_id()
    now = time.time()
    good_for_x = mint(TOKEN, node.x, now=now)
    good_for_y = mint(TOKEN, node.y, now=now)
    refusals: dict[str, list[str | list[str] | None]] = {
        "none": [None],
        "for another sandbox": [good_for_x],
        "expired": [f"{node.y}.{int(now) - 1}.{mint(TOKEN, node.y, now=now - 61).split('.')[2]}",
                    mint(TOKEN, node.y, now=now - 61)],
        # (what HTTP carries: no whitespace or newline at the ends of a header value, no huge header)
        "tampered": [c for c in _tampered(good_for_y) if c == c.strip() and len(c) < 4096],
        "another key": [mint("not-the-node-token", node.y, now=now)],
        "two capabilities": [[good_for_y, good_for_x], [good_for_y, good_for_y]],
    }  # fmt: skip
    checked = 0
    for method, path in _routes(node.app):
        if capability_scope("GET" if method == "WEBSOCKET" else method, path) == "node":
            continue
        if path.endswith("/openapi.json"):
            continue
        if method == "WEBSOCKET":
            continue  # test_pty_needs_a_capability_too
        body = BODIES.get(f"{method} {path}")
        if path.endswith("/sandboxes/restore"):
            body = {"sandbox_id": node.y, "store_url": "file:///x", "prefix": "p"}
        kwargs: dict[str, Any] = {}
        if isinstance(body, dict):
            kwargs["json"] = {
                k: _fill(v, node, snapshot_id) if isinstance(v, str) else v for k, v in body.items()
            }
        elif method in {"POST", "PUT"}:
            kwargs["content"] = b"pwned"
        url = _fill(path.removeprefix("/node/v1"), node, snapshot_id) + "?path=owner.txt&eof=true"
        for why, capabilities in refusals.items():
            for capability in capabilities:
                answer = node.call(method, url, capability, **kwargs)
                assert answer.status_code == 403, (
                    f"{method} {path} with {why}: {answer.status_code} {answer.text}"
                )
                assert answer.json()["error"]["code"] == "permission_denied", answer.text
                checked += 1
    assert checked > 30 * 10
    y_untouched(node)


def test_a_capability_for_the_right_sandbox_works_and_only_there(node: Node) -> None:
    answer = node.call(
        "GET", f"/sandboxes/{node.y}/files?path=owner.txt", mint(TOKEN, node.y, now=time.time())
    )
    assert (answer.status_code, answer.content) == (200, node.y.encode())
    # the capability for X, sent to X's route, reads X's file: a path trick cannot turn it into Y's
    capability = mint(TOKEN, node.x, now=time.time())
    for trick in (f"/sandboxes/{node.x}/../{node.y}/files", f"/sandboxes/{node.x}/%2e%2e/{node.y}/files"):
        with httpx.Client() as raw:
            request = raw.build_request("GET", node.url)
            request.url = httpx.URL(node.url + "/node/v1" + trick + "?path=owner.txt")
            request.headers["Authorization"] = f"Bearer {TOKEN}"
            request.headers[CAPABILITY_HEADER] = capability
            answer = raw.send(request)
            assert answer.status_code in {403, 404}, (trick, answer.status_code, answer.text)
            assert node.y.encode() not in answer.content


def test_restore_needs_a_capability_for_the_sandbox_of_its_body(node: Node) -> None:
    target = new_sandbox_id()
    body = {"sandbox_id": target, "store_url": "file:///nowhere", "prefix": "p"}
    for capability in (None, mint(TOKEN, node.x, now=time.time()), mint(TOKEN, node.y, now=time.time())):
        answer = node.call("POST", "/sandboxes/restore", capability, json=body)
        assert answer.status_code == 403, answer.text
    # with the right one, the request reaches the route (which refuses the store: this node has none)
    answer = node.call("POST", "/sandboxes/restore", mint(TOKEN, target, now=time.time()), json=body)
    assert answer.status_code == 400 and answer.json()["error"]["details"]["field"] == "store_url", (
        answer.text
    )


def test_pty_needs_a_capability_too(node: Node) -> None:
    url = node.url.replace("http://", "ws://") + f"/node/v1/sandboxes/{node.y}/pty?cmd=/bin/sh"
    for capability in (None, mint(TOKEN, node.x, now=time.time())):
        headers = {"Authorization": f"Bearer {TOKEN}"}
        if capability:
            headers[CAPABILITY_HEADER] = capability
        with (
            pytest.raises(InvalidStatus) as refused,
            connect(url, additional_headers=headers, open_timeout=10) as ws,
        ):
            ws.recv(timeout=10)
        assert refused.value.response.status_code == 403

    # NodeClient signs its own PTY: it opens
    async def opened() -> bytes | str:
        async with node.client.pty(node.y, cmd="/bin/sh") as ws:
            return await asyncio.wait_for(ws.recv(), 10)

    assert "started" in str(node.loop.run(opened()))
    y_untouched(node)
