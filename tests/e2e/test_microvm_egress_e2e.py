"""Egress from real microVM sandboxes, end to end (docs/adr/0080-microvm-egress.md): a qemu node with
network = "sandbox", QEMU under TCG on a tap bridged to its slot's veth end, the same edge namespace and
nftables table as gVisor's, the node agent's real EgressGateway, and upstream test servers in namespaces of
their own (tests/support/egress_net.py, as tests/e2e/test_egress_e2e.py does for gVisor).

- an allowed name is reachable through the proxy and transparently (DNS, TCP 80/443 redirected); a denied
  name, IP literals and the metadata address are refused (that test's list), and raw connections reach
  neither the upstreams' other ports, the metadata address, the node's gateway address on another port,
  nor any address of the host's own namespace (a listener there sees nothing); a source address the
  guest gives itself (it is a real kernel, root inside) gets nowhere;
- a checkpoint, rollback, stop/start (a cold boot) and fork keep egress: every fork child gets its own
  slot (another host address as the gateway sees it, which no other sandbox reaches) while the guest's
  address and MAC stay the ones every sandbox has;
- the node's teardown leaves no namespace, link (tap, bridge, veth) or nftables table.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest

from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.egress_sandbox import CA_BUNDLE_PATH
from space.node.agent.egress_settings import EgressRequest, EgressSettings
from space.node.agent.egress_wiring import EgressDriver, EgressWiring, install
from space.node.agent.settings import NodeAgentSettings
from space.node.egress import StaticCredentials, StaticResolver
from space.node.helper.netaddr import SANDBOX_ADDR, SANDBOX_MAC, node_tag
from space.node.local import LocalNode
from tests.support.egress_net import Upstream, api_and_evil, leftovers, remove_cgroup_parent
from tests.support.egress_probe import METADATA, echo, fetch, refused, resolve
from tests.support.host import network_traces
from tests.support.loop import BackgroundLoop
from tests.support.sandboxes import delete_quietly

pytestmark = pytest.mark.root

CGROUP_PARENT = "space-emv"

# Raw TCP connects from inside the guest, one result line each: "connected <addr>" must never appear.
CONNECT = r"""
import json, socket, sys
for host, port in json.loads(sys.argv[1]):
    s = socket.socket(); s.settimeout(2)
    try: s.connect((host, port)); print('connected', host, port)
    except OSError as e: print('refused', host, port, e)
"""

# The same from source addresses the guest gives itself first (netlink RTM_NEWADDR on eth0, as root in the
# guest: a real kernel can send from any address it is told to hold); one "<source> <result>" line each.
FORGE = r"""
import json, socket, struct, sys
def rta(kind, data):
    return struct.pack("HH", 4 + len(data), kind) + data
index = socket.if_nametoindex("eth0")
nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
held = {"10.99.0.2"}
for src, host, port in json.loads(sys.argv[1]):
    if src not in held:
        held.add(src)
        packed = socket.inet_aton(src)
        body = struct.pack("BBBBI", socket.AF_INET, 32, 0, 0, index) + rta(2, packed) + rta(1, packed)
        nl.sendto(struct.pack("IHHII", 16 + len(body), 20, 0x1 | 0x4 | 0x400, 1, 0) + body, (0, 0))
        err = struct.unpack("i", nl.recv(4096)[16:20])[0]
        assert err == 0, ("RTM_NEWADDR", src, err)
    s = socket.socket(); s.settimeout(2)
    try:
        s.bind((src, 0)); s.connect((host, port)); print("connected", src, host, port, s.getsockname()[0])
    except OSError as e:
        print("refused", src, host, port, e)
"""


@dataclass
class HostListener:
    """A TCP listener on every address of the host's own namespace; counts whoever reaches it."""

    sock: socket.socket
    accepted: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.accepted.append(str(peer))
            conn.close()


@dataclass
class MicrovmEgressNode:
    local: LocalNode
    agent: NodeAgent
    wiring: EgressWiring
    loop: BackgroundLoop
    api: Upstream
    evil: Upstream
    upstream_ca: pathlib.Path

    def run(self, coro, timeout: float = 600.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)

    @contextlib.asynccontextmanager
    async def running(self, policy: EgressRequest | None) -> AsyncIterator[SandboxHandle]:
        handle = await self.sandbox(policy)
        try:
            yield handle
        finally:
            await delete_quietly(self.agent, handle.sandbox_id)

    async def sandbox(self, policy: EgressRequest | None) -> SandboxHandle:
        from space.core.ids import new_sandbox_id

        sandbox_id = new_sandbox_id()
        if policy is not None:
            self.wiring.remember(sandbox_id, policy)
        handle = await self.agent.create("python", sandbox_id=sandbox_id)
        # The test upstreams' CA stands for the public roots a real trust store holds (for spliced TLS).
        await handle.session.write_file(CA_BUNDLE_PATH, self.upstream_ca.read_bytes(), append=True)
        return handle

    async def host_addr(self, sandbox_id: str) -> str:
        network = await self.wiring.helper.call("sandbox.network", {"sandbox_id": sandbox_id})
        return str(network["host_addr"])


