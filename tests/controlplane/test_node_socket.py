"""The node RPC's unix socket and the control plane's pools over it (ADR 0044), on a node agent over the
fake driver served by a real uvicorn (no root but for the file-mode attack): a node the operator gave a
socket is reached through it, any other over TCP; a restarted node is reconnected on both; the socket
still asks for the node token and a capability for the very sandbox; only its owner (and root) connect."""

from __future__ import annotations

import asyncio
import os
import pathlib
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.controlplane.node_pools import PoolSettings, parse_sockets, traffic_owner
from space.controlplane.nodes import NodePool
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.core import errors
from space.core.capability import CAPABILITY_HEADER, mint
from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.rpc_listen import MAX_SOCKET_PATH, close_listeners, open_listeners, unix_listener
from tests.support import fake_agent
from tests.support.hop import CLUSTER_TOKEN, Served, closed_port_url, enrol, tcp_listener
from tests.support.loop import BackgroundLoop

TOKEN = "hop-node-token-0123456789"
loop = fake_agent.loop  # a fresh BackgroundLoop per test
agent = fake_agent.agent  # a NodeAgent over the fake driver


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    url = sqlite_url(tmp_path)
    migrate(url)
    made = Store(url)
    yield made
    made.close()


@pytest.fixture
def sock_dir() -> Iterator[pathlib.Path]:
    # Short, unlike pytest's tmp_path: a socket address holds 107 bytes.
    made = pathlib.Path(tempfile.mkdtemp(prefix="space-hop-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _info(loop: BackgroundLoop, pool: NodePool, node_id: str) -> str:
    async def call() -> str:
        return (await pool.client(node_id).info()).driver

    return loop.run(call(), timeout=30)


def _exec_true(loop: BackgroundLoop, pool: NodePool, node_id: str, sandbox_id: str) -> int:
    async def call() -> int:
        traffic_owner.set("key-hop")  # a tenant's data-plane call: the data pool
        return (await pool.client(node_id).exec(sandbox_id, ["true"])).exit_code

    return loop.run(call(), timeout=30)


def test_a_node_with_a_socket_is_reached_through_it_and_any_other_over_tcp(
    loop: BackgroundLoop, agent: NodeAgent, store: Store, sock_dir: pathlib.Path
) -> None:
    path = sock_dir / "rpc.sock"
    tcp, tcp_url = tcp_listener()
    served = Served(loop, create_app(agent, TOKEN), [unix_listener(path), tcp])
    on_socket_url = closed_port_url()  # nothing listens at the URL this node registered
    on_socket, on_tcp = enrol(store, on_socket_url, TOKEN), enrol(store, tcp_url, TOKEN)
    configured = NodePool(store, CLUSTER_TOKEN, pools=PoolSettings(sockets=f"{on_socket_url}/={path}"))
    plain = NodePool(store, CLUSTER_TOKEN, pools=PoolSettings())
    try:
        assert _info(loop, configured, on_socket)  # only the socket can have answered
        with pytest.raises(errors.Unavailable):
            _info(loop, plain, on_socket)  # without the setting: TCP, where nothing listens
        assert _info(loop, plain, on_tcp) and _info(loop, configured, on_tcp)  # TCP still works
    finally:
        loop.run(configured.aclose())
        loop.run(plain.aclose())
        served.stop()


@pytest.mark.parametrize("over", ["socket", "tcp"])
def test_a_restarted_node_is_reconnected(
    loop: BackgroundLoop, agent: NodeAgent, store: Store, sock_dir: pathlib.Path, over: str
) -> None:
    path = sock_dir / "rpc.sock"
    tcp, tcp_url = tcp_listener()
    port = int(tcp_url.rsplit(":", 1)[1])

    def listeners() -> list[socket.socket]:
        return [unix_listener(path)] if over == "socket" else open_listeners("127.0.0.1", port, None)

    tcp.close()
    served = Served(loop, create_app(agent, TOKEN), listeners())
    node_id = enrol(store, tcp_url if over == "tcp" else closed_port_url(), TOKEN)
    url = store.node_endpoint(node_id)[0]  # type: ignore[index]
    pool = NodePool(
        store, CLUSTER_TOKEN, pools=PoolSettings(sockets=f"{url}={path}" if over == "socket" else "")
    )
    sandbox_id = new_sandbox_id()
    try:
        loop.run(pool.client(node_id).create_sandbox(sandbox_id))
        assert [_exec_true(loop, pool, node_id, sandbox_id) for _ in range(3)] == [0, 0, 0]
        served.stop()  # the agent restarts: every pooled connection is gone
        with pytest.raises(errors.Unavailable):
            _exec_true(loop, pool, node_id, sandbox_id)
        served = Served(loop, create_app(agent, TOKEN), listeners())
        # At once (well inside the pool's keep-alive expiry): the pool notices and connects again.
        assert [_exec_true(loop, pool, node_id, sandbox_id) for _ in range(3)] == [0, 0, 0]
        assert _info(loop, pool, node_id)  # the control pool too
    finally:
        loop.run(pool.aclose())
        served.stop()


def test_the_socket_asks_for_the_token_and_the_very_sandboxs_capability(
    loop: BackgroundLoop, agent: NodeAgent, sock_dir: pathlib.Path
) -> None:
    path = sock_dir / "rpc.sock"
    served = Served(loop, create_app(agent, TOKEN), [unix_listener(path)])
    mine, theirs = new_sandbox_id(), new_sandbox_id()
    transport = httpx.HTTPTransport(uds=str(path))
    try:
        with httpx.Client(transport=transport, base_url="http://node/node/v1", timeout=30) as http:
            token = {"Authorization": f"Bearer {TOKEN}"}
            for sandbox_id in (mine, theirs):
                made = http.put(
                    f"/sandboxes/{sandbox_id}", json={},
                    headers={**token, CAPABILITY_HEADER: mint(TOKEN, sandbox_id, now=time.time())},
                )  # fmt: skip
                assert made.status_code == 201, made.text
            files = f"/sandboxes/{theirs}/files/list"
            assert http.get(files, params={"path": "/"}).status_code == 401  # no token
            wrong = {"Authorization": "Bearer not-the-node-token-0123"}
            assert http.get(files, params={"path": "/"}, headers=wrong).status_code == 401
            assert http.get(files, params={"path": "/"}, headers=token).status_code == 403  # no capability
            borrowed = {**token, CAPABILITY_HEADER: mint(TOKEN, mine, now=time.time())}
            refused = http.get(files, params={"path": "/"}, headers=borrowed)
            assert refused.status_code == 403, refused.text  # my capability does not open theirs
            own = {**token, CAPABILITY_HEADER: mint(TOKEN, theirs, now=time.time())}
            assert http.get(files, params={"path": "/"}, headers=own).status_code == 200  # control
    finally:
        served.stop()


def test_the_socket_file_is_owner_only_and_never_replaces_another_file(sock_dir: pathlib.Path) -> None:
    path = sock_dir / "rpc.sock"
    listeners = open_listeners("127.0.0.1", 0, path)
    mode = path.lstat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    for sock in listeners:
        sock.close()
    again = unix_listener(path)  # the file a dead agent left behind is replaced
    again.close()
    close_listeners([], path)
    assert not path.exists()

    path.write_text("not a socket")
    with pytest.raises(errors.InvalidArgument, match="not a socket"):
        unix_listener(path)
    assert path.read_text() == "not a socket"
    too_long = sock_dir / ("s" * (MAX_SOCKET_PATH - len(str(sock_dir))))
    with pytest.raises(errors.InvalidArgument, match="longer than"):
        unix_listener(too_long)
    assert not too_long.exists()


@pytest.mark.parametrize(
    "spec",
    ["/only/a/path", "http://127.0.0.1:7070", "http://127.0.0.1:7070=relative.sock", "unix:/x=/y.sock",
     "file:///etc/passwd=/y.sock", f"http://127.0.0.1:7070=/{'x' * MAX_SOCKET_PATH}"],
)  # fmt: skip
def test_socket_settings_are_checked(spec: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        parse_sockets(spec)
    with pytest.raises(errors.InvalidArgument):
        NodePool(Store("sqlite://"), CLUSTER_TOKEN, pools=PoolSettings(sockets=spec))


_CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"


def _connect_as(user: str, path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", _CONNECT, str(path)]
    if user != "root":
        entry = pwd.getpwnam(user)
        argv = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.root
def test_only_the_sockets_owner_and_root_can_connect(sock_dir: pathlib.Path) -> None:
    sock_dir.chmod(0o755)  # the directory lets everyone in: the socket's own mode is what stops them
    path = sock_dir / "rpc.sock"
    listener = unix_listener(path)
    listener.listen()
    try:
        refused = _connect_as("nobody", path)
        assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused.stderr
        assert _connect_as("root", path).returncode == 0
        os.chmod(path, 0o666)  # positive control: the probe does connect when the mode lets it
        allowed = _connect_as("nobody", path)
        assert allowed.returncode == 0, allowed.stderr
    finally:
        listener.close()


def test_a_connection_idle_for_seconds_is_reused(loop: BackgroundLoop) -> None:
    """An agent's sandbox is used every few seconds: its pooled connection must still be there (the pool
    kept idle connections 2 s; now KEEPALIVE_EXPIRY_S, under the node's own keep-alive)."""
    peers: list[tuple[str, int]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        peers.append(scope["client"])  # one source port per connection
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    tcp, url = tcp_listener()
    served = Served(loop, app, [tcp])
    transport = PoolSettings().data_transport()

    async def call() -> None:
        async with httpx.AsyncClient(transport=transport, base_url=url) as http:
            for pause in (0.0, 3.0):
                await asyncio.sleep(pause)
                assert (await http.get("/")).status_code == 200

    try:
        loop.run(call(), timeout=60)
    finally:
        served.stop()
    assert len(peers) == 2 and peers[0] == peers[1], peers  # the same connection both times


def test_tcp_connections_of_the_agents_listener_do_not_wait_for_acks(loop: BackgroundLoop) -> None:
    """uvicorn serves the listeners rpc_listen opens (loop.create_server(sock=...)): their connections need
    TCP_NODELAY, or every small answer waits for the client's delayed ACK (found by bench/hop_bench.py)."""
    listener = open_listeners("127.0.0.1", 0, None)[0]
    port = listener.getsockname()[1]
    seen: list[int] = []

    async def check() -> None:
        def accepted(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(200):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    loop.run(check(), timeout=30)
    assert seen and seen[0] != 0, seen
