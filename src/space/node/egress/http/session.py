"""One client connection speaking HTTP/1.1 to the gateway (explicit proxy, redirected plain HTTP, or the
requests inside terminated TLS), each request run through the exchange's stages:
decide (http.decide) → substitute (http.substitute) → forward (http.forward) → scrub (http.scrub).

Invariants:
- Requests on one connection are handled one after the other; each is decided afresh.
- A refusal is answered by the gateway itself (with `x-space-egress: refused`) and ends the connection.
- The upstream connection a session holds belongs to one (sandbox, host, port, tls, address); it is reused
  for the next request only if that request was decided to the same key, and handed to the pool only when
  idle and healthy. A half-finished upstream exchange is never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
from typing import Any

import h11

from space.core import errors
from space.node.egress.context import ActiveConnection, GatewayContext, Mode
from space.node.egress.credentials import Credential
from space.node.egress.http.decide import Route, decide, note_redirect
from space.node.egress.http.forward import BufferedBody, outgoing_request, relay_response, send_request
from space.node.egress.http.messages import MAX_HEAD, Refused, next_event
from space.node.egress.http.scrub import ConnectionSecrets, ResponseScrubber
from space.node.egress.http.substitute import (
    MAX_FORM_BODY,
    Substituted,
    login_credentials,
    substitute_credentials,
    substitute_login_body,
)
from space.node.egress.http.target import TargetRules
from space.node.egress.policy import Destination
from space.node.egress.tls import PlainStream, TlsServerStream
from space.node.egress.upstream import Upstream, close_writer


class HttpSession:
    def __init__(
        self,
        ctx: GatewayContext,
        source: str,
        client: PlainStream | TlsServerStream,
        mode: Mode,
        *,
        fixed: tuple[Destination, int] | None = None,
        default_port: int = 80,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.client = client
        self.mode = mode
        self.rules = TargetRules(mode, fixed, default_port)
        self.upstream: Upstream | None = None
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.secrets = ConnectionSecrets()

    # -- both ends (http.forward.ExchangePeers) -----------------------------------------------------------

    async def client_event(self) -> Any:
        return await next_event(self.conn, self.client.read, self.ctx.idle_timeout)

    async def upstream_event(self, upstream: Upstream) -> Any:
        return await next_event(upstream.conn, upstream.reader.read, self.ctx.idle_timeout)

    async def send_client(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.client.write(data)

    async def _answer(self, status: int, reason: str) -> None:
        """A response made by the gateway itself (refusals); the connection closes after it."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = f"space egress gateway: {reason}\n".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"x-space-egress", b"refused"),
        ]
        with contextlib.suppress(h11.LocalProtocolError, ConnectionError, OSError):
            await self.send_client(h11.Response(status_code=status, headers=headers))
            await self.send_client(h11.Data(data=body))
            await self.send_client(h11.EndOfMessage())

    async def refuse(self, status: int, reason: str) -> None:
        """Answer with a refusal and close the client connection (nothing more happens on it)."""
        await self._answer(status, reason)
        self.client.close()

    # -- the request loop ---------------------------------------------------------------------------------

    async def run(self, first: h11.Request | None = None) -> None:
        try:
            event: Any = first
            while True:
                if event is None:
                    event = await self.client_event()
                if not isinstance(event, h11.Request):  # h11.ConnectionClosed, or nothing we serve
                    return
                try:
                    await self._exchange(event)
                except Refused as refusal:
                    await self._answer(refusal.status, refusal.reason)
                    return
                if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                    return
                self.conn.start_next_cycle()
                event = None
        except h11.RemoteProtocolError as exc:
            await self._answer(400, f"malformed request ({exc})")
        except errors.SpaceError as exc:  # upstream unreachable, credential source unavailable
            await self._answer(502 if isinstance(exc, errors.Unavailable) else 500, exc.message)
        except (TimeoutError, ConnectionError, OSError, h11.LocalProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            self.release_upstream()
            self.client.close()

    async def _exchange(self, request: h11.Request) -> None:
        """One request through the stages; raises Refused when a stage refuses it."""
        route = await decide(self.ctx, self.source, request, self.rules)
        credentials = await self.ctx.credentials.credentials(route.sandbox_id)
        substituted = substitute_credentials(
            credentials,
            route,
            [(n, v) for n, v in request.headers],
            limiter=self.ctx.limiter,
            encrypted=self.mode == "intercepted",
            audit=self.ctx.audit,
        )
        logins = login_credentials(
            credentials, route, method=request.method, encrypted=self.mode == "intercepted"
        )
        body: BufferedBody | None = None
        sent_continue = False
        if logins and _has_body(request.headers):
            sent_continue = _expects_continue(request.headers)
            if sent_continue:  # the sandbox waits for it before sending the form we must read first
                await self.send_client(h11.InformationalResponse(status_code=100, headers=[]))
            body, substituted = await self._login_body(request, route, logins, substituted)
        scrubber = self.secrets.scrubber(substituted)
        outgoing = outgoing_request(
            request,
            substituted,
            route,
            default_port=443 if self.mode == "intercepted" else 80,
            identity_encoding=scrubber.active,
        )
        if body is not None:
            outgoing = dataclasses.replace(
                outgoing, body=body, expects_continue=outgoing.expects_continue and not sent_continue
            )
        upstream, first = await send_request(self, route, outgoing)

        def on_location(location: bytes) -> None:
            note_redirect(self.ctx, self.source, route, location)

        await relay_response(self, upstream, first, ResponseScrubber(scrubber, on_location))
        if upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE:
            upstream.conn.start_next_cycle()
        else:
            self.close_upstream()

    async def _login_body(
        self, request: h11.Request, route: Route, logins: list[Credential], substituted: Substituted
    ) -> tuple[BufferedBody, Substituted]:
        """Read a possible login form's body (at most MAX_FORM_BODY) and write the credentials into its
        fields; a bigger body keeps its framing and the rest streams after the prefix read here."""
        data = bytearray()
        complete = False
        while len(data) <= MAX_FORM_BODY:
            event = await self.client_event()
            if isinstance(event, h11.EndOfMessage):
                complete = True
                break
            if not isinstance(event, h11.Data):
                raise ConnectionError("client went away inside a request")
            data += event.data
        content_type = next((v for n, v in request.headers if n == b"content-type"), None)
        new = substitute_login_body(
            logins,
            route,
            bytes(data) if complete else None,
            content_type,
            limiter=self.ctx.limiter,
            audit=self.ctx.audit,
        )
        if new is None:
            return BufferedBody(bytes(data), False), substituted
        # the body is sent whole with its new length (a value's encoding differs from its placeholder's)
        framing = (b"content-length", b"transfer-encoding")
        headers = [(n, v) for n, v in substituted.headers if n not in framing]
        headers.append((b"content-length", str(len(new)).encode()))
        return BufferedBody(new, True), dataclasses.replace(substituted, headers=headers)

    # -- the upstream connection --------------------------------------------------------------------------

    def close_upstream(self) -> None:
        if self.upstream is not None:
            self.ctx.discard(self.upstream)
            self.upstream = None

    def release_upstream(self) -> None:
        """Keep a healthy idle upstream connection for the sandbox's next client connection."""
        upstream = self.upstream
        if upstream is None:
            return
        self.upstream = None
        idle = upstream.conn.our_state is h11.IDLE and upstream.conn.their_state is h11.IDLE
        if idle and upstream.alive():
            self.ctx.pool_put(upstream.key, upstream)
        else:
            self.ctx.discard(upstream)

    async def upstream_for(self, route: Route) -> tuple[Upstream, bool]:
        """The upstream connection for this request and whether it was used before."""
        use_tls = self.mode == "intercepted"
        host, port, addresses = route.destination.host, route.port, route.addresses
        current = self.upstream
        if current is not None:
            same = current.key[:4] == (route.sandbox_id, host, port, use_tls)
            if same and current.alive() and ipaddress.ip_address(current.key[4]) in addresses:
                return current, True
            self.release_upstream()
        for address in addresses:
            pooled = self.ctx.pool_take((route.sandbox_id, host, port, use_tls, str(address)))
            if pooled is not None:
                self.upstream = pooled
                return pooled, True
        reader, writer, address = await self.ctx.connect(addresses, port, tls_host=host if use_tls else None)

        def close() -> None:
            # the next request on this client connection is decided afresh; an exchange in flight breaks
            close_writer(writer)

        track = self.ctx.track(route.sandbox_id, ActiveConnection(route.destination, address, close))
        key = (route.sandbox_id, host, port, use_tls, str(address))
        upstream_conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.upstream = Upstream(key, reader, writer, upstream_conn, track)
        return self.upstream, False


def _has_body(headers: Any) -> bool:
    return any(
        (n == b"content-length" and v.strip() != b"0") or n == b"transfer-encoding" for n, v in headers
    )


def _expects_continue(headers: Any) -> bool:
    return any(n == b"expect" and v.lower() == b"100-continue" for n, v in headers)
