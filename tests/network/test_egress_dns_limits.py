"""The gateway's resolver and DNS server under load (ADR 0026): lookups are asynchronous with a short
total timeout and a global cap (never on the event loop's default executor), and the DNS server caps the
queries being answered per source address (UDP + TCP together) and in total. Real sockets on loopback: a
nameserver that never answers, one that answers, and a real DnsServer."""

from __future__ import annotations

import asyncio
import pathlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import dns.asyncresolver
import dns.message
import dns.rcode
import dns.rrset
import pytest

from space.node.egress import dns as egress_dns
from space.node.egress.dns import DnsServer, InFlight, QueryLimits, SystemResolver


class _Nameserver:
    """A UDP nameserver on 127.0.0.1 that counts queries and answers only names starting with `fast`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.received = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            self.received += 1
            query = dns.message.from_wire(wire)
            question = query.question[0]
            if not question.name.to_text().startswith("fast"):
                continue
            response = dns.message.make_response(query)
            kind, value = ("A", "1.2.3.4") if question.rdtype == 1 else ("AAAA", "2001:4860::1")
            response.answer.append(dns.rrset.from_text(question.name, 30, "IN", kind, value))
            self.sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def nameserver() -> Iterator[_Nameserver]:
    server = _Nameserver()
    try:
        yield server
    finally:
        server.close()


def test_resolver_answers_a_and_aaaa_without_the_default_executor(nameserver: _Nameserver) -> None:
    async def run() -> tuple[list[str], bool]:
        found = await SystemResolver(["127.0.0.1"], port=nameserver.port).resolve("fast.example.com")
        default_executor = getattr(asyncio.get_running_loop(), "_default_executor", None)
        return sorted(str(a) for a in found), default_executor is None

    addresses, no_executor = asyncio.run(run())
    assert addresses == ["1.2.3.4", "2001:4860::1"]
    assert no_executor  # no lookup ever took a thread of the shared default executor


def test_resolver_gives_up_on_a_hung_nameserver_within_the_timeout(nameserver: _Nameserver) -> None:
    async def run() -> tuple[list[object], float]:
        started = time.monotonic()
        found = await SystemResolver(["127.0.0.1"], port=nameserver.port).resolve("hung.example.com")
        return list(found), time.monotonic() - started

    found, took = asyncio.run(run())
    assert found == []
    assert egress_dns.RESOLVE_TIMEOUT_S - 0.2 <= took <= egress_dns.RESOLVE_TIMEOUT_S + 1.0, took


def test_resolver_caps_lookups_in_flight(nameserver: _Nameserver) -> None:
    """Ten lookups of hung names with a cap of two: only two ever reach the nameserver (A + AAAA, one
    retry each), the others wait for a slot and end at their own timeout."""

    async def run() -> tuple[list[list[object]], float]:
        resolver = SystemResolver(["127.0.0.1"], port=nameserver.port, timeout_s=1.5, max_in_flight=2)
        started = time.monotonic()
        found = await asyncio.gather(*(resolver.resolve(f"hung{i}.example.com") for i in range(10)))
        return [list(f) for f in found], time.monotonic() - started

    found, took = asyncio.run(run())
    assert found == [[]] * 10 and took < 3.0, took
    time.sleep(0.3)
    assert 1 <= nameserver.received <= 2 * 2 * 2, nameserver.received


class _HungService:
    """A DnsService whose answers never come (every query holds its slot until cancelled)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def answer(self, wire: bytes, source: str) -> bytes | None:
        self.asked.append(source)
        await asyncio.sleep(3600)
        return None


def test_in_flight_caps_per_source_and_in_total() -> None:
    counter = InFlight(QueryLimits(per_source=3, total=5))
    assert [counter.acquire("a") for _ in range(4)] == [True, True, True, False]
    assert [counter.acquire("b") for _ in range(3)] == [True, True, False]  # the total (5) is reached
    counter.release("a")
    assert counter.acquire("b") and not counter.acquire("c")
    assert counter.dropped == 3 and counter.total == 5


def test_udp_flood_from_one_source_leaves_room_for_another() -> None:
    async def run() -> tuple[int, int, int]:
        service = _HungService()
        protocol = egress_dns._UdpProtocol(service, InFlight(QueryLimits(per_source=8, total=20)))  # type: ignore[arg-type]
        for _ in range(1000):
            protocol.datagram_received(b"query", ("10.0.0.2", 5353))
        for _ in range(5):
            protocol.datagram_received(b"query", ("10.0.0.3", 5353))
        await asyncio.sleep(0)
        flooding, other = service.asked.count("10.0.0.2"), service.asked.count("10.0.0.3")
        in_flight = len(protocol.tasks)
        for task in list(protocol.tasks):
            task.cancel()
        await asyncio.gather(*protocol.tasks, return_exceptions=True)
        assert protocol.in_flight.total == 0 and not protocol.in_flight.by_source  # all released
        return flooding, other, in_flight

    assert asyncio.run(run()) == (8, 5, 13)


def test_tcp_query_over_the_cap_is_answered_servfail_at_once() -> None:
    async def run() -> tuple[int, float]:
        server = DnsServer(_HungService(), limits=QueryLimits(per_source=1, total=10))  # type: ignore[arg-type]
        port = await server.start("127.0.0.1", 0)
        try:
            query = dns.message.make_query("x.example.com", "A").to_wire()
            framed = struct.pack("!H", len(query)) + query
            _r1, first = await asyncio.open_connection("127.0.0.1", port)
            first.write(framed)  # holds the source's only slot
            await asyncio.sleep(0.2)
            reader, second = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            second.write(framed)
            (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 5))
            answer = dns.message.from_wire(await reader.readexactly(length))
            took = time.monotonic() - started
            first.close()
            second.close()
            return answer.rcode(), took
        finally:
            await server.close()

    rcode, took = asyncio.run(run())
    assert rcode == dns.rcode.SERVFAIL and took < 1.0


def test_a_node_without_resolver_configuration_answers_no_addresses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """An empty /etc/resolv.conf (no nameserver) is "no addresses" for every name, not an exception that
    would end the DNS server's handling of the query."""
    empty = tmp_path / "resolv.conf"
    empty.write_text("# no nameserver\n")
    real = dns.asyncresolver.Resolver

    def from_empty_file(configure: bool = True) -> dns.asyncresolver.Resolver:
        return real(filename=str(empty), configure=configure)

    monkeypatch.setattr(dns.asyncresolver, "Resolver", from_empty_file)
    assert asyncio.run(SystemResolver().resolve("fast.example.com")) == []
