"""Stage 1 of an HTTP exchange, decide: may this request go out, and to which checked addresses.

Invariants:
- Every request is decided afresh (also the later ones on a kept-alive connection, and every request that
  follows a redirect: the gateway never follows redirects itself) against the sandbox's policy as it is
  now, on the normalized destination (http.target).
- An unknown source address is refused (403) before anything else is looked at.
- An allowed request carries the addresses the policy checked; nothing later connects anywhere else.
- Every decision is audited: "denied" with the policy's reason, or "allowed" with the listener mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import h11

from space.core import errors
from space.node.egress.context import GatewayContext
from space.node.egress.http.messages import Refused
from space.node.egress.http.target import TargetRules, request_target
from space.node.egress.policy import Destination, IPAddress, normalize_host, split_authority


@dataclass(frozen=True)
class Route:
    """A request the policy lets out: whose it is, where it goes (checked addresses only), what it asks."""

    sandbox_id: str
    destination: Destination
    port: int
    target: bytes  # origin form, as sent upstream
    addresses: tuple[IPAddress, ...]


async def decide(ctx: GatewayContext, source: str, request: h11.Request, rules: TargetRules) -> Route:
    """The route of `request` from `source`; raises Refused (audited) when it may not go out."""
    entry = ctx.lookup(source)
    if entry is None:
        raise Refused(403, "no egress for this source address")
    wanted = request_target(request, rules)
    destination, port = wanted.destination, wanted.port
    decision = await ctx.resolve_checked(entry.policy, destination)
    if not decision.allowed:
        ctx.audit_denied(entry.sandbox_id, destination, decision, port)
        raise Refused(403, f"destination {destination.host} refused: {decision.reason}")
    ctx.audit("egress", entry.sandbox_id, destination.host, "allowed", port=port, mode=rules.mode)
    return Route(entry.sandbox_id, destination, port, wanted.origin, decision.addresses)


def note_redirect(ctx: GatewayContext, source: str, route: Route, location: bytes) -> None:
    """Redirects are never followed here; a Location the sandbox's current policy refuses is audited (the
    follow-up request, if the sandbox makes it, is decided like any other)."""
    text = location.decode("latin-1")
    if "://" not in text:
        return
    authority = text.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    entry = ctx.lookup(source)
    if entry is None:
        return
    origin = route.destination.host
    try:
        target = normalize_host(split_authority(authority, 80)[0])
    except errors.InvalidArgument:
        ctx.audit("redirect", route.sandbox_id, origin, "invalid_location")
        return
    if not entry.policy.decide_name(target).allowed:
        ctx.audit("redirect", route.sandbox_id, origin, "location_refused", location_host=target.host)
