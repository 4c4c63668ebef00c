"""E2B's in-sandbox (envd) front over a real installation, for tests: the control plane's own Services (a
second replica of the `real_cluster`'s control plane: same database, same node, no reconciler of its own)
with `envd_app` served by uvicorn on a loopback port in this process, and E2B's own generated Connect
clients pointed at it the way E2B's SDK points them (`E2B_SANDBOX_URL` + routing headers).

Invariants:
- The front is stopped (uvicorn exits, its lifespan closes the watchers, the node clients are closed) when
  the fixture ends; sandboxes are the tests' own to delete.
- Clients are built by the SDK's own factory (`e2b.envd.client_sync.create_rpc_client`: its pyqwest
  transport, its JSON codec, its interceptors), with the headers the SDK sends after a create.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from e2b.connection_config import ConnectionConfig
from e2b.envd.client_sync import create_rpc_client
from e2b.envd.filesystem.filesystem_connect import FilesystemClientSync
from e2b.envd.process.process_connect import ProcessClientSync

from space.controlplane.api.app import create_app
from space.controlplane.api.deps import Services
from space.controlplane.e2b.access import envd_access_token
from space.controlplane.e2b.envd import envd_app
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from tests.support.cluster import RealCluster, free_port

C = TypeVar("C")
#: The front's upload bound in these tests: small, so the 413 tests send little.
TEST_MAX_UPLOAD_BYTES = 4 << 20


@dataclass
class EnvdFront:
    url: str
    services: Services
    cluster: RealCluster

    def token(self, sandbox_id: str) -> str:
        return envd_access_token(self.services.node_token, sandbox_id)

    def headers(
        self, sandbox_id: str, *, token: str | None = None, api_key: str | None = None
    ) -> dict[str, str]:
        """The headers E2B's SDK sends on envd traffic (and, for SPACE keys, X-API-Key)."""
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
        if token is not None:
            headers["X-Access-Token"] = token
        if api_key is not None:
            headers["X-API-Key"] = api_key
        return headers

    def config(self, sandbox_id: str, **kw: Any) -> ConnectionConfig:
        return ConnectionConfig(
            api_key="unused", sandbox_url=self.url, extra_sandbox_headers=self.headers(sandbox_id, **kw)
        )

    def _client(self, cls: type[C], sandbox_id: str, **kw: Any) -> C:
        if not kw:
            kw = {"token": self.token(sandbox_id)}
        return create_rpc_client(cls, self.url, self.config(sandbox_id, **kw))

    def process(self, sandbox_id: str, **kw: Any) -> ProcessClientSync:
        return self._client(ProcessClientSync, sandbox_id, **kw)

    def filesystem(self, sandbox_id: str, **kw: Any) -> FilesystemClientSync:
        return self._client(FilesystemClientSync, sandbox_id, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)


@contextlib.contextmanager
def serve_front(cluster: RealCluster, **settings: Any) -> Iterator[EnvdFront]:
    """An envd front over a second replica of `cluster`'s control plane, with these settings changed."""
    data_dir = pathlib.Path(cluster.data_dir)
    store = Store(sqlite_url(data_dir))
    node_token = (data_dir / "node.token").read_text().strip()
    update = {"max_upload_bytes": TEST_MAX_UPLOAD_BYTES, **settings}
    chosen = ControlPlaneSettings.from_env().model_copy(update=update)
    api = create_app(store, node_token=node_token, run_reconciler=False, settings=chosen)
    services: Services = api.state.services
    port = free_port()
    config = uvicorn.Config(
        envd_app(services), host="127.0.0.1", port=port, lifespan="on", log_level="warning",
        timeout_keep_alive=330,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="envd-front", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the envd front did not start"
        time.sleep(0.02)
    try:
        yield EnvdFront(f"http://127.0.0.1:{port}", services, cluster)
    finally:
        server.should_exit = True
        thread.join(30)
        with contextlib.suppress(Exception):  # its connections belonged to the server's (ended) loop
            asyncio.run(services.nodes.aclose())
        store.close()


@pytest.fixture(scope="module")
def envd_front(real_cluster: RealCluster) -> Iterator[EnvdFront]:
    with serve_front(real_cluster) as front:
        yield front
