"""The gateway's connection handlers: explicit proxy (HTTP + CONNECT), transparent HTTP, transparent TLS.

Invariants:
- The sandbox is identified only by the source address of its connection; an unknown source gets nothing.
- Every destination (CONNECT target, SNI, or the address dialled when there is no SNI) is normalized and
  decided against the sandbox's current policy before any byte goes upstream; the gateway connects to the
  addresses it checked (pinned), never to a name.
- TLS is terminated only for hosts a credential of the sandbox is bound to (then every request inside runs
  through http.session's stages); every other TLS connection is spliced byte for byte after its ClientHello
  was read and checked (space.node.egress.splice). Not knowing the sandbox's credentials fails closed.
- A CONNECT that is spliced connects upstream before answering, so an unreachable upstream is a 502, not a
  dead tunnel.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

import h11

from space.core import errors
from space.node.egress.addresses import original_destination, original_port, peer_ip
from space.node.egress.context import GatewayContext, SandboxEntry
from space.node.egress.http.messages import Refused
from space.node.egress.http.session import HttpSession
from space.node.egress.policy import Decision, Destination, IPAddress, normalize_host, split_authority
from space.node.egress.splice import Splice, hello_acceptable
from space.node.egress.tls import ClientHello, NotTls, PlainStream, TlsServerStream, read_client_hello
from space.node.egress.upstream import Connected, close_writer

log = logging.getLogger(__name__)


class _Dropped(Exception):
    """The connection is refused (already audited): close it without an answer."""


@dataclass(frozen=True)
class _Tunnel:
    """A TCP connection the policy let through to `destination`:`port` (the checked addresses)."""

    entry: SandboxEntry
    source: str
    destination: Destination
    port: int
    decision: Decision


class Handlers:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    # -- listeners ----------------------------------------------------------------------------------------

    async def proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Explicit proxy: absolute-form HTTP requests and CONNECT tunnels."""
        source = peer_ip(writer)
        client = PlainStream(reader, writer)
        session = HttpSession(self.ctx, source, client, "proxy")
        try:
            event = await session.client_event()
        except (h11.RemoteProtocolError, TimeoutError, ConnectionError, OSError):
            await session.refuse(400, "malformed request")
            return
        if not isinstance(event, h11.Request):
            client.close()
        elif event.method != b"CONNECT":
            await session.run(event)
        else:
            await self._connect(session, reader, writer, event)

    async def transparent_tls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Traffic redirected from port 443 (or another TLS port): decide by SNI."""
        source = peer_ip(writer)
        entry = self.ctx.lookup(source)
        if entry is None:
            close_writer(writer)
            return
        original = original_destination(writer)
        port = original[1] if original else self.ctx.default_ports["tls"]
        try:
            hello, destination = await self._transparent_hello(entry, reader, original)
        except _Dropped:
            close_writer(writer)
            return
        decision = await self.ctx.resolve_checked(entry.policy, destination)
        if not decision.allowed:
            self.ctx.audit_denied(entry.sandbox_id, destination, decision, port)
            close_writer(writer)
            return
        tunnel = _Tunnel(entry, source, destination, port, decision)
        await self._tunnel(tunnel, reader, writer, initial=b"", via="transparent", hello=hello)

    async def transparent_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Traffic redirected from port 80: decide by the Host header of each request."""
        source = peer_ip(writer)
        port = original_port(writer) or self.ctx.default_ports["http"]
        session = HttpSession(self.ctx, source, PlainStream(reader, writer), "transparent", default_port=port)
        await session.run()

    # -- CONNECT ------------------------------------------------------------------------------------------

    async def _connect(
        self,
        session: HttpSession,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> None:
        try:
            tunnel, connected = await self._decide_connect(session.source, request)
        except Refused as refusal:
            await session.refuse(refusal.status, refusal.reason)
            return
        if not await self._established(session, connected):
            return
        trailing, _closed = session.conn.trailing_data
        await self._tunnel(
            tunnel, reader, writer, initial=bytes(trailing), via="connect", connected=connected
        )

    async def _decide_connect(self, source: str, request: h11.Request) -> tuple[_Tunnel, Connected | None]:
        """The decided tunnel, and its upstream connection when it will be spliced; raises Refused."""
        entry = self.ctx.lookup(source)
        if entry is None:
            raise Refused(403, "no egress for this source address")
        try:
            raw_host, port = split_authority(request.target.decode("latin-1"), 443)
            destination = normalize_host(raw_host)
        except errors.InvalidArgument as exc:
            self.ctx.audit("egress", entry.sandbox_id, request.target.decode("latin-1"), "invalid")
            raise Refused(400, exc.message) from exc
        decision = await self.ctx.resolve_checked(entry.policy, destination)
        if not decision.allowed:
            self.ctx.audit_denied(entry.sandbox_id, destination, decision, port)
            raise Refused(403, f"destination {destination.host} refused: {decision.reason}")
        try:
            credentials = await self.ctx.credentials.credentials(entry.sandbox_id)
        except errors.SpaceError as exc:  # fail closed: no tunnel without knowing what to intercept
            raise Refused(503, exc.message) from exc
        connected: Connected | None = None
        if not any(c.binds(destination.host) for c in credentials):
            # spliced: connect before answering, so an unreachable upstream is a 502, not a dead tunnel
            try:
                connected = await self.ctx.connect(decision.addresses, port, tls_host=None)
            except errors.Unavailable as exc:
                raise Refused(502, exc.message) from exc
        return _Tunnel(entry, source, destination, port, decision), connected

    async def _established(self, session: HttpSession, connected: Connected | None) -> bool:
        """Read the rest of the CONNECT request and answer 200; False (all closed) if the client failed."""
        try:
            while True:
                follow = await session.client_event()
                if isinstance(follow, h11.EndOfMessage):
                    break
            await session.send_client(
                h11.Response(status_code=200, headers=[], reason=b"Connection established")
            )
        except (h11.ProtocolError, TimeoutError, ConnectionError, OSError):
            session.client.close()
            if connected is not None:
                close_writer(connected[1])
            return False
        return True

    # -- transparent TLS ----------------------------------------------------------------------------------

    async def _transparent_hello(
        self,
        entry: SandboxEntry,
        reader: asyncio.StreamReader,
        original: tuple[IPAddress, int] | None,
    ) -> tuple[ClientHello, Destination]:
        """The ClientHello and the destination it names; raises _Dropped (audited) for anything else."""
        try:
            hello = await asyncio.wait_for(read_client_hello(reader), timeout=self.ctx.hello_timeout)
        except (NotTls, TimeoutError, ConnectionError, OSError) as exc:
            self.ctx.audit("egress", entry.sandbox_id, "", "refused", reason="not a TLS ClientHello")
            raise _Dropped from exc
        if hello.has_ech or (hello.server_name is None and original is None):
            reason = "encrypted ClientHello" if hello.has_ech else "TLS without server name"
            self.ctx.audit("egress", entry.sandbox_id, "", "refused", reason=reason)
            raise _Dropped
        try:
            if hello.server_name is not None:
                return hello, normalize_host(hello.server_name)
            # no SNI (clients send none for IP literals): the address the sandbox dialled is decided
            assert original is not None
            return hello, normalize_host(str(original[0]))
        except errors.InvalidArgument as exc:
            self.ctx.audit("egress", entry.sandbox_id, (hello.server_name or "")[:255], "invalid")
            raise _Dropped from exc

    # -- after the decision: intercept or splice ----------------------------------------------------------

    async def _tunnel(
        self,
        tunnel: _Tunnel,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        initial: bytes,
        via: Literal["connect", "transparent"],
        hello: ClientHello | None = None,
        connected: Connected | None = None,
    ) -> None:
        sandbox_id, destination = tunnel.entry.sandbox_id, tunnel.destination
        try:
            intercept = connected is None and await self._binds_credential(sandbox_id, destination)
            if hello is None and intercept:
                hello = await self._read_hello(sandbox_id, destination, reader, initial)
            if hello is not None and not hello_acceptable(self.ctx, sandbox_id, destination, hello):
                raise _Dropped
        except _Dropped:
            close_writer(writer)
            return
        if hello is not None:
            initial = hello.raw
        mode = f"{via}-intercept" if intercept else f"{via}-splice"
        self.ctx.audit("egress", sandbox_id, destination.host, "allowed", port=tunnel.port, mode=mode)
        if intercept:
            await self._intercept(tunnel, reader, writer, initial=initial)
            return
        if connected is None:
            try:
                connected = await self.ctx.connect(tunnel.decision.addresses, tunnel.port, tls_host=None)
            except errors.Unavailable:
                close_writer(writer)
                return
        splice = Splice(self.ctx, sandbox_id, destination, (reader, writer), connected)
        await splice.run(initial, hello_checked=hello is not None)

    async def _binds_credential(self, sandbox_id: str, destination: Destination) -> bool:
        """Is a credential of the sandbox bound to the destination (then TLS is terminated)?"""
        try:
            credentials = await self.ctx.credentials.credentials(sandbox_id)
        except errors.SpaceError as exc:  # fail closed, as for CONNECT: unknown what to intercept
            self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason=exc.message)
            raise _Dropped from exc
        return any(c.binds(destination.host) for c in credentials)

    async def _read_hello(
        self, sandbox_id: str, destination: Destination, reader: asyncio.StreamReader, initial: bytes
    ) -> ClientHello:
        try:
            return await asyncio.wait_for(read_client_hello(reader, initial), timeout=self.ctx.hello_timeout)
        except (NotTls, TimeoutError, ConnectionError, OSError) as exc:
            self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason="expected TLS")
            raise _Dropped from exc

    async def _intercept(
        self, tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, initial: bytes
    ) -> None:
        host = tunnel.destination.host
        context = self.ctx.ca.cached_context(host)
        if context is None:  # minting a certificate takes a few ms of CPU: not on the event loop
            context = await asyncio.to_thread(self.ctx.ca.server_context, host)
        stream = TlsServerStream(reader, writer, context, initial)
        try:
            await asyncio.wait_for(stream.handshake(), timeout=self.ctx.hello_timeout)
        except (TimeoutError, ConnectionError, OSError) as exc:
            log.debug("sandbox TLS handshake failed: %s", exc)
            close_writer(writer)
            return
        fixed = (tunnel.destination, tunnel.port)
        session = HttpSession(self.ctx, tunnel.source, stream, "intercepted", fixed=fixed)
        await session.run()
