"""The egress gateway's DNS and tunnel bounds for real (ADR 0026): a real nameserver in its own network
namespace (answers `fast*` names, never answers others, logs every query it gets), a real gateway on
loopback, sandboxes as source addresses 127.0.0.2-4 (as tests/network/test_egress_gateway.py does),
and a real HTTP upstream in another namespace for spliced tunnels. Needs root (netns, veth).

Each cap has its test: the whole-lookup timeout, the per-source cap on queries in flight (UDP and TCP
together), the global cap, TCP DNS connections counted in the per-source connection cap, idle TCP DNS
connections closed, and silent spliced tunnels closed."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import dns.message
import dns.query
import dns.rcode
import pytest

from space.node.egress import EgressGateway, EgressPolicy, StaticCredentials
from space.node.egress import dns as egress_dns
from space.node.egress.dns import SystemResolver
from tests.support.egress_net import REPO, UpstreamCA, leftovers, start_upstream, veth_namespace
from tests.support.loop import BackgroundLoop

pytestmark = pytest.mark.root

FLOODER, NEIGHBOUR, THIRD = "127.0.0.2", "127.0.0.3", "127.0.0.4"
PER_SOURCE, TOTAL, CONNECTIONS = 8, 12, 4


@dataclass
class Env:
    loop: BackgroundLoop
    gateway: EgressGateway
    nameserver_log: pathlib.Path
    upstream_addr: str

    @property
    def dns_port(self) -> int:
        return self.gateway.ports["dns"]

    def names_seen(self, marker: str) -> set[str]:
        """The distinct flood names that reached the nameserver (retries of one name count once)."""
        if not self.nameserver_log.exists():
            return set()
        return set(re.findall(rf"{re.escape(marker)}-\d+-[0-9a-f]{{8}}", self.nameserver_log.read_text()))

    def ask(self, name: str, source: str, *, tcp: bool = False, timeout: float = 5) -> dns.message.Message:
        query = dns.message.make_query(name, "A")
        if tcp:
            return dns.query.tcp(query, "127.0.0.1", port=self.dns_port, timeout=timeout, source=source)
        return dns.query.udp(query, "127.0.0.1", port=self.dns_port, timeout=timeout, source=source)

    def wait_idle(self) -> None:
        """Until no query is in flight any more (hung lookups end at RESOLVE_TIMEOUT_S)."""
        deadline = time.monotonic() + egress_dns.RESOLVE_TIMEOUT_S + 5
        while self.gateway._dns.in_flight.total and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.gateway._dns.in_flight.total == 0


def udp_receive_buffer_errors() -> int:
    """The kernel's count of UDP datagrams dropped for a full receive buffer (this network namespace)."""
    lines = [
        line.split()
        for line in pathlib.Path("/proc/net/snmp").read_text().splitlines()
        if line.startswith("Udp:")
    ]
    return int(lines[1][lines[0].index("RcvbufErrors")])


