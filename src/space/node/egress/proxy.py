"""The gateway's connection handlers: explicit proxy (HTTP + CONNECT), transparent HTTP, transparent TLS.

Invariants:
- The sandbox is identified only by the source address of its connection (the node's network setup makes
  that address unforgeable); an unknown source gets nothing.
- Every HTTP request (also the second and later ones on a kept-alive connection, and every request that
  follows a redirect: the gateway never follows redirects itself) is decided afresh against the sandbox's
  current policy, on the normalized destination. The gateway connects to the addresses it checked (pinned),
  never to a name, and never to an address of the node itself (unless the operator opened it).
- TLS is terminated only for hosts a credential of the sandbox is bound to; every other TLS connection is
  spliced byte for byte after its ClientHello was read (to learn and check the SNI). The SNI must name the
  host the decision was made for (CONNECT target), and on terminated connections every Host header must
  name the SNI host; ECH (which hides the real server name) is refused.
- Credentials are substituted only by credentials.substitute(); every response from a host a credential is
  bound to is scrubbed of credential values (headers, informational responses, body; trailers are dropped)
  before the sandbox sees it.
- An idle upstream connection is reused only for the same sandbox, host, port and checked address, and only
  after the new request itself was decided.
- A spliced tunnel that moved no byte in either direction for `tunnel_idle_timeout` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import h11

from space.core import errors
from space.node.egress.credentials import (
    Credential,
    CredentialSource,
    RateLimiter,
    Scrubber,
    substitute,
)
from space.node.egress.dns import Resolver, is_local_address
from space.node.egress.policy import (
    CompiledPolicy,
    Decision,
    Destination,
    IPAddress,
    normalize_host,
    split_authority,
)
from space.node.egress.tls import (
    CertificateAuthority,
    ClientHello,
    NotTls,
    PlainStream,
    TlsServerStream,
    read_client_hello,
)

log = logging.getLogger(__name__)

AuditCallback = Callable[[dict[str, Any]], None]
Mode = Literal["proxy", "transparent", "intercepted"]

HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authorization",
    b"proxy-authenticate",
    b"te",
    b"trailer",
    b"upgrade",
    b"expect",
}
READ_SIZE = 256 * 1024
MAX_HEAD = 64 * 1024  # request/response head (big cookies, long URLs)
SO_ORIGINAL_DST = 80


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
    pool: dict[tuple[str, str, int, bool, str], list[_Upstream]] = field(default_factory=dict)
    pool_idle_seconds: float = 30.0
    pool_per_key: int = 8
    _next_id: int = 0

    def pool_take(self, key: tuple[str, str, int, bool, str]) -> _Upstream | None:
        """An idle upstream connection of the same sandbox to the same checked address, if one is alive."""
        idle = self.pool.get(key)
        now = time.monotonic()
        while idle:
            upstream = idle.pop()
            if upstream.alive() and now - upstream.idle_since < self.pool_idle_seconds:
                return upstream
            self.untrack(upstream.track_id)
            _close(upstream.writer)
        self.pool.pop(key, None)
        return None

    def pool_put(self, key: tuple[str, str, int, bool, str], upstream: _Upstream) -> None:
        idle = self.pool.setdefault(key, [])
        now = time.monotonic()
        for stale in [u for u in idle if now - u.idle_since >= self.pool_idle_seconds or not u.alive()]:
            idle.remove(stale)
            self.untrack(stale.track_id)
            _close(stale.writer)
        if len(idle) >= self.pool_per_key:
            self.untrack(upstream.track_id)
            _close(upstream.writer)
            return
        upstream.idle_since = now
        idle.append(upstream)

    def pool_drop_sandbox(self, sandbox_id: str) -> None:
        for key in [k for k in self.pool if k[0] == sandbox_id]:
            for upstream in self.pool.pop(key):
                self.untrack(upstream.track_id)
                _close(upstream.writer)

    def lookup(self, source: str) -> SandboxEntry | None:
        sandbox_id = self.by_source.get(_plain_ip(source))
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


def _plain_ip(address: str) -> str:
    try:
        parsed = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def _peer_ip(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return _plain_ip(str(peer[0])) if isinstance(peer, tuple) else ""


def original_destination(writer: asyncio.StreamWriter) -> tuple[IPAddress, int] | None:
    """The destination before an nftables redirect (SO_ORIGINAL_DST), None if the connection was not
    redirected (or conntrack does not know it)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    local = writer.get_extra_info("sockname")
    try:
        if sock.family == socket.AF_INET:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET, raw[4:8])
        else:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
    except OSError:
        return None
    if isinstance(local, tuple) and (address, port) == (str(local[0]), int(local[1])):
        return None
    return ipaddress.ip_address(address), int(port)


