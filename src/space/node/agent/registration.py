"""The node's side of enrolment: register with the control plane, then heartbeat (ADR 0021).

Invariants:
- A node that holds an identity re-registers WITH it (`POST /v1/nodes/{id}/register`, Authorization: its
  identity) and keeps its node id, whatever URL it now listens on. Only a node without an identity the
  control plane accepts enrols (`POST /v1/nodes/register` with the bootstrap or an enrolment token), and
  only with a URL no node holds; a successful enrolment replaces the persisted identity, a failed one
  leaves it as it was.
- Every registration carries this node's own RPC token: the secret the control plane presents on this
  node's RPC. The bootstrap token is never sent anywhere but the enrolment route.
- Failures are logged (rate-limited) and retried, never fatal: the node serves its RPC either way.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from space.node.agent.identity import IdentityAuth
from space.node.agent.service_core import ServiceCore

log = logging.getLogger(__name__)


class RegistrationRefused(Exception):
    """The control plane refused this node's registration (the message says why; it holds no secret)."""


def _refusal(answer: httpx.Response) -> str:
    try:
        error = answer.json()["error"]
        return f"{answer.status_code} {error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{answer.status_code}"


async def register(
    http: httpx.AsyncClient, svc: ServiceCore, bootstrap_token: str | None, advertise_url: str, rpc_token: str
) -> str:
    """Register this node and return its node id: with its identity if it has one, else (or if the control
    plane does not know that identity: a new database, another cluster) by enrolling with the bootstrap
    token. RegistrationRefused if neither works."""
    body = svc.registration(advertise_url, rpc_token).model_dump(mode="json")
    identity = svc.identity
    if identity.enrolled:
        answer = await http.post(
            f"/v1/nodes/{identity.node_id}/register", json=body, auth=IdentityAuth(identity)
        )
        if answer.status_code < 300:
            return str(identity.node_id)
        if answer.status_code not in {401, 404} or not bootstrap_token:
            raise RegistrationRefused(f"re-registering as {identity.node_id}: {_refusal(answer)}")
        log.warning("the control plane does not know node %s (%s): enrolling anew with the bootstrap token",
                    identity.node_id, _refusal(answer))  # fmt: skip
    if not bootstrap_token:
        raise RegistrationRefused("this node has no identity yet and no bootstrap token to enrol with")
    answer = await http.post(
        "/v1/nodes/register", json=body, headers={"Authorization": f"Bearer {bootstrap_token}"}
    )
    if answer.status_code >= 300:
        raise RegistrationRefused(f"enrolling {advertise_url}: {_refusal(answer)}")
    answered = answer.json()
    node_id = str(answered.get("node_id") or "")
    secret = str(answered.get("identity") or "")
    if not node_id or not secret:  # (never echo the body: it holds the secret)
        raise RegistrationRefused(f"enrolment answered without a node id and identity: {sorted(answered)}")
    identity.set(node_id, secret)  # persisted before it is used
    return node_id


async def report_to_control_plane(
    svc: ServiceCore,
    control_plane: str,
    bootstrap_token: str | None,
    advertise_url: str,
    rpc_token: str,
    *,
    interval: float | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Register, then heartbeat every `interval` s (default: the service's heartbeat_interval_s) until
    cancelled. Failures are logged and retried, never
    fatal: the node serves the RPC whether or not the control plane is up. A 404/401 on a heartbeat means
    the control plane no longer knows this node (or this identity): register again."""
    if interval is None:
        interval = svc.settings.heartbeat_interval_s
    identity_auth = IdentityAuth(svc.identity)
    async with httpx.AsyncClient(
        base_url=control_plane.rstrip("/"), timeout=svc.settings.control_plane_timeout_s, transport=transport
    ) as http:
        node_id: str | None = None
        failures = 0
        while True:
            try:
                if node_id is None:
                    node_id = await register(http, svc, bootstrap_token, advertise_url, rpc_token)
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
