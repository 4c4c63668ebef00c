"""Exhaustion from inside real sandboxes (issue 9, ADR 0026): runsc with network = "sandbox", the node's
egress gateway wired in (policy per sandbox, DNS to a real nameserver in its own network namespace that
never answers the flood's names), an abuser next to a neighbour. Each attack must be contained, and the
neighbour's exec keeps answering throughout: its latency (p50 / max) is measured during every attack and
printed (`pytest -s`) for the closing note.

Fork bomb, memory balloon and disk filler are in tests/runtime/test_runsc_limits.py (same probe,
which reports its p50 / max too); this module adds file descriptors, a DNS flood and 4,000 TCP
connections toward the gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.egress_settings import EgressRequest, EgressSettings
from space.node.agent.egress_wiring import EgressWiring, install
from space.node.egress import dns as egress_dns
from space.node.egress.dns import SystemResolver
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode
from tests.support.egress_net import REPO, leftovers, veth_namespace
from tests.support.host import network_traces
from tests.support.loop import BackgroundLoop
from tests.support.neighbours import NeighbourProbe, node_healthy
from tests.support.sandboxes import delete_quietly

pytestmark = pytest.mark.root

CGROUP_PARENT = "space-exh"
NS_ADDR = "10.98.31.2"
RESULTS: dict[str, dict[str, float]] = {}


@dataclass
class ExhaustionNode:
    local: LocalNode
    agent: NodeAgent
    wiring: EgressWiring
    loop: BackgroundLoop
    nameserver_log: pathlib.Path

    def run(self, coro, timeout: float = 600.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)

    async def sandbox(self, allow: list[str]) -> SandboxHandle:
        sandbox_id = new_sandbox_id()
        self.wiring.remember(sandbox_id, EgressRequest(allow=allow))
        return await self.agent.create("python", sandbox_id=sandbox_id)


@pytest.fixture(scope="module")
def exhaustion_node(loop: BackgroundLoop) -> Iterator[ExhaustionNode]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (runsc, netns, nftables); CI runs as root")
    tag = f"spx{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-exhaustion-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-exh-", dir="/var/tmp")).resolve()
    namespace, host_if, peer_if = f"{tag}-ns", f"{tag[-8:]}nsh", f"{tag[-8:]}nsn"
    log = workdir / "queries.log"
    local = LocalNode(data_dir, network="sandbox", cgroup_parent=CGROUP_PARENT)
    agent: NodeAgent | None = None
    nameserver: subprocess.Popen[bytes] | None = None
    try:
        veth_namespace(namespace, host_if, peer_if, "10.98.31.1", NS_ADDR)
        nameserver = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{namespace}", sys.executable, "-m",
             "tests.support.dns_upstream", "--listen", NS_ADDR, "--log", str(log)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
        settings = EgressSettings(state_dir=data_dir / "egress", resolver=SystemResolver([NS_ADDR]))
        wiring = loop.run(install(agent, settings))
        assert wiring is not None
        yield ExhaustionNode(local, agent, wiring, loop, log)
    finally:
        try:
            if agent is not None:
                loop.run(agent.delete_all(), timeout=300)
                loop.run(local.stop(purge=True), timeout=300)
            else:
                with contextlib_suppress():
                    loop.run(local.stop(purge=True), timeout=300)
        finally:  # a failed purge (reported) must not leave the test's own namespace behind too
            if nameserver is not None:
                nameserver.kill()
                nameserver.wait(5)
            subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"):
            with contextlib_suppress():
                parent.rmdir()
        shutil.rmtree(workdir, ignore_errors=True)
        if RESULTS:
            print("\nneighbour exec latency during each attack (ms):")
            for attack, numbers in RESULTS.items():
                p50, worst, n = numbers["p50"], numbers["max"], numbers["n"]
                print(f"  {attack:<12} p50 {p50:7.1f}  max {worst:7.1f}  n={n:.0f}")
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"
    assert leftovers(tag) == [], "the nameserver's namespace was left behind"


def contextlib_suppress():  # type: ignore[no-untyped-def]
    import contextlib

    return contextlib.suppress(Exception)


def record(attack: str, probe: NeighbourProbe) -> None:
    latencies = [x * 1000 for x in probe.latencies]
    RESULTS[attack] = {"p50": statistics.median(latencies), "max": max(latencies), "n": len(latencies)}
    print(
        f"{attack}: neighbour exec p50 {RESULTS[attack]['p50']:.1f} ms, max {RESULTS[attack]['max']:.1f} ms"
    )


def host_fds(sandbox_id: str) -> int:
    """Host file descriptors held by every process in the sandbox's cgroup (Sentry, gofer, stubs)."""
    base = pathlib.Path("/sys/fs/cgroup/pids") / CGROUP_PARENT
    groups = [g for g in base.glob(f"{sandbox_id}*") if g.name.split("-", 2)[:2] == sandbox_id.split("-")]
    assert groups, f"no cgroup of {sandbox_id} under {base}"
    total = 0
    pids = [pid for group in groups for pid in (group / "cgroup.procs").read_text().split()]
    for pid in pids:
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return total


