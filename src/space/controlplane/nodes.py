"""Clients for the nodes the control plane drives, one per node, each authenticated with THAT node's own
RPC token (ADR 0021).

Invariants:
- A node is reached only at the URL it registered with (from the store) and only with the RPC token it
  sent at its latest registration; the cluster's bootstrap token is never presented to a node. Clients are
  cached per node and rebuilt when the node re-registers at another URL or with another token.
- A node's RPC token is kept in the database only sealed (AES-256-GCM, `space.crypto.envelope`) under a
  key derived from the cluster's bootstrap token, which every control-plane replica already holds (and
  nodes enrolled with enrolment tokens never see), with the node id as associated data: a database dump
  alone opens no token, and a sealed token copied onto another node's row does not open.
- Per node, control traffic and data traffic go through separate, bounded connection pools
  (space.controlplane.node_pools, ADR 0025): `client` picks the data pool inside a tenant's data-plane
  request, the control pool otherwise. A node the operator gave a unix socket (SPACE_NODE_POOL_SOCKETS)
  is reached through it, both pools alike (ADR 0044).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

from space.controlplane.node_pools import PoolSettings, parse_sockets, traffic_owner
from space.controlplane.store.store import Store
from space.core import errors
from space.crypto.envelope import derive_key, open_sealed, seal
from space.node.rpc_client import NodeClient

URL_RECHECK_S = 5.0  # a node that re-registers at another URL is followed within this long
_SEAL_PURPOSE = "space node rpc token v1"


class RpcTokenSeal:
    """Seals and opens nodes' RPC tokens for the database (module docstring)."""

    def __init__(self, cluster_token: str) -> None:
        if not cluster_token:
            raise ValueError("the cluster node token must not be empty")
        self._key = derive_key(hashlib.sha256(cluster_token.encode()).digest(), _SEAL_PURPOSE)

    def seal(self, node_id: str, rpc_token: str) -> bytes:
        return seal(self._key, rpc_token.encode(), node_id.encode())

    def open(self, node_id: str, sealed: bytes) -> str:
        try:
            return open_sealed(self._key, sealed, node_id.encode()).decode()
        except (errors.ArtifactCorrupt, UnicodeDecodeError) as exc:
            raise errors.Unavailable(
                f"the RPC token of node {node_id} does not open (sealed under another cluster token?): "
                "restart the node so that it registers again"
            ) from exc


@dataclass(frozen=True)
class _Clients:
    control: NodeClient
    data: NodeClient

    def pick(self) -> NodeClient:
        return self.data if traffic_owner.get() is not None else self.control


class NodePool:
    def __init__(self, store: Store, node_token: str, pools: PoolSettings | None = None) -> None:
        """`node_token`: the cluster's bootstrap token, used here only to seal and open RPC tokens."""
        self.store = store
        self.tokens = RpcTokenSeal(node_token)
        self.pools = pools or PoolSettings.from_env()
        parse_sockets(self.pools.sockets)  # a wrong socket setting fails the start, not the first call
        self._clients: dict[str, tuple[tuple[str, bytes], _Clients]] = {}
        self._retired: list[NodeClient] = []  # replaced clients, closed with the pool
        self._checked: dict[str, float] = {}
        self._lock = threading.Lock()

    def client(self, node_id: str) -> NodeClient:
        with self._lock:
            cached = self._clients.get(node_id)
            if cached is not None and time.monotonic() - self._checked.get(node_id, 0.0) < URL_RECHECK_S:
                return cached[1].pick()  # the data plane's hot path: no database read per request
        endpoint = self.store.node_endpoint(node_id)
        if endpoint is None:
            raise errors.Unavailable(f"node {node_id} is not registered")
        url, sealed = endpoint
        if sealed is None:
            raise errors.Unavailable(f"node {node_id} has no RPC token on record: it must register again")
        with self._lock:
            self._checked[node_id] = time.monotonic()
            cached = self._clients.get(node_id)
            if cached is not None and cached[0] == (url, sealed):
                return cached[1].pick()
        token = self.tokens.open(node_id, sealed)
        uds = self.pools.socket_for(url)  # a node on this machine: its agent's unix socket (ADR 0044)
        client = _Clients(
            control=NodeClient(url, token, transport=self.pools.control_transport(uds)),
            data=NodeClient(url, token, transport=self.pools.data_transport(uds)),
        )
        with self._lock:
            # A replaced client is not closed here: a request may still be using it (it goes with the pool).
            old = self._clients.get(node_id)
            self._clients[node_id] = ((url, sealed), client)
            if old is not None:
                self._retired += [old[1].control, old[1].data]
            return client.pick()

    async def aclose(self) -> None:
        with self._lock:
            clients = [c for _key, pair in self._clients.values() for c in (pair.control, pair.data)]
            clients += self._retired
            self._clients.clear()
            self._retired = []
        for client in clients:
            await client.aclose()
