"""Name resolution for the gateway, and the DNS server a sandbox talks to.

Invariants:
- The gateway resolves a name only after the sandbox's policy allows the *name*; a denied or unlisted name is
  answered NXDOMAIN without any upstream query (no DNS exfiltration through the gateway).
- Answers contain only addresses the policy would let the sandbox connect to (forbidden addresses are
  dropped; if none is left the answer is REFUSED). The proxy re-resolves and re-checks on connect, so the
  DNS answer is a convenience, never the security boundary.
- Queries from a source address no sandbox is registered for are REFUSED.
- Bounded work (ADR 0026): one source address (one sandbox) has at most `per_source` queries being
  answered at once, UDP and TCP together, and all sources together at most `total`; a UDP query beyond
  either cap is dropped (clients retry, like with a busy server), a TCP one answered SERVFAIL at once.
  TCP DNS connections go through the gateway's connection wrapper, so they count in its per-source
  connection cap, and one is closed after TCP_IDLE_S without a query.
- Names are resolved asynchronously (dnspython's asyncio resolver: no thread of any shared executor is
  ever held by a lookup), with at most RESOLVE_TIMEOUT_S for the whole lookup (A and AAAA together) and
  at most MAX_RESOLVES_IN_FLIGHT upstream lookups at once for the whole gateway.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import dns.asyncresolver
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from space.core import errors
from space.node.egress.policy import CompiledPolicy, Destination, IPAddress, normalize_host

ANSWER_TTL = 30
MAX_TCP_MESSAGE = 65535
# One lookup (A and AAAA at once, all nameservers and retries) ends within this: a sandbox waiting on a
# slow upstream resolver holds its query slot for at most this long.
RESOLVE_TIMEOUT_S = 2.0
RESOLVE_ATTEMPT_S = 1.0  # per nameserver attempt
MAX_RESOLVES_IN_FLIGHT = 128  # upstream lookups at once, whole gateway
#: A lookup whose turn comes with less of its timeout left than this asks no nameserver (it could not use
#: the answer): a queue of waiting lookups never turns into a burst of queries at their common deadline.
MIN_QUERY_S = 0.2
MAX_QUERIES_PER_SOURCE = 32  # queries being answered at once for one sandbox (UDP + TCP)
MAX_UDP_IN_FLIGHT = 512  # queries being answered at once, for all sandboxes together (UDP + TCP)
TCP_IDLE_S = 10.0  # a TCP DNS connection with no (complete) query for this long is closed


def is_local_address(address: IPAddress) -> bool:
    """Is `address` one of this host's own addresses? (Binding to it succeeds only then, with the default
    ip_nonlocal_bind=0; asked each time, so addresses added later count at once.)"""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


class Resolver(Protocol):
    async def resolve(self, host: str) -> list[IPAddress]:
        """Addresses of a normalized name; [] when it has none."""
        ...


class SystemResolver:
    """Asynchronous lookups (dnspython's asyncio resolver) against the node's nameservers
    (/etc/resolv.conf) or the given ones: A and AAAA at once, the whole lookup within RESOLVE_TIMEOUT_S,
    at most MAX_RESOLVES_IN_FLIGHT lookups at once (the rest wait their turn within their own timeout, and
    one whose turn comes with less than MIN_QUERY_S left asks nobody).
    No thread pool is involved, so a hung or flooded upstream resolver cannot starve anything else of the
    node agent's process. (/etc/hosts is not read: sandboxes reach the Internet, not the node's names.)"""

    def __init__(
        self,
        nameservers: Sequence[str] | None = None,
        *,
        port: int = 53,
        timeout_s: float | None = None,
        max_in_flight: int = MAX_RESOLVES_IN_FLIGHT,
    ) -> None:
        self._nameservers = list(nameservers) if nameservers is not None else None
        self._port = port
        self._timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._slots = asyncio.Semaphore(max_in_flight)

    def _configured(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            if self._nameservers is None:
                resolver = dns.asyncresolver.Resolver(configure=True)  # reads /etc/resolv.conf once
            else:
                resolver = dns.asyncresolver.Resolver(configure=False)
                resolver.nameservers = list(self._nameservers)
                resolver.port = self._port
            resolver.timeout = RESOLVE_ATTEMPT_S
            resolver.cache = None
            self._resolver = resolver
        return self._resolver

    async def resolve(self, host: str) -> list[IPAddress]:
        limit = self._timeout_s if self._timeout_s is not None else RESOLVE_TIMEOUT_S
        try:
            async with asyncio.timeout(limit) as budget:
                async with self._slots:
                    deadline = budget.when()
                    if deadline is not None and deadline - asyncio.get_running_loop().time() < MIN_QUERY_S:
                        return []
                    resolver = self._configured()
                    kinds = ("A", "AAAA")
                    answers = await asyncio.gather(
                        *(self._one(resolver, host, kind, limit) for kind in kinds)
                    )
        except TimeoutError:  # a resolver that does not answer in time: no addresses
            return []
        except dns.exception.DNSException:  # no usable resolver configuration on the node: no addresses
            return []
        found: list[IPAddress] = []
        for addresses in answers:
            for address in addresses:
                if address not in found:
                    found.append(address)
        return found

    @staticmethod
    async def _one(
        resolver: dns.asyncresolver.Resolver, host: str, kind: str, limit: float
    ) -> list[IPAddress]:
        try:
            answer = await resolver.resolve(host, kind, search=False, lifetime=limit)
        except dns.exception.DNSException:  # NXDOMAIN, no answer, no nameserver, timeout
            return []
        return [ipaddress.ip_address(str(rdata.address).split("%")[0]) for rdata in answer]


class StaticResolver:
    """A fixed name -> addresses map (tests, benchmarks, air-gapped nodes)."""

    def __init__(self, table: Mapping[str, Sequence[str]]) -> None:
        self.table = {
            name.lower().rstrip("."): [ipaddress.ip_address(a) for a in addrs]
            for name, addrs in table.items()
        }

    async def resolve(self, host: str) -> list[IPAddress]:
        return list(self.table.get(host, []))


PolicyLookup = Callable[[str], "tuple[str, CompiledPolicy] | None"]
AuditHook = Callable[[str, str, str], None]  # (sandbox_id, host, decision)


class DnsService:
    """Answers one DNS query message (wire format in, wire format out)."""

    def __init__(self, lookup: PolicyLookup, resolver: Resolver, audit: AuditHook) -> None:
        self.lookup = lookup
        self.resolver = resolver
        self.audit = audit

    async def answer(self, wire: bytes, source: str) -> bytes | None:
        """The response to a query message; None for bytes that are no DNS message (nothing is sent)."""
        try:
            query = dns.message.from_wire(wire)
        except (dns.exception.DNSException, ValueError):
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        try:
            asked = self._question(query, source)
            kept = await self._addresses(asked)
        except _Answered as answered:
            response.set_rcode(answered.rcode)
            return response.to_wire()
        question = asked.question
        rdtype = question.rdtype
        wanted: list[str] = []
        if rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
            wanted += [str(a) for a in kept if a.version == 4]
        if rdtype in (dns.rdatatype.AAAA, dns.rdatatype.ANY):
            wanted += [str(a) for a in kept if a.version == 6]
        by_type: dict[dns.rdatatype.RdataType, list[str]] = {}
        for address in wanted:
            kind = dns.rdatatype.A if ":" not in address else dns.rdatatype.AAAA
            by_type.setdefault(kind, []).append(address)
        for kind, values in by_type.items():
            response.answer.append(dns.rrset.from_text_list(question.name, ANSWER_TTL, "IN", kind, values))
        self.audit(asked.sandbox_id, asked.destination.host, "answered")
        return response.to_wire()

    def _question(self, query: dns.message.Message, source: str) -> _Asked:
        """The one question of a query from a known sandbox, for a name; raises _Answered otherwise."""
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            raise _Answered(dns.rcode.NOTIMP if query.opcode() != dns.opcode.QUERY else dns.rcode.FORMERR)
        found = self.lookup(source)
        if found is None:
            raise _Answered(dns.rcode.REFUSED)
        sandbox_id, policy = found
        question = query.question[0]
        try:
            text = question.name.to_text(omit_final_dot=True)
            destination = normalize_host(text)
        except (errors.InvalidArgument, dns.exception.DNSException, UnicodeError) as exc:
            raise _Answered(dns.rcode.NXDOMAIN) from exc
        if destination.is_address or question.rdclass != dns.rdataclass.IN:
            raise _Answered(dns.rcode.REFUSED)
        return _Asked(sandbox_id, policy, question, destination)

    async def _addresses(self, asked: _Asked) -> list[IPAddress]:
        """The addresses the sandbox may connect to for the name; raises _Answered (audited) if none."""
        policy, destination = asked.policy, asked.destination
        decision = policy.decide_name(destination)
        if not decision.allowed:
            self.audit(asked.sandbox_id, destination.host, "denied")
            raise _Answered(dns.rcode.NXDOMAIN)
        addresses = await self.resolver.resolve(destination.host)
        checked = policy.filter_addresses(destination, addresses)
        kept = [a for a in checked.addresses if policy.operator_allows(a) or not is_local_address(a)]
        if not checked.allowed or not kept:
            self.audit(asked.sandbox_id, destination.host, "refused")
            raise _Answered(dns.rcode.REFUSED)
        return kept


class _Answered(Exception):
    """The query is answered with `rcode` and no records."""

    def __init__(self, rcode: dns.rcode.Rcode) -> None:
        super().__init__(rcode)
        self.rcode = rcode


@dataclass(frozen=True)
class _Asked:
    """A query's one question, from a known sandbox, for a well-formed name."""

    sandbox_id: str
    policy: CompiledPolicy
    question: dns.rrset.RRset
    destination: Destination