def flood(port: int, source: str, count: int, marker: str) -> None:
    """`count` UDP queries for distinct never-answered names from `source`, sent without waiting."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        for i in range(count):
            name = f"{marker}-{i}-{uuid.uuid4().hex[:8]}.flood.test"
            sock.sendto(dns.message.make_query(name, "A").to_wire(), ("127.0.0.1", port))


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (network namespaces); CI runs as root")
    tag = f"spd{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-dns-caps-", dir="/var/tmp"))
    namespace, host_if, peer_if = f"{tag}-ns", f"{tag[-8:]}nsh", f"{tag[-8:]}nsn"
    ns_host, ns_addr = "10.98.21.1", "10.98.21.2"
    log = workdir / "queries.log"
    loop = BackgroundLoop()
    nameserver: subprocess.Popen[bytes] | None = None
    gateway: EgressGateway | None = None
    upstream = None
    try:
        veth_namespace(namespace, host_if, peer_if, ns_host, ns_addr)
        nameserver = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{namespace}", sys.executable, "-m",
             "tests.support.dns_upstream", "--listen", ns_addr, "--log", str(log)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        test_ca = UpstreamCA(workdir)
        upstream = start_upstream(
            tag, "up", 22, test_ca.issue("up.pem", ["up.test"], ["10.98.22.2"]), workdir
        )
        gateway = EgressGateway(
            ca_dir=workdir / "ca",
            credentials=StaticCredentials(),
            audit=lambda record: None,
            resolver=SystemResolver([ns_addr]),
            listen_host="127.0.0.1",
            max_connections_per_source=CONNECTIONS,
            dns_queries_per_source=PER_SOURCE,
            dns_queries_total=TOTAL,
        )
        loop.run(gateway.start())
        policy = EgressPolicy(allow=["*.flood.test", "fast.test", "fast2.test", "10.98.22.0/24"])
        for i, source in enumerate((FLOODER, NEIGHBOUR, THIRD)):
            gateway.set_policy(f"sb-dns-{i}", source, policy)
        made = Env(loop, gateway, log, upstream.addr)
        deadline = time.monotonic() + 15
        while made.ask("fast.test", NEIGHBOUR, timeout=1).rcode() != dns.rcode.NOERROR:
            assert time.monotonic() < deadline, "the nameserver in the namespace never answered"
        yield made
    finally:
        if gateway is not None:
            loop.run(gateway.close())
        loop.close()
        if nameserver is not None:
            nameserver.kill()
            nameserver.wait(5)
        if upstream is not None:
            upstream.close()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
        assert leftovers(tag) == [], "network namespaces or veth pairs left behind"


def test_a_hung_upstream_resolver_is_given_up_within_the_timeout(env: Env) -> None:
    started = time.monotonic()
    answer = env.ask("hung-one.flood.test", NEIGHBOUR, timeout=10)
    took = time.monotonic() - started
    assert answer.rcode() == dns.rcode.REFUSED  # allowed name, no address: refused, not hung
    assert took <= egress_dns.RESOLVE_TIMEOUT_S + 1.0, took
    env.wait_idle()


def test_a_udp_flood_is_capped_per_sandbox_and_the_neighbour_is_answered(env: Env) -> None:
    marker = f"cap{uuid.uuid4().hex[:6]}"
    overflowed_before = udp_receive_buffer_errors()
    flood(env.dns_port, FLOODER, 2000, marker)
    time.sleep(0.3)
    assert env.gateway._dns.in_flight.by_source.get(FLOODER, 0) <= PER_SOURCE
    started = time.monotonic()
    assert env.ask("fast.test", NEIGHBOUR).rcode() == dns.rcode.NOERROR
    neighbour_took = time.monotonic() - started
    assert neighbour_took < 1.0, neighbour_took
    env.wait_idle()
    # Only the first PER_SOURCE names ever went upstream. (How often each was asked, A + AAAA and the
    # resolver's retries, depends on the load of the machine, so the bound is on distinct names.)
    assert 1 <= len(env.names_seen(marker)) <= PER_SOURCE, sorted(env.names_seen(marker))
    # Every query that reached the gateway past its cap was dropped by it; the kernel itself drops what
    # overflows the socket's buffer while the machine is busy (counted machine-wide, so a bound from below).
    reached = 2000 - (udp_receive_buffer_errors() - overflowed_before)
    assert env.gateway._dns.in_flight.dropped >= reached - PER_SOURCE


def test_queries_in_flight_are_capped_in_total(env: Env) -> None:
    marker = f"tot{uuid.uuid4().hex[:6]}"
    flood(env.dns_port, FLOODER, 500, marker)
    flood(env.dns_port, THIRD, 500, marker)
    time.sleep(0.3)
    in_flight = env.gateway._dns.in_flight
    assert in_flight.total == TOTAL  # 8 + 4: the second source got only what was left
    assert in_flight.by_source[FLOODER] <= PER_SOURCE and in_flight.by_source[THIRD] <= PER_SOURCE
    env.wait_idle()
    assert env.ask("fast.test", NEIGHBOUR).rcode() == dns.rcode.NOERROR  # free again after the timeout


def test_tcp_queries_share_the_per_sandbox_cap(env: Env) -> None:
    flood(env.dns_port, FLOODER, 100, f"tcp{uuid.uuid4().hex[:6]}")
    time.sleep(0.3)
    started = time.monotonic()
    answer = env.ask("fast.test", FLOODER, tcp=True)
    assert answer.rcode() == dns.rcode.SERVFAIL and time.monotonic() - started < 1.0
    assert env.ask("fast.test", NEIGHBOUR, tcp=True).rcode() == dns.rcode.NOERROR
    env.wait_idle()
    assert env.ask("fast.test", FLOODER, tcp=True).rcode() == dns.rcode.NOERROR


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """One HTTP request on a kept-alive connection: the whole response (head + Content-Length body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head + b"\r\n\r\n" + body


def _closed_at_once(sock: socket.socket) -> bool:
    sock.settimeout(3)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_tcp_dns_connections_count_in_the_per_source_connection_cap(env: Env) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):
            held.append(_connect(env.dns_port, FLOODER))
        time.sleep(0.3)
        extra = _connect(env.dns_port, FLOODER)
        assert _closed_at_once(extra)
        extra.close()
        # ... and they are the same budget as the proxy's: no proxy connection either.
        proxy = _connect(env.gateway.ports["proxy"], FLOODER)
        assert _closed_at_once(proxy)
        proxy.close()
        # The neighbour is not affected; a freed slot is usable again.
        assert env.ask("fast.test", NEIGHBOUR, tcp=True).rcode() == dns.rcode.NOERROR
        held.pop().close()
        time.sleep(0.3)
        assert env.ask("fast.test", FLOODER, tcp=True).rcode() == dns.rcode.NOERROR
    finally:
        for sock in held:
            sock.close()


def test_an_idle_tcp_dns_connection_is_closed(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress_dns, "TCP_IDLE_S", 1.0)
    with _connect(env.dns_port, NEIGHBOUR) as sock:
        query = dns.message.make_query("fast.test", "A").to_wire()
        sock.sendall(struct.pack("!H", len(query)) + query)
        (length,) = struct.unpack("!H", sock.recv(2))
        assert length > 0
        sock.recv(length)
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the gateway, not by this client
        assert 0.8 <= time.monotonic() - started <= 3.0


def _tunnel(env: Env, source: str) -> socket.socket:
    sock = _connect(env.gateway.ports["proxy"], source)
    target = f"{env.upstream_addr}:80"
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


def test_a_silent_spliced_tunnel_is_closed_and_a_busy_one_is_not(env: Env) -> None:
    env.gateway.ctx.tunnel_idle_timeout = 1.0
    silent = _tunnel(env, NEIGHBOUR)
    busy = _tunnel(env, THIRD)
    try:
        request = f"GET / HTTP/1.1\r\nHost: {env.upstream_addr}\r\n\r\n".encode()
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # well past the idle timeout, but never idle that long
            assert _exchange(busy, request).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the gateway after ~1 s of silence
        assert _exchange(busy, request).startswith(b"HTTP/1.1 200")
    finally:
        env.gateway.ctx.tunnel_idle_timeout = 300.0
        silent.close()
        busy.close()