def original_port(writer: asyncio.StreamWriter) -> int | None:
    found = original_destination(writer)
    return found[1] if found else None


async def _connect(
    ctx: GatewayContext,
    addresses: tuple[IPAddress, ...],
    port: int,
    *,
    tls_host: str | None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress]:
    """Connect to the first reachable checked address (never to a name: the check is pinned)."""
    last: Exception | None = None
    for address in addresses:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    str(address),
                    port,
                    ssl=ctx.upstream_ssl if tls_host is not None else None,
                    server_hostname=tls_host,
                    limit=READ_SIZE,
                ),
                timeout=ctx.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            last = exc
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer, address
    raise errors.Unavailable(f"cannot connect upstream on port {port}: {last}")


class _Activity:
    """When a spliced tunnel last moved a byte in either direction (loop time)."""

    def __init__(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last = asyncio.get_running_loop().time()


async def _close_when_idle(activity: _Activity, idle_s: float, close: Callable[[], None]) -> None:
    """Close a spliced tunnel once neither direction moved a byte for `idle_s`: a sandbox cannot keep
    thousands of silent tunnels (file descriptors, upstream sockets) open forever."""
    loop = asyncio.get_running_loop()
    while True:
        remaining = activity.last + idle_s - loop.time()
        if remaining <= 0:
            close()
            return
        await asyncio.sleep(remaining)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: _Activity | None = None
) -> None:
    try:
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                break
            if activity is not None:
                activity.touch()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


# ---------------------------------------------------------------------------------------------------------
# HTTP exchange (explicit proxy, transparent HTTP, and requests inside intercepted TLS)