@dataclass
class QueryLimits:
    """Queries being answered at once: per source address (one sandbox) and in total (module invariants)."""

    per_source: int = MAX_QUERIES_PER_SOURCE
    total: int = MAX_UDP_IN_FLIGHT


class InFlight:
    """Counts the queries being answered, per source and in total, against QueryLimits."""

    def __init__(self, limits: QueryLimits) -> None:
        self.limits = limits
        self.by_source: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.dropped = 0  # queries refused by a cap (UDP dropped, TCP answered SERVFAIL)

    def acquire(self, source: str) -> bool:
        if self.total >= self.limits.total or self.by_source[source] >= self.limits.per_source:
            self.dropped += 1
            return False
        self.total += 1
        self.by_source[source] += 1
        return True

    def release(self, source: str) -> None:
        self.total -= 1
        self.by_source[source] -= 1
        if self.by_source[source] <= 0:
            del self.by_source[source]


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, service: DnsService, in_flight: InFlight | None = None) -> None:
        self.service = service
        self.in_flight = in_flight or InFlight(QueryLimits())
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        source = _source(addr)
        if not self.in_flight.acquire(source):
            return  # a flood: dropped like a busy server would (UDP clients retry); memory stays bounded
        task = asyncio.ensure_future(self._reply(data, addr, source))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | object, int], source: str) -> None:
        try:
            answer = await self.service.answer(data, source)
        finally:
            self.in_flight.release(source)
        if answer is not None and self.transport is not None and not self.transport.is_closing():
            if len(answer) > 512:
                truncated = dns.message.from_wire(answer)
                truncated.answer.clear()
                truncated.flags |= dns.flags.TC
                answer = truncated.to_wire()
            self.transport.sendto(answer, addr)


