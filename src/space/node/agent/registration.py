"""The node's side of enrolment: register with the control plane, then heartbeat (ADR 0021).

Invariants:
- A node that holds an identity re-registers WITH it (`POST /v1/nodes/{id}/register`, Authorization: its
  identity) and keeps its node id, whatever URL it now listens on. Only a node without an identity the
  control plane accepts enrols (`POST /v1/nodes/register` with the bootstrap or an enrolment token), and
  only with a URL no node holds; a successful enrolment replaces the persisted identity, a failed one
  leaves it as it was.
- Every registration carries this node's own RPC token: the secret the control plane presents on this
  node's RPC. The bootstrap token is never sent anywhere but the enrolment route.
- Failures are logged (rate-limited) and retried, never fatal: the node serves its RPC either way. The one
  exception is an incompatible protocol (ADR 0071): a control plane that speaks no version this node speaks
  (its 409 `incompatible_protocol`, or an answer announcing such a range) is IncompatiblePeer, which ends
  `Reporter.run()`: retrying cannot help, and the agent exits naming both ranges.
- Each acknowledged heartbeat renews the node's lease (space.node.agent.fencing, ADR 0033) from the time it
  was SENT; a clean stop deregisters (the node becomes `offline`) and only then releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from space.node.agent.fencing import Fence
from space.node.agent.identity import IdentityAuth
from space.node.agent.service_core import ServiceCore
from space.protocol import node_protocol

log = logging.getLogger(__name__)


class RegistrationRefused(Exception):
    """The control plane refused this node's registration (the message says why; it holds no secret)."""


class IncompatiblePeer(RegistrationRefused):
    """The control plane and this node speak no common protocol version (the message names both ranges)."""


def _check_protocol(answer: httpx.Response) -> None:
    """IncompatiblePeer if the control plane refused this node's protocol range, or answered a range of its
    own that does not overlap this node's (a control plane from before versioning announces none: 1..1)."""
    ours = node_protocol.own_range()
    try:
        body = answer.json()
    except ValueError:
        return
    if not isinstance(body, dict):
        return
    error = body.get("error")
    if answer.status_code >= 400:
        if isinstance(error, dict) and error.get("code") == "incompatible_protocol":
            raise IncompatiblePeer(f"the control plane refused this node: {error.get('message')}")
        return
    try:
        theirs = node_protocol.announced_range(body)
    except node_protocol.MalformedRange as exc:
        raise IncompatiblePeer(f"the control plane answered a malformed protocol range: {exc}") from exc
    if node_protocol.common_version(ours, theirs) is None:
        raise IncompatiblePeer(node_protocol.describe(ours, theirs, we="node", they="control plane"))


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
        _check_protocol(answer)
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
    _check_protocol(answer)
    if answer.status_code >= 300:
        raise RegistrationRefused(f"enrolling {advertise_url}: {_refusal(answer)}")
    answered = answer.json()
    node_id = str(answered.get("node_id") or "")
    secret = str(answered.get("identity") or "")
    if not node_id or not secret:  # (never echo the body: it holds the secret)
        raise RegistrationRefused(f"enrolment answered without a node id and identity: {sorted(answered)}")
    identity.set(node_id, secret)  # persisted before it is used
    return node_id


