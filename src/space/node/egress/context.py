"""What every connection handler of the gateway shares: the sandboxes by source address, their policies,
the upstream connections they hold, the idle-connection pool and the audit sink. Owned by EgressGateway.

Invariants:
- A source address maps to at most one sandbox; an unknown source gets nothing (`lookup` is None).
- Every open upstream connection is tracked under its sandbox, so a policy change or `forget` can close it.
- An idle upstream connection is reused only for the same sandbox, host, port, TLS-ness and checked
  address (the pool key), and only while alive and idle for less than `pool_idle_seconds`.
- A decision resolves names only when the policy allows the name, and never lets an address of the node
  itself through unless the operator opened it.
- An audit sink that fails is logged, never raised into the data path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from space.node.egress.addresses import plain_ip
from space.node.egress.credentials import CredentialSource, RateLimiter
from space.node.egress.dns import Resolver, is_local_address
from space.node.egress.policy import CompiledPolicy, Decision, Destination, IPAddress
from space.node.egress.tls import CertificateAuthority
from space.node.egress.upstream import Connected, Upstream, UpstreamKey, close_writer, connect

log = logging.getLogger(__name__)

AuditCallback = Callable[[dict[str, Any]], None]
#: How a request reached the gateway: explicit proxy, redirected plain HTTP, or inside terminated TLS.
Mode = Literal["proxy", "transparent", "intercepted"]


@dataclass
class ActiveConnection:
    """An upstream connection a sandbox holds; closed when a policy change no longer allows it."""

    destination: Destination
    address: IPAddress
    close: Callable[[], None]


@dataclass
class SandboxEntry:
    sandbox_id: str
    source_addr: str
    policy: CompiledPolicy
    connections: set[int] = field(default_factory=set)


@dataclass
class GatewayContext:
    """What every handler needs; owned by EgressGateway."""

    ca: CertificateAuthority
    credentials: CredentialSource
    audit_callback: AuditCallback
    resolver: Resolver
    upstream_ssl: Any  # ssl.SSLContext
    by_source: dict[str, str] = field(default_factory=dict)
    sandboxes: dict[str, SandboxEntry] = field(default_factory=dict)
    active: dict[int, tuple[str, ActiveConnection]] = field(default_factory=dict)
    limiter: RateLimiter = field(default_factory=RateLimiter)
    connect_timeout: float = 10.0
    idle_timeout: float = 300.0
    tunnel_idle_timeout: float = 300.0  # a spliced tunnel silent both ways this long is closed
    hello_timeout: float = 10.0
    default_ports: dict[str, int] = field(default_factory=lambda: {"http": 80, "tls": 443})
    pool: dict[UpstreamKey, list[Upstream]] = field(default_factory=dict)
    pool_idle_seconds: float = 30.0
    pool_per_key: int = 8
    _next_id: int = 0

    # -- sandboxes and audit ------------------------------------------------------------------------------

    def lookup(self, source: str) -> SandboxEntry | None:
        sandbox_id = self.by_source.get(plain_ip(source))
        return self.sandboxes.get(sandbox_id) if sandbox_id else None

    def audit(
        self,
        event: str,
        sandbox_id: str,
        host: str,
        decision: str,
        credential: str | None = None,
        **extra: Any,
    ) -> None:
        record: dict[str, Any] = {
            "event": event,
            "sandbox_id": sandbox_id,
            "credential": credential,
            "host": host,
            "ts": time.time(),
            "decision": decision,
        }
        record.update(extra)
        try:
            self.audit_callback(record)
        except Exception:  # an audit sink failing must not open or break the data path
            log.exception("egress audit callback failed")

    def audit_denied(self, sandbox_id: str, destination: Destination, decision: Decision, port: int) -> None:
        self.audit("egress", sandbox_id, destination.host, "denied", reason=decision.reason, port=port)

    async def resolve_checked(self, policy: CompiledPolicy, destination: Destination) -> Decision:
        decision = policy.decide_name(destination)
        if decision.allowed and not destination.is_address:
            addresses = await self.resolver.resolve(destination.host)
            decision = policy.filter_addresses(destination, addresses)
        if not decision.allowed:
            return decision
        # The gateway runs on the node: an address of the node itself (e.g. a host-side veth address inside
        # an allowed private range) would reach the node's own services. Never, unless the operator says so.
        kept = tuple(a for a in decision.addresses if policy.operator_allows(a) or not is_local_address(a))
        if not kept:
            return Decision(False, "address of the node itself", destination.host)
        return Decision(True, decision.reason, decision.host, kept)

    # -- upstream connections -----------------------------------------------------------------------------

    async def connect(
        self, addresses: tuple[IPAddress, ...], port: int, *, tls_host: str | None
    ) -> Connected:
        """Connect to the first reachable checked address; with `tls_host`, over verified TLS."""
        return await connect(
            addresses, port, tls_host=tls_host, tls_context=self.upstream_ssl, timeout=self.connect_timeout
        )

    def track(self, sandbox_id: str, connection: ActiveConnection) -> int:
        self._next_id += 1
        ident = self._next_id
        self.active[ident] = (sandbox_id, connection)
        entry = self.sandboxes.get(sandbox_id)
        if entry is not None:
            entry.connections.add(ident)
        return ident

    def untrack(self, ident: int) -> None:
        found = self.active.pop(ident, None)
        if found is not None:
            entry = self.sandboxes.get(found[0])
            if entry is not None:
                entry.connections.discard(ident)

    def discard(self, upstream: Upstream) -> None:
        """Stop tracking an upstream connection and close it."""
        self.untrack(upstream.track_id)
        close_writer(upstream.writer)

    def pool_take(self, key: UpstreamKey) -> Upstream | None:
        """An idle upstream connection of the same sandbox to the same checked address, if one is alive."""
        idle = self.pool.get(key)
        now = time.monotonic()
        while idle:
            upstream = idle.pop()
            if upstream.alive() and now - upstream.idle_since < self.pool_idle_seconds:
                return upstream
            self.discard(upstream)
        self.pool.pop(key, None)
        return None

    def pool_put(self, key: UpstreamKey, upstream: Upstream) -> None:
        idle = self.pool.setdefault(key, [])
        now = time.monotonic()
        for stale in [u for u in idle if now - u.idle_since >= self.pool_idle_seconds or not u.alive()]:
            idle.remove(stale)
            self.discard(stale)
        if len(idle) >= self.pool_per_key:
            self.discard(upstream)
            return
        upstream.idle_since = now
        idle.append(upstream)

    def pool_drop_sandbox(self, sandbox_id: str) -> None:
        for key in [k for k in self.pool if k[0] == sandbox_id]:
            for upstream in self.pool.pop(key):
                self.discard(upstream)