def _source(addr: object) -> str:
    host = str(addr[0]) if isinstance(addr, tuple) else str(addr)
    if host.startswith("::ffff:"):
        host = host[7:]
    return host


ConnectionWrapper = Callable[
    [Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]],
    Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
]


def _servfail(wire: bytes) -> bytes | None:
    try:
        query = dns.message.from_wire(wire)
    except (dns.exception.DNSException, ValueError):
        return None
    response = dns.message.make_response(query)
    response.set_rcode(dns.rcode.SERVFAIL)
    return response.to_wire()


class DnsServer:
    """UDP and TCP DNS listeners on one port. `wrap_tcp`: the gateway's connection wrapper (its per-source
    connection cap and accounting) put around every TCP connection."""

    def __init__(
        self,
        service: DnsService,
        *,
        limits: QueryLimits | None = None,
        wrap_tcp: ConnectionWrapper | None = None,
    ) -> None:
        self.service = service
        self.in_flight = InFlight(limits or QueryLimits())
        self._wrap_tcp = wrap_tcp
        self._udp: asyncio.DatagramTransport | None = None
        self._udp_protocol: _UdpProtocol | None = None
        self._tcp: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        handler = self._wrap_tcp(self._handle_tcp) if self._wrap_tcp is not None else self._handle_tcp
        self._tcp = await asyncio.start_server(handler, host, port)
        self.port = int(self._tcp.sockets[0].getsockname()[1])
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _UdpProtocol(self.service, self.in_flight), local_addr=(host, self.port)
        )
        self._udp, self._udp_protocol = transport, protocol
        return self.port

    async def _handle_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = _source(writer.get_extra_info("peername"))
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), timeout=TCP_IDLE_S)
                (length,) = struct.unpack("!H", head)
                wire = await asyncio.wait_for(reader.readexactly(length), timeout=TCP_IDLE_S)
                if self.in_flight.acquire(source):
                    try:
                        answer = await self.service.answer(wire, source)
                    finally:
                        self.in_flight.release(source)
                else:
                    answer = _servfail(wire)  # over a cap: answered at once, nothing held
                if answer is None:
                    break
                writer.write(struct.pack("!H", len(answer)) + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._udp_protocol is not None:
            for task in list(self._udp_protocol.tasks):
                task.cancel()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()