@dataclass
class _Upstream:
    key: tuple[str, str, int, bool, str]  # sandbox, host, port, tls, pinned address
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h11.Connection
    track_id: int
    idle_since: float = 0.0

    def alive(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


class _Refused(Exception):
    def __init__(self, status: int, reason: str, *, close: bool = True) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close


def _host_header_value(destination: Destination, port: int, default: int) -> bytes:
    host = destination.host
    if destination.address is not None and destination.address.version == 6:
        host = f"[{host}]"
    return (host if port == default else f"{host}:{port}").encode()


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
        self.fixed = fixed
        self.default_port = default_port
        self.upstream: _Upstream | None = None
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.injected_forms: set[bytes] = set()

    async def _next_event(self, conn: h11.Connection, read: Callable[[int], Awaitable[bytes]]) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await asyncio.wait_for(read(READ_SIZE), timeout=self.ctx.idle_timeout))

    async def _client_event(self) -> Any:
        return await self._next_event(self.conn, self.client.read)

    async def _upstream_event(self, upstream: _Upstream) -> Any:
        return await self._next_event(upstream.conn, upstream.reader.read)

    async def _send_client(self, event: Any) -> None:
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
            await self._send_client(h11.Response(status_code=status, headers=headers))
            await self._send_client(h11.Data(data=body))
            await self._send_client(h11.EndOfMessage())

    async def refuse(self, status: int, reason: str) -> None:
        """Answer with a refusal and close the client connection (nothing more happens on it)."""
        await self._answer(status, reason)
        self.client.close()

    def close_upstream(self) -> None:
        if self.upstream is not None:
            self.ctx.untrack(self.upstream.track_id)
            _close(self.upstream.writer)
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
            self.ctx.untrack(upstream.track_id)
            _close(upstream.writer)

    async def run(self, first: h11.Request | None = None) -> None:
        try:
            event: Any = first
            while True:
                if event is None:
                    event = await self._client_event()
                if isinstance(event, h11.ConnectionClosed):
                    return
                if not isinstance(event, h11.Request):
                    return
                try:
                    keep = await self._exchange(event)
                except _Refused as refusal:
                    await self._answer(refusal.status, refusal.reason)
                    return
                if not keep or self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
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

    def _target(self, request: h11.Request) -> tuple[Destination, int, bytes]:
        """Destination, port and origin-form target of a request, refusing inconsistent ones."""
        raw_target = request.target.decode("latin-1")
        hosts = [v.decode("latin-1") for n, v in request.headers if n == b"host"]
        if len(hosts) > 1:
            raise _Refused(400, "more than one Host header")
        host_header = hosts[0] if hosts else None
        absolute: tuple[str, str] | None = None
        lowered = raw_target.lower()
        if lowered.startswith("http://") or lowered.startswith("https://"):
            scheme, rest = raw_target.split("://", 1)
            cut = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
            authority, path = rest[:cut], rest[cut:] or "/"
            if path.startswith("?"):
                path = "/" + path
            absolute = (scheme.lower(), authority)
            origin = path
        elif raw_target.startswith("/") or (raw_target == "*" and request.method == b"OPTIONS"):
            origin = raw_target
        else:
            raise _Refused(400, "unsupported request target form")
        try:
            if self.mode == "proxy":
                if absolute is None:
                    raise _Refused(400, "a proxy request needs an absolute http:// URL")
                if absolute[0] != "http":
                    raise _Refused(400, "use CONNECT for https through the proxy")
                raw_host, port = split_authority(absolute[1], 80)
                destination = normalize_host(raw_host)
                if host_header is not None:
                    header_host, _ = split_authority(host_header, port)
                    if normalize_host(header_host) != destination:
                        raise _Refused(400, "Host header does not match the request URL")
                return destination, port, origin.encode("latin-1")
            if host_header is None:
                raise _Refused(400, "missing Host header")
            if self.mode == "transparent":
                raw_host, port = split_authority(host_header, self.default_port)
                destination = normalize_host(raw_host)
                port = self.default_port
                if (
                    absolute is not None
                    and normalize_host(split_authority(absolute[1], port)[0]) != destination
                ):
                    raise _Refused(400, "Host header does not match the request URL")
                return destination, port, origin.encode("latin-1")
            assert self.fixed is not None
            fixed_destination, fixed_port = self.fixed
            raw_host, _ = split_authority(host_header, fixed_port)
            if normalize_host(raw_host) != fixed_destination:
                raise _Refused(421, "Host header does not match the TLS server name")
            if absolute is not None and normalize_host(split_authority(absolute[1], fixed_port)[0]) != (
                fixed_destination
            ):
                raise _Refused(421, "request URL does not match the TLS server name")
            return fixed_destination, fixed_port, origin.encode("latin-1")
        except errors.InvalidArgument as exc:
            raise _Refused(400, exc.message) from exc

    async def _exchange(self, request: h11.Request) -> bool:
        entry = self.ctx.lookup(self.source)
        if entry is None:
            raise _Refused(403, "no egress for this source address")
        sandbox_id = entry.sandbox_id
        destination, port, target = self._target(request)
        decision = await self.ctx.resolve_checked(entry.policy, destination)
        if not decision.allowed:
            self.ctx.audit_denied(sandbox_id, destination, decision, port)
            raise _Refused(403, f"destination {destination.host} refused: {decision.reason}")
        self.ctx.audit("egress", sandbox_id, destination.host, "allowed", port=port, mode=self.mode)

        credentials = await self.ctx.credentials.credentials(sandbox_id)
        headers = [(n, v) for n, v in request.headers]
        result = substitute(
            credentials,
            destination.host,
            headers,
            target,
            self.ctx.limiter,
            encrypted=self.mode == "intercepted",
        )
        not_replaced = (
            ("not_replaced_unbound_host", result.unbound),
            ("not_replaced_plaintext", result.plaintext),
            ("not_replaced_misplaced", result.misplaced),
        )
        for outcome, found in not_replaced:
            for credential in found:
                self.ctx.audit("credential", sandbox_id, destination.host, outcome, credential.name)
        if result.refused is not None:
            status, reason, credential = result.refused
            decision_name = "rate_limited" if status == 429 else "expired"
            self.ctx.audit("credential", sandbox_id, destination.host, decision_name, credential.name)
            raise _Refused(status, reason)
        for credential in result.injected:
            self.ctx.audit("credential", sandbox_id, destination.host, "injected", credential.name)
        bound = [c for c in credentials if c.binds(destination.host)]
        scrubber = self._scrubber(bound, headers, result.headers)

        connection_tokens = set()
        for name, value in request.headers:
            if name == b"connection":
                connection_tokens |= {t.strip().lower() for t in value.split(b",")}
        out_headers: list[tuple[bytes, bytes]] = []
        for name, value in result.headers:
            if name in HOP_BY_HOP or name in connection_tokens or name == b"host":
                continue
            if scrubber.active and name == b"accept-encoding":
                continue
            out_headers.append((name, value))
        default = 443 if self.mode == "intercepted" else 80
        out_headers.insert(0, (b"host", _host_header_value(destination, port, default)))
        if scrubber.active:
            # identity encoding, so a response echoing the credential can be scrubbed
            out_headers.append((b"accept-encoding", b"identity"))

        expects_continue = any(n == b"expect" and v.lower() == b"100-continue" for n, v in request.headers)
        if expects_continue:
            await self._send_client(h11.InformationalResponse(status_code=100, headers=[]))
        has_body = any(
            (n == b"content-length" and v.strip() != b"0") or n == b"transfer-encoding"
            for n, v in out_headers
        )
        head = h11.Request(method=request.method, target=result.target, headers=out_headers)
        first: Any = None
        if not has_body:
            while not isinstance(await self._client_event(), h11.EndOfMessage):
                pass
        for attempt in (0, 1):
            upstream, reused = await self._upstream_for(sandbox_id, destination, port, decision.addresses)
            try:
                upstream.writer.write(upstream.conn.send(head) or b"")
                if has_body:
                    await self._forward_body(upstream)
                    break
                upstream.writer.write(upstream.conn.send(h11.EndOfMessage()) or b"")
                await upstream.writer.drain()
                first = await self._upstream_event(upstream)
                if isinstance(first, h11.ConnectionClosed):
                    raise ConnectionError("upstream closed before answering")
                break
            except (ConnectionError, OSError, h11.RemoteProtocolError):
                # a kept-alive upstream connection the server had just closed: one retry on a fresh one
                # (bodiless requests only: a body is streamed, not buffered)
                self.close_upstream()
                if not reused or attempt == 1:
                    raise ConnectionError("upstream connection failed") from None
        # response
        while True:
            if first is not None:
                event, first = first, None
            else:
                event = await self._upstream_event(upstream)
            if isinstance(event, h11.InformationalResponse):
                if event.status_code != 101:  # (upgrades are not forwarded: Upgrade was dropped)
                    headers = [(n, scrubber.scrub(bytes(v))) for n, v in event.headers if n not in HOP_BY_HOP]
                    await self._send_client(
                        h11.InformationalResponse(status_code=event.status_code, headers=headers)
                    )
                continue
            if isinstance(event, h11.Response):
                await self._send_client(self._filter_response(sandbox_id, destination, event, scrubber))
                continue
            if isinstance(event, h11.Data):
                data = scrubber.feed(bytes(event.data))
                if data:
                    await self._send_client(h11.Data(data=data))
                continue
            if isinstance(event, h11.EndOfMessage):
                tail = scrubber.flush()
                if tail:
                    await self._send_client(h11.Data(data=tail))
                await self._send_client(h11.EndOfMessage(headers=[]))
                break
            raise ConnectionError("upstream closed inside a response")
        if upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE:
            upstream.conn.start_next_cycle()
        else:
            self.close_upstream()
        return True

    async def _forward_body(self, upstream: _Upstream) -> None:
        while True:
            event = await self._client_event()
            if isinstance(event, h11.Data):
                upstream.writer.write(upstream.conn.send(event) or b"")
                await upstream.writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                upstream.writer.write(upstream.conn.send(h11.EndOfMessage()) or b"")
                await upstream.writer.drain()
                return
            else:
                raise ConnectionError("client went away inside a request")

    def _scrubber(
        self,
        bound: list[Credential],
        before: list[tuple[bytes, bytes]],
        after: list[tuple[bytes, bytes]],
    ) -> Scrubber:
        if not bound:
            return Scrubber([])
        forms: set[bytes] = set()
        for credential in bound:
            forms.update(credential.secret_forms())
        old = set(before)
        for header in after:
            if header not in old:
                forms.add(header[1])
                _scheme, _, blob = header[1].partition(b" ")
                if blob:
                    forms.add(blob)
        # A value injected into the target is quote(value, safe=""), one of secret_forms(): the whole target
        # is not added, or a keep-alive connection would grow this set (and the scrub work) per request.
        self.injected_forms |= forms
        return Scrubber(self.injected_forms)

    def _filter_response(
        self, sandbox_id: str, destination: Destination, response: h11.Response, scrubber: Scrubber
    ) -> h11.Response:
        headers: list[tuple[bytes, bytes]] = []
        for name, value in response.headers:
            if name in HOP_BY_HOP:
                continue
            clean = scrubber.scrub(bytes(value))
            if name == b"location" and 300 <= response.status_code < 400:
                self._audit_redirect(sandbox_id, destination, clean)
            headers.append((name, clean))
        return h11.Response(status_code=response.status_code, headers=headers, reason=response.reason)

    def _audit_redirect(self, sandbox_id: str, origin: Destination, location: bytes) -> None:
        """Redirects are never followed here; a Location the policy refuses is noted (the follow-up request,
        if the sandbox makes it, is decided like any other)."""
        text = location.decode("latin-1")
        if "://" not in text:
            return
        authority = text.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        entry = self.ctx.lookup(self.source)
        if entry is None:
            return
        try:
            target = normalize_host(split_authority(authority, 80)[0])
        except errors.InvalidArgument:
            self.ctx.audit("redirect", sandbox_id, origin.host, "invalid_location")
            return
        if not entry.policy.decide_name(target).allowed:
            self.ctx.audit("redirect", sandbox_id, origin.host, "location_refused", location_host=target.host)

    async def _upstream_for(
        self, sandbox_id: str, destination: Destination, port: int, addresses: tuple[IPAddress, ...]
    ) -> tuple[_Upstream, bool]:
        """The upstream connection for this request and whether it was used before."""
        use_tls = self.mode == "intercepted"
        current = self.upstream
        if current is not None:
            same = current.key[:4] == (sandbox_id, destination.host, port, use_tls)
            if same and current.alive() and ipaddress.ip_address(current.key[4]) in addresses:
                return current, True
            self.release_upstream()
        for address in addresses:
            pooled = self.ctx.pool_take((sandbox_id, destination.host, port, use_tls, str(address)))
            if pooled is not None:
                self.upstream = pooled
                return pooled, True
        reader, writer, address = await _connect(
            self.ctx, addresses, port, tls_host=destination.host if use_tls else None
        )

        def close() -> None:
            # the next request on this client connection is decided afresh; an exchange in flight breaks
            _close(writer)

        track = self.ctx.track(sandbox_id, ActiveConnection(destination, address, close))
        key = (sandbox_id, destination.host, port, use_tls, str(address))
        upstream_conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.upstream = _Upstream(key, reader, writer, upstream_conn, track)
        return self.upstream, False