FD_HOG = r"""
import json, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
except (ValueError, OSError):
    pass
opened, error = [], ""
while len(opened) < 2_000_000:
    try:
        opened.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        error = exc.strerror or str(exc)
        break
limit = resource.getrlimit(resource.RLIMIT_NOFILE)
print(json.dumps({"opened": len(opened), "error": error, "limit": limit}))
"""


def test_fd_exhaustion_stops_at_emfile(exhaustion_node: ExhaustionNode) -> None:
    node = exhaustion_node

    async def scenario() -> None:
        abuser = await node.sandbox([])
        neighbour = await node.sandbox([])
        try:
            before = host_fds(abuser.sandbox_id)
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            try:
                result = await abuser.session.exec(["python3", "-c", FD_HOG], timeout=300)
                during = host_fds(abuser.sandbox_id)
                await asyncio.sleep(1.0)
            finally:
                await probe.stop()
            outcome = json.loads(result.stdout)
            print(f"fd hog: {outcome}; host fds of the sandbox {before} -> {during}")
            assert outcome["error"] == "Too many open files", outcome  # EMFILE inside, not a crash
            # The guest's descriptors live in gVisor's kernel, capped by its RLIMIT_NOFILE; the host side
            # grows by a small, bounded amount (measured: +517 host fds for 65,533 guest fds), never one
            # host descriptor per guest descriptor.
            assert outcome["opened"] <= outcome["limit"][1], outcome
            assert during - before <= 2048 and during - before < outcome["opened"] // 16, (before, during)
            probe.check()
            record("fds", probe)
            await node_healthy(node.agent, neighbour)
            assert (await abuser.session.exec("echo ok")).stdout == b"ok\n"  # the abuser itself recovers
        finally:
            await delete_quietly(node.agent, abuser.sandbox_id, neighbour.sandbox_id)

    node.run(scenario())


DNS_FLOOD = r"""
import json, os, socket, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setblocking(False)
sent = 0
started = time.monotonic()
for i in range(int(os.environ["COUNT"])):
    name = os.urandom(6).hex() + ".flood.test"
    query = os.urandom(2) + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    for label in name.split("."):
        query += bytes([len(label)]) + label.encode()
    query += b"\x00\x00\x01\x00\x01"
    try:
        sock.sendto(query, ("10.99.0.1", 53))
        sent += 1
    except BlockingIOError:
        time.sleep(0.001)
print(json.dumps({"sent": sent, "seconds": round(time.monotonic() - started, 2)}))
"""

RESOLVE_FAST = r"""
import socket, time
started = time.monotonic()
print(socket.gethostbyname("fast.test"), round(time.monotonic() - started, 3))
"""