def _qemu_processes(data_dir: pathlib.Path) -> list[str]:
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes()
            if b"qemu-system" in text and str(data_dir).encode() in text:
                found.append(cmdline.parent.name)
    return found


@pytest.fixture(scope="module")
def microvm_egress_node(loop: BackgroundLoop) -> Iterator[MicrovmEgressNode]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (QEMU's jail, netns, nftables)")
    tag = f"smv{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-mvegress-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-mvegress-", dir="/var/tmp")).resolve()
    local = LocalNode(
        data_dir, network="sandbox", cgroup_parent=CGROUP_PARENT, settings=NodeAgentSettings(driver="qemu")
    )
    agent: NodeAgent | None = None
    try:
        with api_and_evil(tag, workdir, 51) as up:
            agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
            settings = EgressSettings(
                state_dir=data_dir / "egress",
                resolver=StaticResolver(up.names()),
                trust_store=up.test_ca.ca_file,
                operator_allowed_networks=[ipaddress.ip_network("10.98.0.0/16")],
                credentials=StaticCredentials(),
            )
            wiring = loop.run(install(agent, settings))
            assert wiring is not None and isinstance(agent.driver, EgressDriver)
            try:
                yield MicrovmEgressNode(local, agent, wiring, loop, up.api, up.evil, up.test_ca.ca_file)
            finally:
                loop.run(agent.delete_all(), timeout=300)
    finally:
        with contextlib.suppress(Exception):
            loop.run(local.stop(purge=True), timeout=300)
        remove_cgroup_parent(CGROUP_PARENT)
        shutil.rmtree(workdir, ignore_errors=True)
    assert _qemu_processes(data_dir) == [], "QEMU processes left behind"
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"
    assert leftovers(tag) == [], "upstream namespaces left behind"


def _host_addresses() -> list[str]:
    """Every IPv4 address of the test's (the host's) own network namespace."""
    shown = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    found = {info["local"] for entry in json.loads(shown.stdout) for info in entry.get("addr_info", [])}
    # not loopback: inside the guest that is the guest's own
    return sorted(addr for addr in found if not ipaddress.ip_address(addr).is_loopback)


def test_microvm_egress_allowed_refused_and_nothing_else(microvm_egress_node: MicrovmEgressNode) -> None:
    node = microvm_egress_node
    listener = HostListener(socket.create_server(("0.0.0.0", 0), backlog=16))
    threading.Thread(target=listener.serve, daemon=True).start()

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["api.test", "*.test"], deny=["evil.test"])) as sb:
            # a real kernel with the address every sandbox has, on a virtio-net device
            link = await sb.session.exec(["sh", "-c", "cat /sys/class/net/eth0/address; uname -r"])
            assert link.stdout.decode().split()[0] == SANDBOX_MAC
            assert link.stdout.decode().strip().endswith("-amd64")
            before = len(node.evil.requests())
            results = await fetch(sb, [
                {"url": "https://api.test/echo"},                               # 0 CONNECT through the proxy
                {"url": "http://api.test/echo"},                                # 1 plain HTTP, proxy
                {"url": "https://api.test/echo", "direct": True},               # 2 transparent TLS (SNI)
                {"url": "http://api.test/echo", "direct": True},                # 3 transparent HTTP (Host)
                {"url": "https://evil.test/echo"},                              # 4 denied name (proxy)
                {"url": "http://evil.test/echo", "direct": True},               # 5 denied (transparent)
                {"url": "https://EVIL.test./echo"},                             # 6 case + trailing dot
                {"url": f"https://{node.evil.addr}/echo"},                      # 7 IP literal (proxy)
                {"url": f"http://{node.evil.addr}/echo", "direct": True},       # 8 IP literal (transparent)
                {"url": "http://0x0a623402/echo", "direct": True},              # 9 hex literal of evil
                {"url": f"http://{METADATA}/latest/meta-data/"},                # 10 metadata (proxy)
                {"url": f"http://{METADATA}/latest/meta-data/", "direct": True},  # 11 metadata (transparent)
                {"url": "http://meta.test/"},                                   # 12 name -> metadata
            ])  # fmt: skip
            for i, result in enumerate(results[:4]):
                body = echo(result)
                assert body["server"] == "api", (i, body)
            assert [echo(r)["tls"] for r in results[:4]] == [True, False, True, False]
            for i, result in enumerate(results[4:], start=4):
                assert refused(result), (i, result)
            assert len(node.evil.requests()) == before, "a refused request reached the denied upstream"
            names = await resolve(sb, ["api.test", "evil.test", "meta.test"])
            assert names["api.test"] == [node.api.addr]
            assert str(names["evil.test"]).startswith("error")
            assert str(names["meta.test"]).startswith("error")
            # raw connections: the upstreams' other ports, the metadata address, the node's gateway address
            # on a port that is not the gateway's, and every address of the host's own namespace
            gateway = str(node.wiring.network_info["gateway_addr"])
            targets = [[node.evil.addr, 8443], [node.evil.addr, 22], [node.api.addr, 22], [METADATA, 8775],
                       [gateway, listener.port], [gateway, 22]]  # fmt: skip
            targets += [[addr, listener.port] for addr in _host_addresses()]
            raw = await sb.session.exec(["python3", "-c", CONNECT, json.dumps(targets)], timeout=120)
            assert raw.exit_code == 0, raw.stderr
            assert b"connected" not in raw.stdout, raw.stdout
            lines = raw.stdout.decode().splitlines()
            assert len([line for line in lines if line.startswith("refused ")]) == len(targets), lines
            assert listener.accepted == [], "the guest reached the host's own namespace"
            # forged source addresses the guest gave itself: another inner one, the node's gateway address,
            # a host address of another slot; the sandbox's own address through the same path is the control
            proxy = int(node.wiring.gateway.ports["proxy"])
            other_slot = str(ipaddress.ip_address(await node.host_addr(sb.sandbox_id)) + 1)
            spoofed = [["10.99.0.2", "10.99.0.1", proxy]]
            spoofed += [[src, host, port] for src in ("10.99.0.5", gateway, other_slot)
                        for host, port in (("10.99.0.1", proxy), (node.api.addr, 443))]  # fmt: skip
            forged = await sb.session.exec(["python3", "-c", FORGE, json.dumps(spoofed)], timeout=120)
            assert forged.exit_code == 0, forged.stderr
            lines = forged.stdout.decode().splitlines()
            assert lines[0] == f"connected 10.99.0.2 10.99.0.1 {proxy} 10.99.0.2", lines
            assert len(lines) == len(spoofed), lines
            assert all(line.startswith("refused ") for line in lines[1:]), lines

    try:
        node.run(scenario())
    finally:
        listener.sock.close()