# ---------------------------------------------------------------------------------------------------------
# Listeners


class Handlers:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Explicit proxy: absolute-form HTTP requests and CONNECT tunnels."""
        source = _peer_ip(writer)
        client = PlainStream(reader, writer)
        session = HttpSession(self.ctx, source, client, "proxy")
        try:
            event = await session._client_event()
        except (h11.RemoteProtocolError, TimeoutError, ConnectionError, OSError):
            await session.refuse(400, "malformed request")
            return
        if not isinstance(event, h11.Request):
            client.close()
            return
        if event.method != b"CONNECT":
            await session.run(event)
            return
        entry = self.ctx.lookup(source)
        if entry is None:
            await session.refuse(403, "no egress for this source address")
            return
        try:
            raw_host, port = split_authority(event.target.decode("latin-1"), 443)
            destination = normalize_host(raw_host)
        except errors.InvalidArgument as exc:
            self.ctx.audit("egress", entry.sandbox_id, event.target.decode("latin-1"), "invalid")
            await session.refuse(400, exc.message)
            return
        decision = await self.ctx.resolve_checked(entry.policy, destination)
        if not decision.allowed:
            self.ctx.audit_denied(entry.sandbox_id, destination, decision, port)
            await session.refuse(403, f"destination {destination.host} refused: {decision.reason}")
            return
        try:
            credentials = await self.ctx.credentials.credentials(entry.sandbox_id)
        except errors.SpaceError as exc:  # fail closed: no tunnel without knowing what to intercept
            await session.refuse(503, exc.message)
            return
        connected: tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress] | None = None
        if not any(c.binds(destination.host) for c in credentials):
            # spliced: connect before answering, so an unreachable upstream is a 502, not a dead tunnel
            try:
                connected = await _connect(self.ctx, decision.addresses, port, tls_host=None)
            except errors.Unavailable as exc:
                await session.refuse(502, exc.message)
                return
        try:
            while True:
                follow = await session._client_event()
                if isinstance(follow, h11.EndOfMessage):
                    break
            await session._send_client(
                h11.Response(status_code=200, headers=[], reason=b"Connection established")
            )
        except (h11.ProtocolError, TimeoutError, ConnectionError, OSError):
            client.close()
            if connected is not None:
                _close(connected[1])
            return
        trailing, _closed = session.conn.trailing_data
        await self._tunnel(
            entry,
            source,
            reader,
            writer,
            destination=destination,
            port=port,
            decision=decision,
            initial=bytes(trailing),
            via="connect",
            connected=connected,
        )

    async def transparent_tls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Traffic redirected from port 443 (or another TLS port): decide by SNI."""
        source = _peer_ip(writer)
        entry = self.ctx.lookup(source)
        if entry is None:
            _close(writer)
            return
        original = original_destination(writer)
        port = original[1] if original else self.ctx.default_ports["tls"]
        try:
            hello = await asyncio.wait_for(read_client_hello(reader), timeout=self.ctx.hello_timeout)
        except (NotTls, TimeoutError, ConnectionError, OSError):
            self.ctx.audit("egress", entry.sandbox_id, "", "refused", reason="not a TLS ClientHello")
            _close(writer)
            return
        if hello.has_ech or (hello.server_name is None and original is None):
            reason = "encrypted ClientHello" if hello.has_ech else "TLS without server name"
            self.ctx.audit("egress", entry.sandbox_id, "", "refused", reason=reason)
            _close(writer)
            return
        try:
            if hello.server_name is not None:
                destination = normalize_host(hello.server_name)
            else:
                # no SNI (clients send none for IP literals): the address the sandbox dialled is decided
                assert original is not None
                destination = normalize_host(str(original[0]))
        except errors.InvalidArgument:
            self.ctx.audit("egress", entry.sandbox_id, (hello.server_name or "")[:255], "invalid")
            _close(writer)
            return
        decision = await self.ctx.resolve_checked(entry.policy, destination)
        if not decision.allowed:
            self.ctx.audit_denied(entry.sandbox_id, destination, decision, port)
            _close(writer)
            return
        await self._tunnel(
            entry,
            source,
            reader,
            writer,
            destination=destination,
            port=port,
            decision=decision,
            initial=b"",
            via="transparent",
            hello=hello,
        )

    async def transparent_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Traffic redirected from port 80: decide by the Host header of each request."""
        source = _peer_ip(writer)
        port = original_port(writer) or self.ctx.default_ports["http"]
        session = HttpSession(self.ctx, source, PlainStream(reader, writer), "transparent", default_port=port)
        await session.run()

    def _hello_acceptable(self, sandbox_id: str, destination: Destination, hello: ClientHello) -> bool:
        if hello.has_ech:
            self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason="encrypted ClientHello")
            return False
        if hello.server_name is None:
            return True
        try:
            sni: Destination | None = normalize_host(hello.server_name)
        except errors.InvalidArgument:
            sni = None
        if sni != destination:
            self.ctx.audit(
                "egress",
                sandbox_id,
                destination.host,
                "refused",
                reason="TLS server name differs from the CONNECT host",
                sni=hello.server_name[:255],
            )
            return False
        return True

    async def _tunnel(
        self,
        entry: SandboxEntry,
        source: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        destination: Destination,
        port: int,
        decision: Decision,
        initial: bytes,
        via: Literal["connect", "transparent"],
        hello: ClientHello | None = None,
        connected: tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress] | None = None,
    ) -> None:
        sandbox_id = entry.sandbox_id
        if connected is not None:
            intercept = False
        else:
            try:
                credentials = await self.ctx.credentials.credentials(sandbox_id)
            except errors.SpaceError as exc:  # fail closed, as for CONNECT: unknown what to intercept
                self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason=exc.message)
                _close(writer)
                return
            intercept = any(c.binds(destination.host) for c in credentials)
        if hello is None and intercept:
            try:
                hello = await asyncio.wait_for(
                    read_client_hello(reader, initial), timeout=self.ctx.hello_timeout
                )
            except (NotTls, TimeoutError, ConnectionError, OSError):
                self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason="expected TLS")
                _close(writer)
                return
        if hello is not None:
            if not self._hello_acceptable(sandbox_id, destination, hello):
                _close(writer)
                return
            initial = hello.raw
        if intercept:
            self.ctx.audit(
                "egress", sandbox_id, destination.host, "allowed", port=port, mode=f"{via}-intercept"
            )
            await self._intercept(source, reader, writer, destination=destination, port=port, initial=initial)
            return
        self.ctx.audit("egress", sandbox_id, destination.host, "allowed", port=port, mode=f"{via}-splice")
        if connected is None:
            try:
                connected = await _connect(self.ctx, decision.addresses, port, tls_host=None)
            except errors.Unavailable:
                _close(writer)
                return
        up_reader, up_writer, address = connected

        def close() -> None:
            _close(up_writer)
            _close(writer)

        async def client_to_upstream() -> None:
            first = initial
            if hello is None:
                # CONNECT: the client's first bytes decide whether this is TLS (then its SNI must match);
                # the upstream may speak first meanwhile (the other direction already runs).
                if not first:
                    first = await asyncio.wait_for(reader.read(READ_SIZE), timeout=self.ctx.idle_timeout)
                    if not first:
                        if up_writer.can_write_eof():
                            up_writer.write_eof()
                        return
                if first[:1] == b"\x16":
                    try:
                        seen = await asyncio.wait_for(
                            read_client_hello(reader, first), timeout=self.ctx.hello_timeout
                        )
                    except (NotTls, TimeoutError):
                        self.ctx.audit("egress", sandbox_id, destination.host, "refused", reason="bad TLS")
                        close()
                        return
                    if not self._hello_acceptable(sandbox_id, destination, seen):
                        close()
                        return
                    first = seen.raw
            if first:
                activity.touch()
                up_writer.write(first)
                await up_writer.drain()
            await _pipe(reader, up_writer, activity)

        activity = _Activity()
        watchdog = asyncio.ensure_future(_close_when_idle(activity, self.ctx.tunnel_idle_timeout, close))
        track = self.ctx.track(sandbox_id, ActiveConnection(destination, address, close))
        try:
            await asyncio.gather(
                client_to_upstream(), _pipe(up_reader, writer, activity), return_exceptions=True
            )
        finally:
            watchdog.cancel()
            self.ctx.untrack(track)
            close()

    async def _intercept(
        self,
        source: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        destination: Destination,
        port: int,
        initial: bytes,
    ) -> None:
        context = self.ctx.ca.cached_context(destination.host)
        if context is None:  # minting a certificate takes a few ms of CPU: not on the event loop
            context = await asyncio.to_thread(self.ctx.ca.server_context, destination.host)
        stream = TlsServerStream(reader, writer, context, initial)
        try:
            await asyncio.wait_for(stream.handshake(), timeout=self.ctx.hello_timeout)
        except (TimeoutError, ConnectionError, OSError) as exc:
            log.debug("sandbox TLS handshake failed: %s", exc)
            _close(writer)
            return
        session = HttpSession(self.ctx, source, stream, "intercepted", fixed=(destination, port))
        await session.run()
