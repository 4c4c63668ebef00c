"""Hundreds of simulated node agents in one process, for the scale simulator (bench/scale_sim.py).

A `FakeFleet` runs ONE asyncio loop in a background thread with one HTTP server (uvicorn, a bare ASGI app)
that answers the node RPC of every simulated node under its own path: node i is
`http://127.0.0.1:<port>/n/<i>` (a node URL may carry a path; the control plane appends /node/v1/...).
Each node enrols with the cluster's bootstrap token, then heartbeats to its control plane every
`heartbeat_s` (the agent's default, 2 s) with the body a real agent sends (rpc_models.Heartbeat), and
registers again on a 401/404, as space.node.agent.registration does.

What a simulated node does: it keeps a dict of sandboxes; create (PUT) is idempotent by id and answers
201 the first time, actions set the state, DELETE answers existed or not, the listing is what it holds.
No process, no disk, no guest: only the control plane's side of the work is real. The time a create
reached a node is recorded (`created_at_node`), which is what the scheduling latency is measured against.

Invariants:
- The RPC token is checked on every call (the control plane presents the node's own token); a call for an
  unknown node or path is a 404 with the error body the real agent sends.
- `close()` stops the heartbeats and the server and joins the thread; nothing is left running.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from space.core.settings import SandboxLimits

DEFAULT_LIMITS = SandboxLimits().model_dump()
#: Each simulated node is a big machine, so placement never runs out of room in a simulation.
CAPACITY = {"cpus": 64.0, "memory_mb": 256 * 1024, "disk_mb": 2_000_000, "disk_free_mb": 2_000_000,
            "disk_reserve_mb": 10_000}  # fmt: skip
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class SimNode:
    index: int
    url: str
    control_plane: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    node_id: str | None = None
    identity: str | None = None
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_at_node: dict[str, float] = field(default_factory=dict)
    beats: int = 0
    beat_failures: int = 0
    registrations: int = 0

    def used(self) -> dict[str, Any]:
        live = [s for s in self.sandboxes.values() if s["state"] != "deleted"]
        return {"cpus": sum(float(s["limits"].get("cpus", 0)) for s in live),
                "memory_mb": sum(int(s["limits"].get("memory_mb", 0)) for s in live),
                "disk_mb": sum(int(s["limits"].get("disk_mb", 0)) for s in live)}  # fmt: skip

    def info(self) -> dict[str, Any]:
        return {"driver": "fake", "isolating": False, "capacity": CAPACITY, "used": self.used(),
                "sandbox_count": len(self.sandboxes), "templates": ["python"],
                "time": time.time()}  # fmt: skip

    def heartbeat(self) -> dict[str, Any]:
        assert self.node_id is not None
        return {"node_id": self.node_id, "url": self.url, **self.info(), "activity": {},
                "sandboxes": list(self.sandboxes.values()), "unmanaged": []}  # fmt: skip

    def registration(self) -> dict[str, Any]:
        info = self.info()
        return {"url": self.url, "token": self.token, "capacity": info["capacity"], "templates": ["python"],
                "driver": "fake", "isolating": False}  # fmt: skip


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"code": code, "message": message, "details": {}}}


class FakeFleet:
    """`count` simulated nodes; node i reports to control_planes[i % len(control_planes)]."""

    def __init__(
        self, control_planes: list[str], bootstrap_token: str, count: int, *, heartbeat_s: float = 2.0
    ) -> None:
        self.control_planes = control_planes
        self.bootstrap_token = bootstrap_token
        self.heartbeat_s = heartbeat_s
        self.port = _free_port()
        self.nodes = [
            SimNode(i, f"http://127.0.0.1:{self.port}/n/{i}", control_planes[i % len(control_planes)])
            for i in range(count)
        ]
        self.beat_ms: list[float] = []  # heartbeat round trips (all nodes), for the saturation picture
        self.rpc_calls: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-fleet", daemon=True)
        self._server: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: dict[str, httpx.AsyncClient] = {}

    # -- life ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)

    async def _start(self) -> None:
        config = uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", access_log=False, backlog=4096,
                                interface="asgi3")  # fmt: skip
        self._server = uvicorn.Server(config)
        self._tasks.append(asyncio.create_task(self._server.serve()))
        while not self._server.started:
            await asyncio.sleep(0.02)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        for url in self.control_planes:
            self._clients[url] = httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits)
        for node in self.nodes:
            self._tasks.append(asyncio.create_task(self._report(node)))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        for client in self._clients.values():
            await client.aclose()
        if self._server is not None:
            self._server.should_exit = True
        await asyncio.gather(self._tasks[0], return_exceptions=True)

    def registered(self) -> int:
        return sum(1 for node in self.nodes if node.node_id is not None)

    def created_at_node(self) -> dict[str, float]:
        """sandbox id -> wall-clock time its create first reached a node (first PUT); read in the fleet's
        loop, which is the only writer."""

        async def collect() -> dict[str, float]:
            return {sid: t for node in self.nodes for sid, t in node.created_at_node.items()}

        return asyncio.run_coroutine_threadsafe(collect(), self._loop).result(30)

    # -- the node's side of enrolment and heartbeats --------------------------------------------------------
    async def _report(self, node: SimNode) -> None:
        http = self._clients[node.control_plane]
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))  # nodes do not all beat in step
        while True:
            started = time.perf_counter()
            try:
                if node.node_id is None:
                    await self._register(http, node)
                answer = await http.post(f"/v1/nodes/{node.node_id}/heartbeat", json=node.heartbeat(),
                                         headers={"Authorization": f"Bearer {node.identity}"})  # fmt: skip
                if answer.status_code in {401, 404}:
                    node.node_id = None
                    continue
                answer.raise_for_status()
                node.beats += 1
                self.beat_ms.append((time.perf_counter() - started) * 1000)
            except httpx.HTTPError:
                node.beat_failures += 1
            await asyncio.sleep(self.heartbeat_s)

    async def _register(self, http: httpx.AsyncClient, node: SimNode) -> None:
        answer = await http.post("/v1/nodes/register", json=node.registration(),
                                 headers={"Authorization": f"Bearer {self.bootstrap_token}"})  # fmt: skip
        answer.raise_for_status()
        body = answer.json()
        node.node_id, node.identity = str(body["node_id"]), str(body["identity"])
        node.registrations += 1

    # -- the node RPC ----------------------------------------------------------------------------------------
    async def _app(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer = self._route(scope, body)
        payload = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})

    def _route(self, scope: dict[str, Any], body: bytes) -> tuple[int, dict[str, Any]]:
        parts = scope["path"].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "n" or not parts[1].isdigit() or parts[2:4] != ["node", "v1"]:
            return _error(404, "not_found", "no such route")
        index = int(parts[1])
        if index >= len(self.nodes):
            return _error(404, "not_found", "no such node")
        node = self.nodes[index]
        headers = dict(scope["headers"])
        if headers.get(b"authorization", b"").decode() != f"Bearer {node.token}":
            return _error(401, "unauthenticated", "bad node token")
        method, rest = scope["method"], parts[4:]
        key = f"{method} /{'/'.join(p if not p.startswith('sb-') else '{id}' for p in rest)}"
        self.rpc_calls[key] = self.rpc_calls.get(key, 0) + 1
        return _serve(node, method, rest, body)


def _serve(node: SimNode, method: str, rest: list[str], body: bytes) -> tuple[int, dict[str, Any]]:
    if rest == ["info"] and method == "GET":
        return 200, node.info()
    if rest == ["sandboxes"] and method == "GET":
        return 200, {"sandboxes": list(node.sandboxes.values()), "unmanaged": []}
    if len(rest) < 2 or rest[0] != "sandboxes":
        return _error(404, "not_found", "no such route")
    sandbox_id, tail = rest[1], rest[2:]
    held = node.sandboxes.get(sandbox_id)
    if method == "PUT" and not tail:
        if held is not None:
            return 200, held
        request = json.loads(body or b"{}")
        node.created_at_node.setdefault(sandbox_id, time.time())
        node.sandboxes[sandbox_id] = {
            "id": sandbox_id, "state": "running", "template": request.get("template", "python"),
            "limits": {**DEFAULT_LIMITS, **(request.get("limits") or {})}, "created_at": time.time(),
            "runtime": "running", "exists": True, "channel_open": True,
        }  # fmt: skip
        return 201, node.sandboxes[sandbox_id]
    if method == "DELETE" and not tail:
        return 200, {
            "id": sandbox_id,
            "state": "deleted",
            "existed": node.sandboxes.pop(sandbox_id, None) is not None,
        }
    if held is None:
        return _error(404, "not_found", f"sandbox {sandbox_id} not found")
    if method == "GET" and not tail:
        return 200, held
    if method == "POST" and len(tail) == 1 and tail[0] in ACTIONS:
        held["state"] = held["runtime"] = ACTIONS[tail[0]]
        return 200, held
    if method == "PUT" and tail == ["egress"]:
        return 200, {"applied": False, "reason": "no egress gateway on this node"}
    return _error(404, "not_found", "no such route")


ACTIONS = {"pause": "paused", "resume": "running", "stop": "stopped", "start": "running"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