def test_microvm_without_policy_has_no_egress(microvm_egress_node: MicrovmEgressNode) -> None:
    node = microvm_egress_node

    async def scenario() -> None:
        async with node.running(None) as sb:
            results = await fetch(sb, [
                {"url": "https://api.test/echo"},
                {"url": f"http://{node.api.addr}/echo", "direct": True},
            ])  # fmt: skip
            assert all(refused(r) for r in results), results

    node.run(scenario())


def test_microvm_checkpoint_rollback_and_fork_keep_egress(microvm_egress_node: MicrovmEgressNode) -> None:
    node = microvm_egress_node
    allowed = [{"url": "https://api.test/echo"}, {"url": "http://api.test/echo", "direct": True}]

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["api.test"])) as sb:
            parent_addr = await node.host_addr(sb.sandbox_id)
            record = await node.agent.checkpoint(sb.sandbox_id)
            assert all(echo(r)["server"] == "api" for r in await fetch(sb, allowed))
            await node.agent.rollback(sb.sandbox_id, record.snapshot_id)
            assert await node.host_addr(sb.sandbox_id) == parent_addr  # its own slot again
            assert all(echo(r)["server"] == "api" for r in await fetch(sb, allowed))
            # stop + start: a cold boot from its own disk, in its own slot, whose init sets eth0 up again
            await node.agent.stop(sb.sandbox_id)
            await node.agent.start(sb.sandbox_id)
            assert await node.host_addr(sb.sandbox_id) == parent_addr
            assert all(echo(r)["server"] == "api" for r in await fetch(sb, allowed))
            children = await node.agent.fork(sb.sandbox_id, snapshot_id=record.snapshot_id, count=2)
            try:
                addrs = {parent_addr}
                for child in children:
                    addrs.add(await node.host_addr(child.sandbox_id))
                    results = await fetch(child, [*allowed, {"url": "https://evil.test/echo"}])
                    assert [echo(r)["server"] for r in results[:2]] == ["api", "api"], results
                    assert refused(results[2]), results[2]
                    shown = await child.session.exec(["cat", "/sys/class/net/eth0/address"])
                    assert shown.stdout.decode().strip() == SANDBOX_MAC
                assert len(addrs) == 3, "a fork child shares a slot (host address) with another sandbox"
                # another sandbox, as the node sees it (its host address), is not reachable from a guest
                own = await node.host_addr(children[0].sandbox_id)
                others = [[addr, port] for addr in sorted(addrs - {own}) for port in (22, 8080)]
                argv = ["python3", "-c", CONNECT, json.dumps(others)]
                raw = await children[0].session.exec(argv, timeout=60)
                assert raw.exit_code == 0, raw.stderr
                assert b"connected" not in raw.stdout, raw.stdout
                route = await children[0].session.exec(["cat", "/proc/net/route"])
                assert "eth0" in route.stdout.decode()
                # the guest's own address, as every sandbox has it (fib_trie names the local address)
                trie = await children[0].session.exec(["cat", "/proc/net/fib_trie"])
                assert str(SANDBOX_ADDR) in trie.stdout.decode()
            finally:
                await delete_quietly(node.agent, *(c.sandbox_id for c in children))

    node.run(scenario())
