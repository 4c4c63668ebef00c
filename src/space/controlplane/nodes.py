"""Clients for the nodes the control plane drives, one per node, authenticated with the cluster node token.

Invariant: a node is reached only at the URL it registered with (from the store) and only with the
cluster's node token; clients are cached per node and rebuilt if the node re-registers at another URL.
"""

from __future__ import annotations

import threading
import time

from space.controlplane.store.store import Store
from space.core import errors
from space.node.rpc_client import NodeClient

URL_RECHECK_S = 5.0  # a node that re-registers at another URL is followed within this long


class NodePool:
    def __init__(self, store: Store, node_token: str) -> None:
        self.store = store
        self.node_token = node_token
        self._clients: dict[str, tuple[str, NodeClient]] = {}
        self._checked: dict[str, float] = {}
        self._lock = threading.Lock()

    def client(self, node_id: str) -> NodeClient:
        with self._lock:
            cached = self._clients.get(node_id)
            if cached is not None and time.monotonic() - self._checked.get(node_id, 0.0) < URL_RECHECK_S:
                return cached[1]  # the data plane's hot path: no database read per request
        node = self.store.get_node(node_id)
        if node is None:
            raise errors.Unavailable(f"node {node_id} is not registered")
        with self._lock:
            self._checked[node_id] = time.monotonic()
            cached = self._clients.get(node_id)
            if cached is not None and cached[0] == node.url:
                return cached[1]
            client = NodeClient(node.url, self.node_token)
            self._clients[node_id] = (node.url, client)
            return client

    async def aclose(self) -> None:
        with self._lock:
            clients = [client for _url, client in self._clients.values()]
            self._clients.clear()
        for client in clients:
            await client.aclose()