def test_dns_flood_is_capped_per_sandbox(exhaustion_node: ExhaustionNode) -> None:
    node = exhaustion_node
    gateway = node.wiring.gateway

    async def scenario() -> None:
        abuser = await node.sandbox(["*.flood.test"])
        neighbour = await node.sandbox(["fast.test"])
        try:
            source = gateway.ctx.sandboxes[abuser.sandbox_id].source_addr
            seen_before = (
                len(node.nameserver_log.read_text().splitlines()) if node.nameserver_log.exists() else 0
            )
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            peak = 0
            try:
                flood = asyncio.create_task(
                    abuser.session.exec(["python3", "-c", DNS_FLOOD], env={"COUNT": "5000"}, timeout=300)
                )
                while not flood.done():
                    peak = max(peak, gateway._dns.in_flight.by_source.get(source, 0))
                    await asyncio.sleep(0.005)
                sent = json.loads((await flood).stdout)
                # The neighbour still resolves through the same gateway while the flood's slots are held.
                resolved = await neighbour.session.exec(["python3", "-c", RESOLVE_FAST], timeout=30)
                await asyncio.sleep(egress_dns.RESOLVE_TIMEOUT_S + 1.0)
            finally:
                await probe.stop()
            upstream = len(node.nameserver_log.read_text().splitlines()) - seen_before
            print(f"dns flood: {sent}; peak in flight for the abuser {peak}; upstream queries {upstream}; "
                  f"neighbour resolved: {resolved.stdout!r}")  # fmt: skip
            assert sent["sent"] >= 1000, sent
            assert peak <= egress_dns.MAX_QUERIES_PER_SOURCE, peak
            # A+AAAA and one retry per lookup at most, for far fewer lookups than queries sent.
            assert upstream <= sent["sent"] // 4, upstream
            assert resolved.exit_code == 0 and resolved.stdout.startswith(b"1.2.3.4"), resolved
            assert gateway._dns.in_flight.by_source.get(source, 0) == 0  # all released after the timeout
            probe.check()
            record("dns-flood", probe)
            await node_healthy(node.agent, neighbour)
        finally:
            await delete_quietly(node.agent, abuser.sandbox_id, neighbour.sandbox_id)

    node.run(scenario())


SOCKETS = r"""
import json, os, resource, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port = int(os.environ["PORT"])
held, refused, errors = [], 0, {}
for i in range(4000):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(("10.99.0.1", port))
        held.append(s)
    except OSError as exc:
        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        s.close()
time.sleep(1.0)
alive = 0
for s in held:
    s.setblocking(False)
    try:
        alive += s.recv(1) != b""
    except BlockingIOError:
        alive += 1  # open and silent: the gateway kept it
    except OSError:
        pass
print(json.dumps({"connected": len(held), "alive_after_1s": alive, "errors": errors,
                  "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}))
time.sleep(float(os.environ["HOLD"]))
"""


def test_four_thousand_connections_toward_the_gateway(exhaustion_node: ExhaustionNode) -> None:
    node = exhaustion_node
    gateway = node.wiring.gateway
    cap = gateway.max_connections_per_source

    async def scenario() -> None:
        abuser = await node.sandbox(["fast.test"])
        neighbour = await node.sandbox(["fast.test"])
        try:
            source = gateway.ctx.sandboxes[abuser.sandbox_id].source_addr
            own_fds_before = len(os.listdir("/proc/self/fd"))  # the gateway runs in this process
            probe = NeighbourProbe(neighbour.session)
            probe.start()
            peak_held, peak_fds = 0, own_fds_before
            try:
                env = {"PORT": str(gateway.ports["proxy"]), "HOLD": "3"}
                attack = asyncio.create_task(
                    abuser.session.exec(["python3", "-c", SOCKETS], env=env, timeout=300)
                )
                while not attack.done():
                    peak_held = max(peak_held, gateway._per_source.get(source, 0))
                    peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
                    await asyncio.sleep(0.02)
                result = await attack
                resolved = await neighbour.session.exec(["python3", "-c", RESOLVE_FAST], timeout=30)
            finally:
                await probe.stop()
            outcome = json.loads(result.stdout)
            print(f"4000 sockets: {outcome}; gateway held at most {peak_held} for the abuser (cap {cap}); "
                  f"this process's fds {own_fds_before} -> peak {peak_fds}")  # fmt: skip
            assert result.exit_code == 0, result.stderr[-500:]
            assert peak_held <= cap, peak_held
            assert outcome["alive_after_1s"] <= cap, outcome
            # Held connections are capped; beyond them only the batch being accepted and closed at once
            # (asyncio accepts up to its backlog per round) is open. Measured: +712 for 4,000 attempts.
            assert peak_fds <= own_fds_before + cap + 400, (own_fds_before, peak_fds)
            assert resolved.exit_code == 0 and resolved.stdout.startswith(b"1.2.3.4"), resolved
            probe.check()
            record("4000-sockets", probe)
            await node_healthy(node.agent, neighbour)
        finally:
            await delete_quietly(node.agent, abuser.sandbox_id, neighbour.sandbox_id)

    node.run(scenario())
