"""The node's identity towards the control plane: the node id and the per-node secret the control plane
issued at this node's latest registration (ADR 0019).

Invariants:
- The secret lives only in memory, in one `NodeIdentity` per node process; it is never logged, written to
  disk or sent anywhere but the control plane. A restarted node registers again and gets a new secret,
  which ends the previous one at the control plane.
- The cluster's bootstrap token only registers. Everything after registration (heartbeats, credential
  fetches, audit posts) authenticates with `IdentityAuth`, which reads the CURRENT secret per request, so a
  re-registration takes effect in every client at once, without rebuilding any of them.
- `node_id` and `secret` change together (`set`), so nobody sends one registration's id with another's
  secret; before the first registration both are None and requests go out without credentials (the
  control plane answers 401).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import httpx


@dataclass
class NodeIdentity:
    node_id: str | None = None
    secret: str | None = field(default=None, repr=False)

    def set(self, node_id: str, secret: str) -> None:
        if not node_id or not secret:
            raise ValueError("a node identity needs a node id and a secret")
        self.node_id, self.secret = node_id, secret

    def current_node_id(self) -> str | None:
        """For space.node.agent.credential_manager's `NodeIdProvider`."""
        return self.node_id


class IdentityAuth(httpx.Auth):
    """httpx authentication with the node's current identity: `Authorization: Bearer <secret>`."""

    def __init__(self, identity: NodeIdentity) -> None:
        self._identity = identity

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        secret = self._identity.secret
        if secret is not None:
            request.headers["Authorization"] = f"Bearer {secret}"
        yield request
