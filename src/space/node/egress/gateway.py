"""EgressGateway: the node's single way out for sandbox traffic.

Invariants:
- A source address maps to at most one sandbox; `set_policy` replaces the sandbox's compiled policy in one
  assignment, so the very next request (and DNS query) is decided under it; connections it no longer allows
  are closed at once.
- `forget` removes the sandbox: its source address gets nothing and its open connections are closed.
- No policy means no egress.
- `set_policy`/`forget` may be called from another thread: the maps change at once, closing connections is
  handed to the gateway's loop.
- Every TCP connection a source opens (proxy, transparent listeners, DNS over TCP) counts against
  `max_connections_per_source`; DNS queries are capped per source and in total (space.node.egress.dns).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h11

from space.core import errors
from space.node.egress.addresses import plain_ip
from space.node.egress.context import AuditCallback, GatewayContext, SandboxEntry
from space.node.egress.credentials import CredentialSource
from space.node.egress.dns import (
    MAX_QUERIES_PER_SOURCE,
    MAX_UDP_IN_FLIGHT,
    DnsServer,
    DnsService,
    QueryLimits,
    Resolver,
    SystemResolver,
)
from space.node.egress.handlers import Handlers
from space.node.egress.policy import CompiledPolicy, EgressPolicy, IPNetwork
from space.node.egress.tls import CertificateAuthority, upstream_context

PORT_NAMES = ("proxy", "transparent_http", "transparent_tls", "dns")
# OSError covers ssl.SSLError and connection resets; EOFError covers asyncio.IncompleteReadError.
_PEER_FAILURES = (
    OSError,
    EOFError,
    TimeoutError,
    asyncio.LimitOverrunError,
    h11.ProtocolError,
    errors.SpaceError,
)
ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
log = logging.getLogger(__name__)


class EgressGateway:
    def __init__(
        self,
        *,
        ca_dir: Path,
        credentials: CredentialSource,
        audit: AuditCallback,
        resolver: Resolver | None = None,
        listen_host: str = "127.0.0.1",
        listen_ports: Mapping[str, int] | None = None,
        trust_store: Path | None = None,
        upstream_ssl: ssl.SSLContext | None = None,
        operator_allowed_networks: Sequence[IPNetwork] = (),
        transparent_default_ports: Mapping[str, int] | None = None,
        max_connections_per_source: int = 512,
        dns_queries_per_source: int = MAX_QUERIES_PER_SOURCE,
        dns_queries_total: int = MAX_UDP_IN_FLIGHT,
    ) -> None:
        """`listen_ports` (default: all 0 = any free port); `trust_store`: PEM file/directory the upstream
        certificates are verified against (default: the system store); `operator_allowed_networks`: ranges
        the operator (never a tenant policy) opens although they are normally unreachable, e.g. loopback for
        a benchmark; `transparent_default_ports`: upstream ports for redirected traffic when the original
        destination port cannot be read ({"http": 80, "tls": 443}); `max_connections_per_source`: client
        connections one source address may hold at once, TCP DNS connections included (more are closed at
        once: one sandbox cannot use up the gateway's file descriptors); `dns_queries_per_source`,
        `dns_queries_total`: DNS queries being answered at once for one source and for all (UDP + TCP)."""
        self.ca = CertificateAuthority(ca_dir)
        self.listen_host = listen_host
        self._wanted_ports = {name: int((listen_ports or {}).get(name, 0)) for name in PORT_NAMES}
        self._operator_allowed = tuple(operator_allowed_networks)
        self.ctx = GatewayContext(
            ca=self.ca,
            credentials=credentials,
            audit_callback=audit,
            resolver=resolver or SystemResolver(),
            upstream_ssl=upstream_ssl or upstream_context(trust_store),
        )
        if transparent_default_ports:
            self.ctx.default_ports.update(transparent_default_ports)
        self._handlers = Handlers(self.ctx)
        self._servers: list[asyncio.Server] = []
        self._dns = DnsServer(
            DnsService(self._dns_lookup, self.ctx.resolver, self._dns_audit),
            limits=QueryLimits(per_source=dns_queries_per_source, total=dns_queries_total),
            wrap_tcp=self._wrap,
        )
        self._ports: dict[str, int] = {}
        self._connections: set[asyncio.Task[None]] = set()
        self._per_source: collections.Counter[str] = collections.Counter()
        self.max_connections_per_source = max_connections_per_source
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._servers:
            return
        self._loop = asyncio.get_running_loop()
        handlers = {
            "proxy": self._handlers.proxy,
            "transparent_http": self._handlers.transparent_http,
            "transparent_tls": self._handlers.transparent_tls,
        }
        try:
            for name, handler in handlers.items():
                server = await asyncio.start_server(
                    self._wrap(handler), self.listen_host, self._wanted_ports[name], limit=256 * 1024
                )
                self._servers.append(server)
                self._ports[name] = int(server.sockets[0].getsockname()[1])
            self._ports["dns"] = await self._dns.start(self.listen_host, self._wanted_ports["dns"])
        except OSError as exc:
            await self.close()
            raise errors.Unavailable(f"egress gateway cannot listen on {self.listen_host}: {exc}") from exc

    def _wrap(self, handler: ConnectionHandler) -> ConnectionHandler:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")
            source = plain_ip(str(peer[0])) if isinstance(peer, tuple) else ""
            if self._per_source[source] >= self.max_connections_per_source:
                entry = self.ctx.lookup(source)
                if entry is not None:
                    self.ctx.audit("egress", entry.sandbox_id, "", "refused", reason="too many connections")
                writer.close()
                return
            self._per_source[source] += 1
            task = asyncio.current_task()
            if task is not None:
                self._connections.add(task)
            try:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await handler(reader, writer)
            except _PEER_FAILURES:  # what a misbehaving peer or network causes: routine, not a bug here
                log.debug("egress connection failed", exc_info=True)
                writer.close()
            except Exception:  # a bug: loud, but one broken connection must not take the listener down
                log.warning("egress connection handler failed", exc_info=True)
                writer.close()
            finally:
                self._per_source[source] -= 1
                if self._per_source[source] <= 0:
                    del self._per_source[source]
                if task is not None:
                    self._connections.discard(task)

        return run

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for _ident, (_sandbox, connection) in list(self.ctx.active.items()):
            connection.close()
        await self._dns.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=5)
        self._servers.clear()

    # -- sandboxes -------------------------------------------------------------------------------------

    @property
    def ports(self) -> dict[str, int]:
        return dict(self._ports)

    @property
    def ca_certificate_pem(self) -> bytes:
        return self.ca.certificate_pem

    def set_policy(self, sandbox_id: str, source_addr: str, policy: EgressPolicy) -> None:
        source = plain_ip(source_addr)
        owner = self.ctx.by_source.get(source)
        if owner is not None and owner != sandbox_id:
            raise errors.Conflict(
                f"source address {source} already belongs to sandbox {owner}", source_addr=source
            )
        compiled = CompiledPolicy(policy, operator_allowed=self._operator_allowed)
        previous = self.ctx.sandboxes.get(sandbox_id)
        if previous is not None and previous.source_addr != source:
            self.ctx.by_source.pop(previous.source_addr, None)
        entry = SandboxEntry(sandbox_id, source, compiled)
        if previous is not None:
            entry.connections = previous.connections
        self.ctx.sandboxes[sandbox_id] = entry
        self.ctx.by_source[source] = sandbox_id
        self._on_loop(self._enforce, entry)

    def _on_loop(self, function: Callable[..., None], *args: Any) -> None:
        """Run now on the gateway's loop, or hand over to it when called from another thread (transports
        are not thread-safe). The policy itself is already in force: it was swapped in one assignment."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is None or running is self._loop or self._loop.is_closed():
            function(*args)
        else:
            self._loop.call_soon_threadsafe(function, *args)

    def policy(self, sandbox_id: str) -> EgressPolicy | None:
        entry = self.ctx.sandboxes.get(sandbox_id)
        return entry.policy.policy if entry else None

    def forget(self, sandbox_id: str) -> None:
        entry = self.ctx.sandboxes.pop(sandbox_id, None)
        if entry is None:
            return
        if self.ctx.by_source.get(entry.source_addr) == sandbox_id:
            del self.ctx.by_source[entry.source_addr]
        self._on_loop(self._close_all, entry)

    def _close_all(self, entry: SandboxEntry) -> None:
        for ident in list(entry.connections):
            found = self.ctx.active.pop(ident, None)
            if found is not None:
                found[1].close()
        self.ctx.pool_drop_sandbox(entry.sandbox_id)

    def _enforce(self, entry: SandboxEntry) -> None:
        """Close open connections the (new) policy no longer allows."""
        for ident in list(entry.connections):
            found = self.ctx.active.get(ident)
            if found is None:
                entry.connections.discard(ident)
                continue
            connection = found[1]
            name_ok = entry.policy.decide_name(connection.destination).allowed
            address_ok = entry.policy.decide_address(
                connection.address, literal=connection.destination.is_address
            ).allowed
            if not (name_ok and address_ok):
                self.ctx.untrack(ident)
                connection.close()
                self.ctx.audit("egress", entry.sandbox_id, connection.destination.host, "closed_by_policy")

    # -- DNS -------------------------------------------------------------------------------------------

    def _dns_lookup(self, source: str) -> tuple[str, CompiledPolicy] | None:
        entry = self.ctx.lookup(source)
        return (entry.sandbox_id, entry.policy) if entry else None

    def _dns_audit(self, sandbox_id: str, host: str, decision: str) -> None:
        if decision != "answered":
            self.ctx.audit("dns", sandbox_id, host, decision)
