"""A node agent's RPC app served by a real uvicorn on 127.0.0.1 from a BackgroundLoop (no root): the node
token the tests use, the `Rpc` handle (loop, agent, URL, typed client, raw HTTP) and `serve_in`, which
binds a free loopback port and returns once uvicorn accepts connections."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import uvicorn

from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from tests.support.loop import BackgroundLoop
from tests.support.node_capability import NodeAuth

T = TypeVar("T")
TOKEN = "test-node-token-0123456789"


@dataclass
class Rpc:
    loop: BackgroundLoop
    agent: NodeAgent
    url: str
    client: NodeClient
    http: httpx.Client  # raw HTTP from the test thread, for statuses and headers

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return self.loop.run(coro, timeout)

    def new(self, **body: Any) -> str:
        sandbox_id = new_sandbox_id()
        self.run(self.client.create_sandbox(sandbox_id, **body))
        return sandbox_id


def serve_in(loop: BackgroundLoop, app: Any) -> tuple[uvicorn.Server, Any, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return server, future, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def fake_node_rpc(root: pathlib.Path) -> Iterator[Rpc]:
    """A prepared fake-driver node agent served over real HTTP, with its typed and raw clients; every
    sandbox deleted and everything closed afterwards."""
    loop = BackgroundLoop()
    agent = NodeAgent(FakeDriver(root))
    loop.run(agent.prepare())
    server, future, url = serve_in(loop, create_app(agent, TOKEN))

    async def make_client() -> NodeClient:
        return NodeClient(url, TOKEN)

    client = loop.run(make_client())
    http = httpx.Client(base_url=url, auth=NodeAuth(TOKEN), timeout=30)
    try:
        yield Rpc(loop, agent, url, client, http)
    finally:
        http.close()
        loop.run(client.aclose())
        server.should_exit = True
        future.result(15)
        loop.run(agent.delete_all())
        loop.run(agent.close())
        loop.close()
