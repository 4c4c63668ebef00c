"""The node's side of enrolment: register with the control plane, then heartbeat.

Invariants:
- The bootstrap token is sent only to register; every later call authenticates with the per-node identity
  the control plane answered (ADR 0019).
- Failures are logged (rate-limited) and retried, never fatal: the node serves its RPC either way.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from space.node.agent.identity import IdentityAuth
from space.node.agent.server import HEARTBEAT_INTERVAL_S, NodeService

log = logging.getLogger(__name__)


async def report_to_control_plane(
    svc: NodeService,
    control_plane: str,
    bootstrap_token: str,
    advertise_url: str,
    rpc_token: str,
    *,
    interval: float = HEARTBEAT_INTERVAL_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Register, then heartbeat every `interval` s until cancelled. Failures are logged and retried, never
    fatal: the node serves the RPC whether or not the control plane is up. A 404/401 on a heartbeat means
    the control plane no longer knows this node (or this registration): register again.

    The bootstrap token is sent only to register; the answer's per-node secret goes into `svc.identity`
    (memory only), which authenticates the heartbeats and every other node-facing call (ADR 0019)."""
    bootstrap = {"Authorization": f"Bearer {bootstrap_token}"}
    identity_auth = IdentityAuth(svc.identity)
    async with httpx.AsyncClient(
        base_url=control_plane.rstrip("/"), timeout=10.0, transport=transport
    ) as http:
        node_id: str | None = None
        failures = 0
        while True:
            try:
                if node_id is None:
                    registration = svc.registration(advertise_url, rpc_token)
                    answer = await http.post(
                        "/v1/nodes/register", json=registration.model_dump(mode="json"), headers=bootstrap
                    )
                    answer.raise_for_status()
                    body = answer.json()
                    registered_id = str(body.get("node_id") or body.get("id") or "")
                    secret = str(body.get("identity") or "")
                    if not registered_id or not secret:  # (never echo the body: it holds the secret)
                        raise ValueError(f"register answered without a node id and identity: {sorted(body)}")
                    svc.identity.set(registered_id, secret)
                    node_id = registered_id
                    log.info("registered with %s as %s", control_plane, node_id)
                beat = await svc.heartbeat(node_id, advertise_url)
                answer = await http.post(
                    f"/v1/nodes/{node_id}/heartbeat", json=beat.model_dump(mode="json"), auth=identity_auth
                )
                if answer.status_code in {401, 404}:
                    log.warning("control plane does not know node %s (%s): registering again", node_id,
                                answer.status_code)  # fmt: skip
                    node_id = None
                    continue
                answer.raise_for_status()
                if failures:
                    log.info("control plane reachable again after %d failed attempts", failures)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                # Log the first failure and then every 30th, so an absent control plane does not flood logs.
                if failures == 1 or failures % 30 == 0:
                    log.warning("control plane %s: %s (attempt %d; retrying)", control_plane, exc, failures)
            await asyncio.sleep(interval)