class Reporter:
    """Registration, heartbeats and the lease they renew (ADR 0033), and the clean goodbye.

    `run()` registers, then heartbeats every `interval` s until `stop()` (or cancelled); each acknowledged
    heartbeat renews `fence` (if given) from the monotonic time the heartbeat was SENT. `deregister()` (after
    `run` returned: `space down`) tells the control plane this node is leaving, naming its latest
    heartbeat, and only if that is accepted releases the fence, so the sandboxes stay for the next start."""

    def __init__(
        self,
        svc: ServiceCore,
        control_plane: str,
        bootstrap_token: str | None,
        advertise_url: str,
        rpc_token: str,
        *,
        fence: Fence | None = None,
        interval: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.svc = svc
        self.control_plane = control_plane
        self.bootstrap_token = bootstrap_token
        self.advertise_url = advertise_url
        self.rpc_token = rpc_token
        self.fence = fence
        self.interval = svc.settings.heartbeat_interval_s if interval is None else interval
        self.transport = transport
        self.node_id: str | None = None
        self.beat: str | None = None  # the `beat` of the latest acknowledged heartbeat
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """`run()` returns once the heartbeat in flight, if any, is answered. Cancelling it instead could
        leave a heartbeat the control plane recorded but whose `beat` this node never read: deregister()
        would then name an older one and be refused as stale (seen: `space down` under load)."""
        self._stopping.set()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.control_plane.rstrip("/"), timeout=self.svc.settings.control_plane_timeout_s,
            transport=self.transport,
        )  # fmt: skip

    async def _beat(self, http: httpx.AsyncClient, node_id: str) -> bool:
        """One heartbeat; False if the control plane no longer knows this node (register again)."""
        beat = await self.svc.heartbeat(node_id, self.advertise_url)
        sent_at = time.monotonic()
        answer = await http.post(
            f"/v1/nodes/{node_id}/heartbeat", json=beat.model_dump(mode="json"),
            auth=IdentityAuth(self.svc.identity),
        )  # fmt: skip
        if answer.status_code in {401, 404}:
            log.warning("control plane does not know node %s (%s): registering again", node_id,
                        answer.status_code)  # fmt: skip
            return False
        answer.raise_for_status()
        _check_protocol(answer)  # a replica of no common version took over (an upgrade done out of order)
        answered = answer.json() if answer.content else {}
        self.beat = answered.get("beat") if isinstance(answered.get("beat"), str) else None
        lease = answered.get("fence_after_s")
        if self.fence is not None and isinstance(lease, int | float) and lease > 0:
            await self.fence.renew(sent_at, float(lease))
        return True

    async def run(self) -> None:
        failures = 0
        async with self._client() as http:
            while not self._stopping.is_set():
                try:
                    if self.node_id is None:
                        self.node_id = await register(
                            http, self.svc, self.bootstrap_token, self.advertise_url, self.rpc_token
                        )
                        log.info("registered with %s as %s", self.control_plane, self.node_id)
                    if not await self._beat(http, self.node_id):
                        self.node_id = None
                        continue
                    if failures:
                        log.info("control plane reachable again after %d failed attempts", failures)
                    failures = 0
                except (asyncio.CancelledError, IncompatiblePeer):
                    raise
                except Exception as exc:
                    failures += 1
                    # Log the first failure and then every 30th, so an absent control plane does not flood
                    # logs.
                    if failures == 1 or failures % 30 == 0:
                        log.warning("control plane %s: %s (attempt %d; retrying)", self.control_plane, exc,
                                    failures)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.interval)

    async def deregister(self) -> bool:
        """Leave cleanly: the control plane marks this node `offline` (True), then the fence is released.
        False (and the fence stays armed) if the control plane did not accept it: it will mark this node
        lost and may restore its sandboxes elsewhere, so they must still be fenced."""
        if self.node_id is None or self.beat is None:
            log.warning("leaving without deregistering: no acknowledged heartbeat to name")
            return False
        try:
            async with self._client() as http:
                answer = await http.post(
                    f"/v1/nodes/{self.node_id}/deregister", json={"beat": self.beat},
                    auth=IdentityAuth(self.svc.identity),
                )  # fmt: skip
        except httpx.HTTPError as exc:
            log.warning("could not deregister from %s: %s (the fence stays armed)", self.control_plane, exc)
            return False
        if answer.status_code >= 300:
            log.warning("deregistration refused: %s (the fence stays armed)", _refusal(answer))
            return False
        log.info("deregistered from %s: node %s is offline", self.control_plane, self.node_id)
        if self.fence is not None:
            await self.fence.release()
        return True


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
    cancelled, without a fence (Reporter does both). Failures are logged and retried, never fatal: the
    node serves the RPC whether or not the control plane is up. A 404/401 on a heartbeat means the control
    plane no longer knows this node (or this identity): register again."""
    reporter = Reporter(
        svc, control_plane, bootstrap_token, advertise_url, rpc_token, interval=interval, transport=transport
    )
    await reporter.run()
