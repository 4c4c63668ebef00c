"""Name resolution for the gateway, and the DNS server a sandbox talks to.

Invariants:
- The gateway resolves a name only after the sandbox's policy allows the *name*; a denied or unlisted name is
  answered NXDOMAIN without any upstream query (no DNS exfiltration through the gateway).
- Answers contain only addresses the policy would let the sandbox connect to (forbidden addresses are
  dropped; if none is left the answer is REFUSED). The proxy re-resolves and re-checks on connect, so the
  DNS answer is a convenience, never the security boundary.
- Queries from a source address no sandbox is registered for are REFUSED.
- At most MAX_UDP_IN_FLIGHT UDP queries are answered at once; more are dropped, so a flood cannot grow
  memory without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

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
from space.node.egress.policy import CompiledPolicy, IPAddress, normalize_host

ANSWER_TTL = 30
MAX_TCP_MESSAGE = 65535
# Above glibc's default worst case for one name (3 nameservers x 2 attempts x 5 s): only a hung resolver
# is cut short.
RESOLVE_TIMEOUT_S = 35.0
MAX_UDP_IN_FLIGHT = 512  # queries being answered at once, for all sandboxes together


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
    """getaddrinfo in the event loop's thread pool (the node's own resolver configuration)."""

    async def resolve(self, host: str) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout=RESOLVE_TIMEOUT_S
            )
        except (socket.gaierror, TimeoutError):  # a resolver that does not answer: no addresses
            return []
        found: list[IPAddress] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
            if address not in found:
                found.append(address)
        return found


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
        try:
            query = dns.message.from_wire(wire)
        except (dns.exception.DNSException, ValueError):
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            response.set_rcode(dns.rcode.NOTIMP if query.opcode() != dns.opcode.QUERY else dns.rcode.FORMERR)
            return response.to_wire()
        found = self.lookup(source)
        if found is None:
            response.set_rcode(dns.rcode.REFUSED)
            return response.to_wire()
        sandbox_id, policy = found
        question = query.question[0]
        qname = question.name
        try:
            text = qname.to_text(omit_final_dot=True)
            destination = normalize_host(text)
        except (errors.InvalidArgument, dns.exception.DNSException, UnicodeError):
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        if destination.is_address or question.rdclass != dns.rdataclass.IN:
            response.set_rcode(dns.rcode.REFUSED)
            return response.to_wire()
        decision = policy.decide_name(destination)
        if not decision.allowed:
            self.audit(sandbox_id, destination.host, "denied")
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        addresses = await self.resolver.resolve(destination.host)
        checked = policy.filter_addresses(destination, addresses)
        kept = [a for a in checked.addresses if policy.operator_allows(a) or not is_local_address(a)]
        if not checked.allowed or not kept:
            self.audit(sandbox_id, destination.host, "refused")
            response.set_rcode(dns.rcode.REFUSED)
            return response.to_wire()
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
            response.answer.append(dns.rrset.from_text_list(qname, ANSWER_TTL, "IN", kind, values))
        self.audit(sandbox_id, destination.host, "answered")
        return response.to_wire()


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, service: DnsService) -> None:
        self.service = service
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        if len(self.tasks) >= MAX_UDP_IN_FLIGHT:
            return  # a flood: dropped like a busy server would (UDP clients retry); memory stays bounded
        task = asyncio.ensure_future(self._reply(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | object, int]) -> None:
        answer = await self.service.answer(data, _source(addr))
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


class DnsServer:
    """UDP and TCP DNS listeners on one port."""

    def __init__(self, service: DnsService) -> None:
        self.service = service
        self._udp: asyncio.DatagramTransport | None = None
        self._udp_protocol: _UdpProtocol | None = None
        self._tcp: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._tcp = await asyncio.start_server(self._handle_tcp, host, port)
        self.port = int(self._tcp.sockets[0].getsockname()[1])
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _UdpProtocol(self.service), local_addr=(host, self.port)
        )
        self._udp, self._udp_protocol = transport, protocol
        return self.port

    async def _handle_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = _source(writer.get_extra_info("peername"))
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), timeout=30)
                (length,) = struct.unpack("!H", head)
                wire = await asyncio.wait_for(reader.readexactly(length), timeout=30)
                answer = await self.service.answer(wire, source)
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
