"""Per-sandbox networks for real: gVisor in its own network namespace, NAT at the edge, the node's nftables
table. A sandbox reaches the egress gateway's ports (stand-ins here: plain socket servers on the gateway
address) and nothing else: not another sandbox, not the host's other services, not link-local/metadata
addresses, not a server in another network namespace; TCP 80/443 and DNS are redirected to the gateway.
Every sandbox has the same inner address; checkpoint, rollback, stop/start and fork keep the network.
The module's own node (network = "sandbox") is torn down at the end and must leave no trace."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from space.node.agent.agent import NodeAgent
from space.node.agent.guest import GuestSession
from space.node.helper.netaddr import SANDBOX_ADDR, node_tag
from space.node.helper.network import SandboxNetworks
from space.node.helper.params import GatewayPorts
from space.node.layout import NodeLayout
from space.node.local import LocalNode
from tests.support.host import network_traces
from tests.support.loop import BackgroundLoop
from tests.support.sandboxes import delete_quietly, eventually, new_sandbox

pytestmark = pytest.mark.root

SO_ORIGINAL_DST = 80
NETNS_DIR = pathlib.Path("/run/netns")
HOST_CHECK = b"host-check"
PROBE_TIMEOUT_S = 2.0

# Runs inside the sandbox: every probe at once (blocked ones take the whole timeout), one JSON line out.
PROBE = r"""
import json, socket, sys, threading
probes = json.loads(sys.argv[1]); timeout = float(sys.argv[2]); results = [None] * len(probes)
def run(i, p):
    family = socket.AF_INET6 if ":" in p["host"] else socket.AF_INET
    kind = socket.SOCK_DGRAM if p["proto"] == "udp" else socket.SOCK_STREAM
    s = socket.socket(family, kind); s.settimeout(timeout)
    try:
        s.connect((p["host"], p["port"]))
        s.sendall(p["send"].encode())
        reply = s.recv(200)
        results[i] = {"ok": True, "reply": reply.decode(errors="replace"), "local": s.getsockname()[0]}
    except Exception as exc:
        results[i] = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)}
    finally:
        s.close()
threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(probes)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(results))
"""


@dataclass
class Hit:
    peer: str
    original_dst: tuple[str, int] | None
    data: bytes


@dataclass
class StandIn:
    """A TCP or UDP server that records who reached it (and the pre-NAT destination) and answers its name."""

    name: str
    host: str
    proto: str = "tcp"
    port: int = 0
    hits: list[Hit] = field(default_factory=list)
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StandIn:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        kind = socket.SOCK_DGRAM if self.proto == "udp" else socket.SOCK_STREAM
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        sock.settimeout(0.2)
        if self.proto == "tcp":
            sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, daemon=True, name=f"standin-{self.name}").start()
        return self

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                if self.proto == "udp":
                    data, peer = self._sock.recvfrom(2048)
                    self.hits.append(Hit(peer[0], None, data))
                    self._sock.sendto(self.name.encode(), peer)
                    continue
                conn, peer = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                original = None
                with contextlib.suppress(OSError):
                    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
                    port, packed = struct.unpack("!2xH4s8x", raw)
                    original = (socket.inet_ntoa(packed), port)
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    data = conn.recv(200)
                self.hits.append(Hit(peer[0], original, data))
                with contextlib.suppress(OSError):
                    conn.sendall(self.name.encode())

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()


@dataclass
class NetNode:
    local: LocalNode
    agent: NodeAgent
    loop: BackgroundLoop
    gateway: str
    standins: dict[str, StandIn]

    def run(self, coro, timeout: float = 300.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)

    async def network(self, sandbox_id: str) -> dict[str, Any]:
        return await self.agent.driver.helper.call("sandbox.network", {"sandbox_id": sandbox_id})  # type: ignore[attr-defined, no-any-return]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _ip_out(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@dataclass
class OtherNamespace:
    """A network namespace that is not a sandbox's, reachable from the host over a veth: it plays both "a
    server in another network namespace" and the cloud metadata service at 169.254.169.254."""

    name: str
    host_side: str = "198.18.7.1"
    addr: str = "198.18.7.2"
    metadata: str = "169.254.169.254"

    def create(self) -> None:
        link = f"{self.name[:10]}h"
        _ip("netns", "add", self.name)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        _ip("addr", "add", f"{self.host_side}/30", "dev", link)
        _ip("link", "set", link, "up")
        _ip("-n", self.name, "addr", "add", f"{self.addr}/30", "dev", "eth0")
        _ip("-n", self.name, "addr", "add", f"{self.metadata}/32", "dev", "eth0")
        _ip("-n", self.name, "link", "set", "eth0", "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        _ip("-n", self.name, "route", "add", "default", "via", self.host_side)
        _ip("route", "add", f"{self.metadata}/32", "via", self.addr)

    def serve(self, ports: list[int]) -> subprocess.Popen[bytes]:
        """Servers inside the namespace; each accepted connection is reported on stdout."""
        code = (
            "import socket, sys, threading\n"
            "def serve(host, port):\n"
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "    s.bind((host, port)); s.listen(16)\n"
            "    while True:\n"
            "        c, a = s.accept(); print(f'{host}:{port} {a[0]}', flush=True)\n"
            "        c.sendall(b'other'); c.close()\n"
            f"for host in ({self.addr!r}, {self.metadata!r}):\n"
            f"    for port in {ports!r}:\n"
            "        threading.Thread(target=serve, args=(host, port), daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "threading.Event().wait()\n"
        )
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.name}", "python3", "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        return proc

    def destroy(self) -> None:
        subprocess.run(["ip", "route", "del", f"{self.metadata}/32"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", f"{self.name[:10]}h"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)


def _host_address() -> str:
    """A global IPv4 address of this machine that is not on a SPACE link (the host's "other services")."""
    for entry in json.loads(_ip_out("-j", "-4", "addr")):
        if entry["ifname"] == "lo" or entry["ifname"].startswith("sp"):
            continue
        for info in entry.get("addr_info", []):
            if info.get("scope") == "global":
                return str(info["local"])
    pytest.fail("this machine has no global IPv4 address to test against")


@pytest.fixture(scope="module")
def net_node(loop: BackgroundLoop) -> Iterator[NetNode]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (runsc, netns, nftables)")
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-net-", dir="/var/tmp")).resolve()
    local = LocalNode(data_dir, network="sandbox")
    try:
        agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
    except BaseException:
        with contextlib.suppress(Exception):
            loop.run(local.stop(purge=True), timeout=300)
        local.stop_helper()
        shutil.rmtree(data_dir, ignore_errors=True)
        raise
    helper = agent.driver.helper  # type: ignore[attr-defined]
    standins: dict[str, StandIn] = {}
    try:
        info = loop.run(helper.call("network.info"))
        gateway = info["gateway_addr"]
        for name in ("proxy", "transparent_http", "transparent_tls", "dns"):
            standins[name] = StandIn(name, gateway).start()
        standins["dns_udp"] = StandIn("dns", gateway, "udp", standins["dns"].port).start()
        ports = {
            name: standins[name].port for name in ("proxy", "transparent_http", "transparent_tls", "dns")
        }
        configured = loop.run(helper.call("network.configure", {"ports": ports}))
        assert configured["ports"] == ports
        yield NetNode(local, agent, loop, gateway, standins)
    finally:
        for standin in standins.values():
            standin.close()
        loop.run(agent.delete_all(), timeout=300)
        loop.run(local.stop(purge=True), timeout=300)
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"


async def _probe(session: GuestSession, probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = await session.exec(["python3", "-c", PROBE, json.dumps(probes), str(PROBE_TIMEOUT_S)])
    assert r.exit_code == 0, r.stderr
    results: list[dict[str, Any]] = json.loads(r.stdout)
    return results


def _tcp(host: str, port: int, send: str = "hi") -> dict[str, Any]:
    return {"proto": "tcp", "host": host, "port": port, "send": send}


def _udp(host: str, port: int, send: str = "query") -> dict[str, Any]:
    return {"proto": "udp", "host": host, "port": port, "send": send}


def _hits_from(standin: StandIn, marker: str) -> list[Hit]:
    return [hit for hit in standin.hits if hit.data == marker.encode()]


def _host_reaches(host: str, port: int) -> bool:
    """Whether the host itself gets an answer there (what a sandbox must not)."""
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            conn.sendall(HOST_CHECK)
            return conn.recv(10) != b""
    except OSError:
        return False


def test_a_sandbox_reaches_the_gateway_and_nothing_else(net_node: NetNode) -> None:
    node, gw = net_node, net_node.gateway
    s = node.standins
    host_addr = _host_address()
    other = OtherNamespace(f"spt{os.getpid()}o")
    # host services the sandbox must not reach: on every address (so also on the gateway's), and on loopback
    everywhere = StandIn("host-service", "0.0.0.0").start()
    loopback = StandIn("host-loopback", "127.0.0.1").start()
    udp_elsewhere = StandIn("udp-elsewhere", gw, "udp").start()
    other.create()
    servers = other.serve([80, 8775])
    try:
        # the stand-ins for the forbidden places do answer the host itself: a refusal below is the rule's
        assert _host_reaches(host_addr, everywhere.port)
        assert _host_reaches(other.addr, 8775)
        assert _host_reaches(other.metadata, 8775)

        async def scenario() -> None:
            async with new_sandbox(node.agent) as a, new_sandbox(node.agent) as b:
                net_a, net_b = await node.network(a.sandbox_id), await node.network(b.sandbox_id)
                assert net_a["sandbox_addr"] == net_b["sandbox_addr"] == str(SANDBOX_ADDR)
                assert net_a["host_addr"] != net_b["host_addr"]
                assert net_a["gateway_addr"] == gw
                assert net_a["ports"]["proxy"] == s["proxy"].port
                # b serves on its own (inner) address; b itself reaches it
                await b.session.start_background(
                    "python3 -c \"import socket; s=socket.socket(); s.bind(('0.0.0.0', 8000)); s.listen(); "
                    "[c.sendall(b'b') or c.close() for c, _ in iter(s.accept, None)]\"",
                    tag="b-server",
                )

                async def b_serves() -> bool:
                    [own] = await _probe(b.session, [_tcp("127.0.0.1", 8000)])
                    return bool(own["ok"] and own["reply"] == "b")

                await eventually(b_serves, what="b's server answers b itself", timeout=20)

                results = await _probe(a.session, [
                    _tcp("10.99.0.1", s["proxy"].port, "via-inner-gateway"),           # 0 allowed
                    _tcp(gw, s["proxy"].port, "via-gateway-addr"),                     # 1 allowed
                    _tcp("203.0.113.9", 80, "transparent-http"),                       # 2 redirected
                    _tcp("203.0.113.9", 443, "transparent-tls"),                       # 3 redirected
                    _udp("203.0.113.53", 53, "dns-udp"),                               # 4 redirected
                    _tcp("203.0.113.53", 53, "dns-tcp"),                               # 5 redirected
                    _tcp(other.metadata, 80, "metadata-80"),                           # 6 -> transparent
                    _tcp(net_b["host_addr"], 8000),                                    # 7 other sandbox
                    _tcp(host_addr, everywhere.port),                                  # 8 host service
                    _tcp(gw, everywhere.port),                                         # 9 host service on gw
                    _tcp("127.0.0.1", loopback.port),                                  # 10 host loopback
                    _tcp(other.metadata, 8775),                                        # 11 metadata
                    _tcp(other.addr, 8775),                                            # 12 other netns
                    _tcp(other.addr, 80, "other-80"),                                  # 13 -> transparent
                    _udp(gw, udp_elsewhere.port, "udp-elsewhere"),                     # 14 other UDP port
                    _udp("203.0.113.53", 5353, "udp-5353"),                            # 15 other UDP
                    _tcp("fd00::2", everywhere.port),                                  # 16 IPv6
                    _udp("10.99.0.1", 53, "dns-inner"),                                # 17 resolv.conf's
                ])  # fmt: skip
                for i in range(6):
                    assert results[i]["ok"], (i, results[i])
                    assert results[i]["local"] == str(SANDBOX_ADDR)
                assert [r["reply"] for r in results[:6]] == [
                    "proxy", "proxy", "transparent_http", "transparent_tls", "dns", "dns"
                ]  # fmt: skip
                # the gateway sees the sandbox's host address, and (transparent) the original destination
                for name, marker in (("proxy", "via-inner-gateway"), ("proxy", "via-gateway-addr"),
                                     ("transparent_http", "transparent-http"),
                                     ("transparent_tls", "transparent-tls"), ("dns_udp", "dns-udp"),
                                     ("dns", "dns-tcp")):  # fmt: skip
                    [hit] = _hits_from(s[name], marker)
                    assert hit.peer == net_a["host_addr"], (name, hit)
                [http] = _hits_from(s["transparent_http"], "transparent-http")
                assert http.original_dst == ("203.0.113.9", 80)
                [tls] = _hits_from(s["transparent_tls"], "transparent-tls")
                assert tls.original_dst == ("203.0.113.9", 443)
                # port 80 to the metadata address or another namespace ends at the gateway, not there
                assert (
                    results[6]["reply"] == "transparent_http" and results[13]["reply"] == "transparent_http"
                )
                [meta] = _hits_from(s["transparent_http"], "metadata-80")
                assert meta.original_dst == (other.metadata, 80)
                for i in (7, 8, 9, 10, 11, 12, 14, 15, 16):
                    assert not results[i]["ok"], (i, results[i])
                for i in (7, 8, 9, 11, 12, 14, 15):  # dropped silently, not refused by someone
                    assert "timed out" in results[i]["error"], (i, results[i])
                stray = everywhere.hits + loopback.hits + udp_elsewhere.hits
                assert [h for h in stray if h.data != HOST_CHECK] == []
                assert not [h for h in s["dns_udp"].hits if h.data == b"udp-5353"]
                assert results[17]["ok"] and results[17]["reply"] == "dns", results[17]
                [inner_dns] = _hits_from(s["dns_udp"], "dns-inner")
                assert inner_dns.peer == net_a["host_addr"]

                # b reaches the gateway too, under its own host address, from the same inner address
                [from_b] = await _probe(b.session, [_tcp("10.99.0.1", s["proxy"].port, "from-b")])
                assert from_b["ok"] and from_b["local"] == str(SANDBOX_ADDR)
                [hit_b] = _hits_from(s["proxy"], "from-b")
                assert hit_b.peer == net_b["host_addr"]

        node.run(scenario())
    finally:
        servers.kill()
        servers.wait()
        other.destroy()
        for standin in (everywhere, loopback, udp_elsewhere):
            standin.close()
    # nothing reached the other namespace's servers (the host's own checks above did, before the sandbox ran)
    assert servers.stdout is not None
    reached = servers.stdout.read().decode().split("\n")
    assert [line for line in reached if line and not line.endswith(" 198.18.7.1")] == []


def test_checkpoint_rollback_restart_and_fork_keep_the_network(net_node: NetNode) -> None:
    node = net_node
    proxy = node.standins["proxy"]

    async def reach(session: GuestSession, marker: str) -> str:
        [result] = await _probe(session, [_tcp("10.99.0.1", proxy.port, marker)])
        assert result["ok"] and result["reply"] == "proxy", (marker, result)
        assert result["local"] == str(SANDBOX_ADDR)
        [hit] = _hits_from(proxy, marker)
        return hit.peer

    async def scenario() -> None:
        children: list[str] = []
        async with new_sandbox(node.agent) as sb:
            sid = sb.sandbox_id
            host = (await node.network(sid))["host_addr"]
            assert await reach(sb.session, "before") == host
            record = await node.agent.checkpoint(sid)  # the sandbox keeps running
            assert await reach(sb.session, "after-checkpoint") == host
            try:
                [child] = await node.agent.fork(sid, snapshot_id=record.snapshot_id)
                children.append(child.sandbox_id)
                child_net = await node.network(child.sandbox_id)
                child_host = child_net["host_addr"]
                assert child_host != host
                assert await reach(child.session, "from-child") == child_host
                await node.agent.rollback(sid, record.snapshot_id)
                assert await reach(sb.session, "after-rollback") == host  # same slot, same host address
                await node.agent.stop(sid)
                await node.agent.start(sid)
                assert await reach(sb.session, "after-restart") == host
            finally:
                await delete_quietly(node.agent, *children)
            assert not (NETNS_DIR / child_net["netns"]).exists()

    node.run(scenario())


def test_destroy_removes_the_sandbox_network(net_node: NetNode) -> None:
    node = net_node

    async def scenario() -> None:
        sb = await node.agent.create("python")
        info = await node.network(sb.sandbox_id)
        netns = NETNS_DIR / info["netns"]
        tag = node_tag(node.local.layout.data_dir)
        edge = NETNS_DIR / info["netns"].replace(f"sp{tag}s", f"sp{tag}e", 1)
        uplink = pathlib.Path("/sys/class/net") / info["netns"].replace(f"sp{tag}s", f"sp{tag}h", 1)
        assert edge != netns and edge.exists() and netns.exists() and uplink.exists()
        routes = _ip_out("-4", "route")
        assert info["host_addr"] in routes
        await node.agent.delete(sb.sandbox_id)
        assert not netns.exists() and not edge.exists() and not uplink.exists()
        routes = _ip_out("-4", "route")
        assert info["host_addr"] not in routes

    node.run(scenario())


def test_gateway_ports_are_validated(net_node: NetNode) -> None:
    helper = net_node.agent.driver.helper  # type: ignore[attr-defined]
    good = {"proxy": 1, "transparent_http": 2, "transparent_tls": 3, "dns": 4}
    assert GatewayPorts.model_validate(good).dns == 4
    for bad in (
        {**good, "dns": 1},  # not distinct
        {**good, "proxy": 0},
        {**good, "proxy": 65536},
        {**good, "proxy": "80"},  # strict: no strings
        {**good, "proxy": True},
        {k: v for k, v in good.items() if k != "dns"},
        {**good, "extra": 5},
    ):
        with pytest.raises(ValidationError):
            GatewayPorts.model_validate(bad)

    async def scenario() -> None:
        from space.core import errors

        with pytest.raises(errors.InvalidArgument):
            await helper.call("network.configure", {"ports": {**good, "dns": "53; flush ruleset"}})
        with pytest.raises(errors.InvalidArgument):
            await helper.call("sandbox.network", {"sandbox_id": "../../etc"})
        with pytest.raises(errors.NotFound):
            await helper.call("sandbox.network", {"sandbox_id": "sb-" + "a" * 26})
        info = await helper.call("network.info")
        assert ipaddress.IPv4Address(info["gateway_addr"]) in ipaddress.IPv4Network(info["block"])

    net_node.run(scenario())


def test_a_restarted_helper_keeps_recorded_slots_and_sweeps_the_rest() -> None:
    """What node.prepare does after a helper was killed: slots a sandbox records survive (its sandbox may
    still run), slots nobody records (a pool, a half-made slot) are deleted; teardown leaves nothing."""
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-netsweep-", dir="/var/tmp")).resolve()
    layout = NodeLayout(data_dir)
    first = SandboxNetworks(layout, pool_size=2)
    second = SandboxNetworks(layout, pool_size=0)
    try:
        first.prepare()
        sandbox_id = "sb-" + "b" * 26
        layout.bundle(sandbox_id).mkdir(parents=True)
        config: dict[str, Any] = {}
        prefix = first.attach(sandbox_id, config)
        slot = json.loads((layout.run_dir(sandbox_id) / "network.json").read_text())["slot"]
        assert prefix[:2] == ["nsenter", f"--net={NETNS_DIR / first.sandbox_ns(slot)}"]
        assert {"type": "network", "path": str(NETNS_DIR / first.sandbox_ns(slot))} in config["linux"][
            "namespaces"
        ]
        half_made = slot + 50
        _ip("netns", "add", first.sandbox_ns(half_made))
        pooled = set(first.settle())
        assert len(pooled) == 2
        # a repeated node.prepare in the same helper keeps its own pool and the recorded slot
        first.prepare()
        assert set(first.settle()) == pooled
        assert all((NETNS_DIR / first.sandbox_ns(p)).exists() for p in pooled | {slot})
        assert not (NETNS_DIR / first.sandbox_ns(half_made)).exists()
        # the helper dies (nothing of it runs any more) and a new one prepares the node
        second.prepare()
        left = {int(n.name[len(f"sp{first.tag}s") :]) for n in NETNS_DIR.glob(f"sp{first.tag}s*")}
        assert left == {slot}
        assert second.describe(sandbox_id)["host_addr"] == first.describe(sandbox_id)["host_addr"]
        # a recorded slot whose sandbox is gone is swept too
        shutil.rmtree(layout.bundle(sandbox_id))
        second.prepare()
        expected = {f"link {first.gateway_link}", f"link sp{first.tag}gp", f"nft table inet {first.table}"}
        assert set(network_traces(first.tag)) == expected
    finally:
        second.teardown()
        first.teardown()
        shutil.rmtree(data_dir, ignore_errors=True)
    assert network_traces(first.tag) == []


def test_a_running_sandbox_keeps_its_network_across_a_helper_restart(net_node: NetNode) -> None:
    """The helper is stopped and started again while a sandbox runs; node.prepare rebuilds the node table
    (with the gateway ports it kept), keeps the sandbox's slot and sweeps the old helper's pool."""
    node = net_node
    proxy = node.standins["proxy"]
    helper = node.agent.driver.helper  # type: ignore[attr-defined]

    async def reach(session: GuestSession, marker: str) -> str:
        [result] = await _probe(session, [_tcp("10.99.0.1", proxy.port, marker)])
        assert result["ok"], (marker, result)
        [hit] = _hits_from(proxy, marker)
        return hit.peer

    async def scenario() -> None:
        async with new_sandbox(node.agent) as sb:
            host = (await node.network(sb.sandbox_id))["host_addr"]
            assert await reach(sb.session, "before-helper-restart") == host
            tag = node_tag(node.local.layout.data_dir)
            node.local.stop_helper()
            await helper.close()  # its pooled connections went with the old helper
            # the nft table is not the helper process's: the sandbox keeps its network meanwhile
            assert await reach(sb.session, "helper-down") == host
            node.local.start_helper()
            await node.agent.driver.prepare()
            assert await reach(sb.session, "after-helper-restart") == host
            info = await helper.call("network.info")
            assert info["ports"]["proxy"] == proxy.port
            async with new_sandbox(node.agent) as other:
                other_host = (await node.network(other.sandbox_id))["host_addr"]
                assert other_host != host
                assert await reach(other.session, "new-after-restart") == other_host
            slots = {p.name for p in NETNS_DIR.glob(f"sp{tag}s*")}
            assert (await node.network(sb.sandbox_id))["netns"] in slots

    node.run(scenario())


def test_runsc_keeps_no_other_file_system_busy(net_node: NetNode) -> None:
    """runsc starts in a mount namespace of its own and leaves its sandbox and gofer (runsc runs detached,
    ADR 0045), which live as long as the sandbox: a host mount that existed when it started must not stay
    pinned in any of them (another node's image, a disk the operator unmounts)."""
    node = net_node
    other_mount = pathlib.Path(tempfile.mkdtemp(prefix="space-test-pin-", dir="/var/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "space-test-pin", str(other_mount)], check=True)
    try:

        async def scenario() -> None:
            async with new_sandbox(node.agent) as sb:
                layout = node.local.layout
                container = (layout.run_dir(sb.sandbox_id) / "container").read_text().strip()
                state = json.loads((layout.runsc_root / f"{container}_sandbox:{container}.state").read_text())
                for pid in (state["sandbox"]["pid"], state["goferPid"]):
                    mountinfo = pathlib.Path(f"/proc/{pid}/mountinfo").read_text()
                    points = {line.split()[4] for line in mountinfo.splitlines()}
                    assert str(other_mount) not in points, (pid, points)
                    assert str(layout.data_dir) not in points, (pid, points)  # nothing of the host at all
                # The rmem_default workaround was in place when runsc started: the sandbox has its network.
                [result] = await _probe(sb.session, [_tcp("10.99.0.1", node.standins["proxy"].port, "pin")])
                assert result["ok"], result

        node.run(scenario())
    finally:
        subprocess.run(["umount", str(other_mount)], check=True)
        other_mount.rmdir()
