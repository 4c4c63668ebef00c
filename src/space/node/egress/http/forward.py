"""Stage 3 of an HTTP exchange, forward: the request (as the substitute stage left it) sent upstream, and
the response streamed back through the scrub stage.

Invariants:
- Only the decided route's checked addresses are used (the session's upstream_for); hop-by-hop headers and
  whatever the Connection header names are not forwarded; the Host header is the decided destination.
- When a credential is bound to the host, the upstream is asked for identity encoding, so a response
  echoing a value can be scrubbed (a compressed echo could not).
- A body is streamed, never buffered, except a login form's (ADR 0063): the session reads at most
  MAX_FORM_BODY of it first (`BufferedBody`), and whatever it could not read whole streams after that prefix.
  A bodiless request on a kept-alive upstream connection the server
  had just closed is retried once on a fresh connection; nothing else is retried.
- Every response event passes the scrub stage before the sandbox sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import h11

from space.node.egress.http.decide import Route
from space.node.egress.http.messages import HOP_BY_HOP, Header, connection_tokens
from space.node.egress.http.scrub import ResponseScrubber
from space.node.egress.http.substitute import Substituted
from space.node.egress.policy import Destination
from space.node.egress.upstream import Upstream

_RETRYABLE = (ConnectionError, OSError, h11.RemoteProtocolError)


class ExchangePeers(Protocol):
    """What the forward stage needs of the session: both ends of the exchange."""

    async def client_event(self) -> Any: ...

    async def send_client(self, event: Any) -> None: ...

    async def upstream_event(self, upstream: Upstream) -> Any: ...

    async def upstream_for(self, route: Route) -> tuple[Upstream, bool]: ...

    def close_upstream(self) -> None: ...


@dataclass(frozen=True)
class BufferedBody:
    """Body bytes the session read from the client before sending the head; `complete`: the whole body
    (else the rest is still to be streamed from the client)."""

    data: bytes
    complete: bool


@dataclass(frozen=True)
class OutgoingRequest:
    """The request head as it goes upstream."""

    method: bytes
    target: bytes
    headers: list[Header]
    expects_continue: bool  # the sandbox waits for a 100 before sending its body
    body: BufferedBody | None = None

    @property
    def has_body(self) -> bool:
        return any(
            (n == b"content-length" and v.strip() != b"0") or n == b"transfer-encoding"
            for n, v in self.headers
        )


def host_header_value(destination: Destination, port: int, default: int) -> bytes:
    host = destination.host
    if destination.address is not None and destination.address.version == 6:
        host = f"[{host}]"
    return (host if port == default else f"{host}:{port}").encode()


def outgoing_request(
    request: h11.Request,
    substituted: Substituted,
    route: Route,
    *,
    default_port: int,
    identity_encoding: bool,
) -> OutgoingRequest:
    """The upstream request: substituted head, hop-by-hop headers dropped, Host set to the destination."""
    dropped = connection_tokens(request.headers)
    headers: list[Header] = []
    for name, value in substituted.headers:
        if name in HOP_BY_HOP or name in dropped or name == b"host":
            continue
        if identity_encoding and name == b"accept-encoding":
            continue
        headers.append((name, value))
    headers.insert(0, (b"host", host_header_value(route.destination, route.port, default_port)))
    if identity_encoding:
        # identity encoding, so a response echoing the credential can be scrubbed
        headers.append((b"accept-encoding", b"identity"))
    expects_continue = any(n == b"expect" and v.lower() == b"100-continue" for n, v in request.headers)
    return OutgoingRequest(request.method, substituted.target, headers, expects_continue)


async def send_request(peers: ExchangePeers, route: Route, outgoing: OutgoingRequest) -> tuple[Upstream, Any]:
    """Send the request upstream (its body streamed from the client); the upstream connection used and its
    first response event, if already read (None: not read yet)."""
    if outgoing.expects_continue:
        await peers.send_client(h11.InformationalResponse(status_code=100, headers=[]))
    has_body = outgoing.has_body
    head = h11.Request(method=outgoing.method, target=outgoing.target, headers=outgoing.headers)
    if not has_body and outgoing.body is None:
        await _drain_request(peers)
    for last_try in (False, True):
        upstream, reused = await peers.upstream_for(route)
        try:
            return upstream, await _send(peers, upstream, head, has_body=has_body, body=outgoing.body)
        except _RETRYABLE:
            # a kept-alive upstream connection the server had just closed: one retry on a fresh one
            # (bodiless requests only: a body is streamed, not buffered)
            peers.close_upstream()
            if not reused or last_try:
                raise ConnectionError("upstream connection failed") from None
    raise AssertionError("unreachable: the last try returns or raises")


async def _drain_request(peers: ExchangePeers) -> None:
    while not isinstance(await peers.client_event(), h11.EndOfMessage):
        pass


async def _send(
    peers: ExchangePeers, upstream: Upstream, head: h11.Request, *, has_body: bool, body: BufferedBody | None
) -> Any:
    upstream.writer.write(upstream.conn.send(head) or b"")
    if body is not None:
        if body.data:
            upstream.writer.write(upstream.conn.send(h11.Data(data=body.data)) or b"")
        if body.complete:
            upstream.writer.write(upstream.conn.send(h11.EndOfMessage()) or b"")
            await upstream.writer.drain()
            return None
        await _forward_body(peers, upstream)
        return None
    if has_body:
        await _forward_body(peers, upstream)
        return None
    upstream.writer.write(upstream.conn.send(h11.EndOfMessage()) or b"")
    await upstream.writer.drain()
    first = await peers.upstream_event(upstream)
    if isinstance(first, h11.ConnectionClosed):
        raise ConnectionError("upstream closed before answering")
    return first


async def _forward_body(peers: ExchangePeers, upstream: Upstream) -> None:
    while True:
        event = await peers.client_event()
        if isinstance(event, h11.Data):
            upstream.writer.write(upstream.conn.send(event) or b"")
            await upstream.writer.drain()
        elif isinstance(event, h11.EndOfMessage):
            upstream.writer.write(upstream.conn.send(h11.EndOfMessage()) or b"")
            await upstream.writer.drain()
            return
        else:
            raise ConnectionError("client went away inside a request")


async def relay_response(
    peers: ExchangePeers, upstream: Upstream, first: Any, scrub: ResponseScrubber
) -> None:
    """Stream the upstream's response to the client, every event through `scrub`; trailers are dropped."""
    while True:
        if first is not None:
            event, first = first, None
        else:
            event = await peers.upstream_event(upstream)
        if isinstance(event, h11.InformationalResponse):
            forwarded = scrub.informational(event)
            if forwarded is not None:
                await peers.send_client(forwarded)
        elif isinstance(event, h11.Response):
            await peers.send_client(scrub.head(event))
        elif isinstance(event, h11.Data):
            data = scrub.body(bytes(event.data))
            if data:
                await peers.send_client(h11.Data(data=data))
        elif isinstance(event, h11.EndOfMessage):
            tail = scrub.end()
            if tail:
                await peers.send_client(h11.Data(data=tail))
            await peers.send_client(h11.EndOfMessage(headers=[]))
            return
        else:
            raise ConnectionError("upstream closed inside a response")
