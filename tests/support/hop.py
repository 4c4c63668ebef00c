"""Pieces of the hop tests (ADR 0044): a node RPC app served by a real uvicorn on given listeners (a unix
socket, a TCP port) from a BackgroundLoop, stopped and started again like a restarting agent; a node
record in a real store that a NodePool reaches; a process's resident memory, sampled."""

from __future__ import annotations

import asyncio
import pathlib
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

import uvicorn

from space.controlplane.nodes import RpcTokenSeal
from space.controlplane.store.store import Store
from space.core.ids import new_node_id
from tests.support.loop import BackgroundLoop

CLUSTER_TOKEN = "hop-cluster-token-0123456789"


class Served:
    """An ASGI app served on `listeners` until `stop()`."""

    def __init__(self, loop: BackgroundLoop, app: Any, listeners: list[socket.socket]) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.listeners = listeners
        self.future: Future[None] = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=listeners), loop.loop
        )
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert not self.future.done(), f"uvicorn ended at start: {self.future.exception()}"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.future.result(15)
        for sock in self.listeners:
            sock.close()


def tcp_listener() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def closed_port_url() -> str:
    """A loopback URL where nothing listens (the port was free a moment ago and is not bound again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def enrol(store: Store, url: str, rpc_token: str) -> str:
    """A node record at `url` whose sealed RPC token is `rpc_token` (as a registration leaves it)."""
    seal = RpcTokenSeal(CLUSTER_TOKEN)
    record = store.enrol_node(
        new_node_id(),
        url,
        identity="hop-identity-0123456789",
        seal_rpc_token=lambda nid: seal.seal(nid, rpc_token),
    )
    return record.id


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


class PeakRss:
    """The highest resident memory of a process while the block runs (sampled every 10 ms, and its VmHWM
    reset at the start, so a peak between two samples counts too)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = 0
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_kib(self.pid))

    def __enter__(self) -> PeakRss:
        pathlib.Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS
        self.base = rss_kib(self.pid)
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()
        self._thread.join(5)
        self.peak = max(self.peak, rss_kib(self.pid, "VmHWM"))

    @property
    def growth_kib(self) -> int:
        return self.peak - self.base
