"""Egress from real sandboxes, end to end (network = "sandbox"): runsc in per-sandbox network namespaces
behind the node's nftables table, the node agent's EgressGateway (space.node.agent.egress_wiring), real TLS,
and upstream test servers in their own network namespaces (tests/support/egress_net.py) that play "the
Internet" (the operator opens 10.98.0.0/16 for them, as if they were public). Inside the sandbox everything
runs with python3's urllib (which follows HTTP(S)_PROXY and SSL_CERT_FILE) or raw sockets, via exec.

Node only (in-process agents, StaticCredentials):
- an allowed name is reachable through the explicit proxy (HTTP and HTTPS CONNECT) and transparently (DNS
  from the gateway, TCP 80/443 redirected and decided by Host/SNI); DNS answers only allowed names;
- a denied name (any case, trailing dot), IP literals (dotted, hex), the metadata address, other ports are
  refused; a sandbox without a policy has no egress at all; a policy change takes effect at once;
- a canary credential: the upstream receives the real value, while the sandbox's environment, files (the
  whole root filesystem, searched on the host), processes (/proc/*/environ, cmdline) and a full checkpoint
  image (searched on disk) never contain it, also when the placeholder goes to an unbound host or through
  a redirect (positive controls: the placeholder IS found where it was put);
- the node's CA is rewritten into the trust store on every boot and restore (rollback, stop/start, fork
  children, and a restore from object storage on a second node, which then trusts that node's CA);
- the node RPC: create with a policy, policy push with versions; an agent restart adopts running
  sandboxes with their policies.
Through the control plane (LocalCluster, agent as the unprivileged user): credential store -> node-facing
credential route -> injection, placeholder env from the control plane, policy push via the API, audit events
forwarded, fork and suspend/restore keep the policy, no canary in the checkpoint image or the object store.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.app import create_app
from space.node.agent.egress_sandbox import CA_BEGIN, CA_BUNDLE_PATH, CA_FILE_PATH
from space.node.agent.egress_settings import EgressRequest, EgressSettings
from space.node.agent.egress_wiring import EgressDriver, EgressWiring, install
from space.node.drivers.base import SandboxSpec
from space.node.egress import Credential, StaticCredentials, StaticResolver
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode, connect_agent
from space.node.rpc_client import NodeClient
from space.objectstore.backends import open_store
from tests.support.egress_net import (
    Upstream,
    api_and_evil,
    cluster_egress_config,
    leftovers,
    remove_cgroup_parent,
)
from tests.support.egress_probe import FETCH, METADATA, echo, fetch, refused, resolve
from tests.support.host import network_traces, runtime_id
from tests.support.loop import BackgroundLoop
from tests.support.sandboxes import delete_quietly

pytestmark = pytest.mark.root

CANARY = "CANARY-e2e-" + os.urandom(8).hex()
PLACEHOLDER = "space-cred-gh-" + os.urandom(12).hex()


@dataclass
class EgressNode:
    local: LocalNode
    agent: NodeAgent
    wiring: EgressWiring
    loop: BackgroundLoop
    api: Upstream
    evil: Upstream
    upstream_ca: pathlib.Path
    credentials: StaticCredentials
    store_url: str
    settings: Callable[[pathlib.Path], EgressSettings]  # a node's egress settings, by its data directory

    def run(self, coro, timeout: float = 300.0):  # type: ignore[no-untyped-def]
        return self.loop.run(coro, timeout)

    @contextlib.asynccontextmanager
    async def running(
        self, policy: EgressRequest | None, env: dict[str, str] | None = None, credential: bool = False
    ) -> AsyncIterator[SandboxHandle]:
        """`sandbox(...)`, deleted again when the block ends (however it ends)."""
        sb = await self.sandbox(policy, env, credential)
        try:
            yield sb
        finally:
            await delete_quietly(self.agent, sb.sandbox_id)

    async def sandbox(
        self, policy: EgressRequest | None, env: dict[str, str] | None = None, credential: bool = False
    ) -> SandboxHandle:
        sandbox_id = new_sandbox_id()
        if credential:
            self.credentials.by_sandbox[sandbox_id] = [
                Credential(
                    name="gh", value=CANARY, hosts=["api.test"], method="bearer", placeholder=PLACEHOLDER
                )
            ]
        if policy is not None:
            self.wiring.remember(sandbox_id, policy)
        handle = await self.agent.create("python", env=env, sandbox_id=sandbox_id)
        # The test upstreams' CA stands for the public roots a real trust store holds (for spliced TLS).
        await handle.session.write_file(CA_BUNDLE_PATH, self.upstream_ca.read_bytes(), append=True)
        return handle


@pytest.fixture(scope="module")
def egress_node(loop: BackgroundLoop) -> Iterator[EgressNode]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (runsc, netns, nftables)")
    tag = f"spw{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-egress-e2e-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-egress-", dir="/var/tmp")).resolve()
    store_url = (workdir / "objects").as_uri()
    local = LocalNode(data_dir, network="sandbox", store_url=store_url, cgroup_parent="space-ega")
    agent: NodeAgent | None = None
    try:
        with api_and_evil(tag, workdir, 41, "open.test") as up:
            agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
            credentials = StaticCredentials()

            def settings(node_dir: pathlib.Path) -> EgressSettings:
                return EgressSettings(
                    state_dir=node_dir / "egress",
                    resolver=StaticResolver(up.names("open.test")),
                    trust_store=up.test_ca.ca_file,
                    operator_allowed_networks=[ipaddress.ip_network("10.98.0.0/16")],
                    credentials=credentials,
                )

            wiring = loop.run(install(agent, settings(data_dir)))
            assert wiring is not None and isinstance(agent.driver, EgressDriver)
            try:
                yield EgressNode(
                    local, agent, wiring, loop, up.api, up.evil, up.test_ca.ca_file, credentials, store_url,
                    settings,
                )  # fmt: skip
            finally:
                loop.run(agent.delete_all(), timeout=300)
                loop.run(local.stop(purge=True), timeout=300)
    finally:
        if agent is None:  # a failed start: clean up what there is, the start's own error is the one to see
            with contextlib.suppress(Exception):
                loop.run(local.stop(purge=True), timeout=300)
        remove_cgroup_parent("space-ega")
        shutil.rmtree(workdir, ignore_errors=True)
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"
    assert leftovers(tag) == [], "upstream namespaces left behind"


def header(entry: dict[str, Any], name: str) -> str | None:
    for key, value in entry["headers"]:
        if key.lower() == name.lower():
            return str(value)
    return None


def test_sandbox_environment_points_at_the_gateway(egress_node: EgressNode) -> None:
    node = egress_node

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["api.test"])) as sb:
            r = await sb.session.exec(["sh", "-c", "env; echo ---; cat /etc/resolv.conf"])
            text = r.stdout.decode()
            env = dict(line.split("=", 1) for line in text.split("---")[0].splitlines() if "=" in line)
            assert env["HTTPS_PROXY"] == env["http_proxy"] == node.wiring.proxy_url
            assert node.wiring.proxy_url.startswith("http://10.99.0.1:")
            assert env["NO_PROXY"] == ""
            assert (
                env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == env["CURL_CA_BUNDLE"] == CA_BUNDLE_PATH
            )
            assert "nameserver 10.99.0.1" in text.split("---")[1]
            bundle = await sb.session.read_file(CA_BUNDLE_PATH)
            assert node.wiring.gateway.ca_certificate_pem.strip() in bundle
            assert bundle.count(CA_BEGIN) == 1

    node.run(scenario())


def test_allowed_name_through_proxy_and_transparently(egress_node: EgressNode) -> None:
    node = egress_node

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["api.test"])) as sb:
            results = await fetch(sb, [
                {"url": "https://api.test/echo"},                    # HTTPS CONNECT through the proxy
                {"url": "http://api.test/echo"},                     # plain HTTP through the proxy
                {"url": "https://api.test/echo", "direct": True},    # DNS + TLS redirected, by SNI
                {"url": "http://api.test/echo", "direct": True},     # DNS + HTTP redirected, by Host
            ])  # fmt: skip
            for i, result in enumerate(results):
                body = echo(result)
                assert body["server"] == "api", (i, body)
                assert header(body, "host") == "api.test"
            assert [echo(r)["tls"] for r in results] == [True, False, True, False]
            names = await resolve(sb, ["api.test", "evil.test", "meta.test"])
            assert names["api.test"] == [node.api.addr]
            assert isinstance(names["evil.test"], str) and names["evil.test"].startswith("error")
            assert isinstance(names["meta.test"], str) and names["meta.test"].startswith("error")

    node.run(scenario())


def test_denied_names_literals_and_metadata_are_refused(egress_node: EgressNode) -> None:
    node = egress_node

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["api.test", "*.test"], deny=["evil.test"])) as sb:
            before = len(node.evil.requests())
            results = await fetch(sb, [
                {"url": "https://evil.test/echo"},                              # 0 denied name (proxy)
                {"url": "http://evil.test/echo"},                               # 1
                {"url": "https://EVIL.test./echo"},                             # 2 case + trailing dot
                {"url": f"https://{node.evil.addr}/echo"},                      # 3 IP literal (proxy)
                {"url": f"http://{node.evil.addr}/echo", "direct": True},       # 4 IP literal (transparent)
                {"url": f"https://{node.evil.addr}/echo", "direct": True},      # 5
                {"url": "http://0x0a622a02/echo", "direct": True},              # 6 hex literal
                {"url": f"http://{METADATA}/latest/meta-data/"},                # 7 metadata (proxy)
                {"url": f"http://{METADATA}/latest/meta-data/", "direct": True},  # 8 metadata (transparent)
                {"url": "http://meta.test/"},                                   # 9 name -> metadata address
                {"url": "https://api.test/echo"},                               # 10 still allowed
            ])  # fmt: skip
            for i, result in enumerate(results[:-1]):
                assert refused(result), (i, result)
            assert echo(results[-1])["server"] == "api"
            assert len(node.evil.requests()) == before, "a refused request reached the denied upstream"
            raw = await sb.session.exec(["python3", "-c", (
                "import socket\n"
                "for addr in [('10.98.42.2', 8443), ('10.98.42.2', 22), ('169.254.169.254', 8775)]:\n"
                "    s = socket.socket(); s.settimeout(2)\n"
                "    try: s.connect(addr); print('connected', addr)\n"
                "    except OSError as e: print('refused', addr, e)\n"
            )])  # fmt: skip
            assert b"connected" not in raw.stdout, raw.stdout

    node.run(scenario())


def test_no_policy_means_no_egress_and_changes_apply_at_once(egress_node: EgressNode) -> None:
    node = egress_node

    async def scenario() -> None:
        async with node.running(None) as sb:
            results = await fetch(sb, [
                {"url": "https://api.test/echo"}, {"url": "http://api.test/echo", "direct": True},
                {"url": f"http://{node.api.addr}/echo", "direct": True},
            ])  # fmt: skip
            assert all(refused(r) for r in results), results
            answer = await node.wiring.apply(sb.sandbox_id, EgressRequest(allow=["api.test"], version=1))
            assert answer["applied"] and answer["live"]
            [ok] = await fetch(sb, [{"url": "https://api.test/echo"}])
            assert echo(ok)["server"] == "api"
            # an older version is ignored; a newer one takes the name away again
            stale = await node.wiring.apply(sb.sandbox_id, EgressRequest(allow=[], version=0))
            assert stale["applied"]  # version 0 = unversioned (node-only callers): applied
            [gone] = await fetch(sb, [{"url": "https://api.test/echo"}])
            assert refused(gone), gone
            await node.wiring.apply(sb.sandbox_id, EgressRequest(allow=["evil.test"], version=3))
            older = await node.wiring.apply(sb.sandbox_id, EgressRequest(allow=["api.test"], version=2))
            assert older == {"applied": False, "reason": "stale", "version": 3}
            evil, api = await fetch(sb, [{"url": "https://evil.test/echo"}, {"url": "https://api.test/echo"}])
            assert echo(evil)["server"] == "evil"
            assert refused(api), api

    node.run(scenario())


def stop_other_node(node: EgressNode, other: LocalNode, cgroup_parent: str) -> None:
    """Stop a test's second node (sandboxes deleted, data purged) and remove its cgroup parent."""
    if other.agent is not None:
        node.run(other.agent.delete_all(), timeout=300)
    node.run(other.stop(purge=True), timeout=300)
    remove_cgroup_parent(cgroup_parent)


def _host_grep(needle: str, *paths: pathlib.Path) -> list[str]:
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return []
    found = subprocess.run(
        ["grep", "-rlaF", "--no-messages", needle, *existing], capture_output=True, text=True, check=False
    )
    return found.stdout.splitlines()


def test_canary_credential_reaches_only_the_bound_upstream(egress_node: EgressNode) -> None:
    node = egress_node
    layout = node.local.layout

    async def scenario() -> None:
        async with node.running(
            EgressRequest(allow=["api.test", "evil.test"]), env={"GH_TOKEN": PLACEHOLDER}, credential=True
        ) as sb:
            seen: list[str] = []
            auth = {"Authorization": "Bearer {GH_TOKEN}"}
            results = await fetch(sb, [
                {"url": "https://api.test/echo", "headers": auth},                       # 0 injected
                {"url": "https://api.test/echo", "headers": auth, "direct": True},       # 1 transparent
                {"url": "https://evil.test/echo", "headers": auth},                      # 2 unbound host
                {"url": "https://api.test/redirect?to=https://evil.test/echo", "headers": auth},  # 3 redirect
                {"url": "http://api.test/echo", "headers": auth},                        # 4 plain HTTP
            ])  # fmt: skip
            seen.append(json.dumps(results))
            assert echo(results[0])["server"] == "api" and echo(results[1])["server"] == "api"
            got = [header(e, "authorization") for e in node.api.requests() if e["path"] == "/echo"]
            assert f"Bearer {CANARY}" in got, got
            # the echo of the real value came back masked: the sandbox saw neither value nor a fragment of it
            assert CANARY not in json.dumps(results)
            evil_auth = [header(e, "authorization") for e in node.evil.requests()]
            assert f"Bearer {PLACEHOLDER}" in evil_auth, evil_auth
            assert all(CANARY not in (a or "") for a in evil_auth)
            assert echo(results[3])["server"] == "evil"
            # inside the sandbox: environment, every process's environ and cmdline, files
            # (the canary itself is never sent into the sandbox, not even as a search term: files are
            # searched from the host below)
            probe = await sb.session.exec(["sh", "-c", (
                "env; for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null; echo; done"
            )], timeout=300)  # fmt: skip
            seen.append((probe.stdout + probe.stderr).decode(errors="replace"))
            assert (
                PLACEHOLDER.encode() in probe.stdout
            )  # positive control: the placeholder is where it was put
            # on the host: the sandbox's whole root filesystem, then a full checkpoint image
            await sb.session.write_file("/work/token-copy", PLACEHOLDER.encode())
            await sb.session.sync()
            assert _host_grep(PLACEHOLDER, layout.rootfs(sb.sandbox_id)), (
                "control: placeholder file not found"
            )
            assert _host_grep(CANARY, layout.rootfs(sb.sandbox_id)) == []
            record = await node.agent.checkpoint(sb.sandbox_id)
            image = layout.checkpoint_image(sb.sandbox_id, record.snapshot_id)
            snapshot = layout.snapshot(sb.sandbox_id, record.snapshot_id)
            assert _host_grep(PLACEHOLDER, image), "control: the checkpoint image does not hold the env"
            assert _host_grep(CANARY, image, snapshot) == []
            # still working after the checkpoint (the runtime was replaced): the policy followed it
            [again] = await fetch(sb, [{"url": "https://api.test/echo", "headers": auth}])
            seen.append(json.dumps(again))
            assert echo(again)["server"] == "api"
            node.credentials.by_sandbox.pop(sb.sandbox_id, None)
        assert all(CANARY not in text for text in seen)
        audit = [a for a in node.wiring.recent_audit if a.get("sandbox_id") == sb.sandbox_id]
        decisions = {(a["event"], a["decision"]) for a in audit}
        assert ("credential", "injected") in decisions, decisions
        assert any(e == "credential" and d.startswith("not_replaced") for e, d in decisions), decisions

    node.run(scenario(), timeout=600)


def test_restore_rewrites_the_ca_and_fork_children_inherit_the_policy(egress_node: EgressNode) -> None:
    node = egress_node
    ca = node.wiring.gateway.ca_certificate_pem.strip()

    async def foreign_ca(sb: SandboxHandle) -> None:
        """As if the sandbox's files came from another node: a different CA in its SPACE block."""
        bundle = await sb.session.read_file(CA_BUNDLE_PATH)
        assert ca in bundle
        await sb.session.write_file(CA_BUNDLE_PATH, bundle.replace(ca, b"-----FOREIGN NODE CA-----"))
        await sb.session.write_file(CA_FILE_PATH, b"-----FOREIGN NODE CA-----\n")
        [broken] = await fetch(sb, [{"url": "https://api.test/echo"}])
        assert "error" in broken and "CERTIFICATE_VERIFY_FAILED" in broken["error"], broken

    async def works(sb: SandboxHandle) -> None:
        ok, denied = await fetch(sb, [{"url": "https://api.test/echo"}, {"url": "https://evil.test/echo"}])
        assert echo(ok)["server"] == "api"
        assert refused(denied), denied
        assert (await sb.session.read_file(CA_BUNDLE_PATH)).count(CA_BEGIN) == 1

    async def scenario() -> None:
        # a credential bound to api.test makes the gateway intercept (its leaf certificates are signed by
        # the node's CA); without one, TLS would be spliced and verified against the upstream's own CA
        sb = await node.sandbox(EgressRequest(allow=["api.test"]), credential=True)
        children: list[SandboxHandle] = []
        try:
            await foreign_ca(sb)
            await sb.session.sync()
            record = await node.agent.checkpoint(sb.sandbox_id)  # files and memory with the foreign CA
            await node.agent.rollback(sb.sandbox_id, record.snapshot_id)  # a restore: the CA is rewritten
            await works(sb)
            await foreign_ca(sb)
            await node.agent.stop(sb.sandbox_id)
            await node.agent.start(sb.sandbox_id)  # a boot: rewritten as well
            await works(sb)
            children = await node.agent.fork(sb.sandbox_id, snapshot_id=record.snapshot_id, count=2)
            for child in children:
                assert node.wiring.recorded(child.sandbox_id) == node.wiring.recorded(sb.sandbox_id)
                node.credentials.by_sandbox[child.sandbox_id] = node.credentials.by_sandbox[sb.sandbox_id]
                await works(child)
        finally:
            await delete_quietly(node.agent, *(c.sandbox_id for c in children), sb.sandbox_id)
            for gone in [sb, *children]:
                node.credentials.by_sandbox.pop(gone.sandbox_id, None)
        assert not any(node.wiring.recorded(c.sandbox_id) for c in children)

    node.run(scenario(), timeout=600)


def test_agent_restart_keeps_node_only_policies(egress_node: EgressNode) -> None:
    """A new wiring over the same state directory (an agent restart) knows the recorded policies again."""
    node = egress_node

    async def scenario() -> None:
        async with node.running(EgressRequest(allow=["open.test"], deny=["evil.test"], version=4)) as sb:
            again = EgressWiring(node.wiring.helper, node.wiring.gateway, node.wiring.network_info,
                                 node.wiring.state_dir)  # fmt: skip
            assert again.recorded(sb.sandbox_id) == EgressRequest(allow=["open.test"], deny=["evil.test"],
                                                                  version=4)  # fmt: skip
        again = EgressWiring(node.wiring.helper, node.wiring.gateway, node.wiring.network_info,
                             node.wiring.state_dir)  # fmt: skip
        assert again.recorded(sb.sandbox_id) is None

    node.run(scenario())


# -- through the control plane: credential store, node-facing credential route, policy push, audit ----------
@dataclass
class EgressCluster:
    local: Any  # space.controlplane.local.LocalCluster
    key: str  # a member key of a fresh project
    api: Upstream
    evil: Upstream
    upstream_ca: bytes

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.local.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120
        )


@pytest.fixture(scope="module")
def egress_cluster() -> Iterator[EgressCluster]:
    from space.controlplane.local import LocalCluster, free_port

    if os.geteuid() != 0:
        pytest.fail("this test needs root (runsc, netns, nftables)")
    tag = f"spc{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-egress-cp-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-egress-cp-", dir="/var/tmp")).resolve()
    # With a warm pool (ADR 0047): the sandbox of the test below is a pooled one, bound to its user.
    local = LocalCluster(
        data_dir=data_dir, port=free_port(), network="sandbox", cgroup_parent="space-egc", pools="python=1"
    )
    started = False
    try:
        with api_and_evil(tag, workdir, 43) as up:
            hosts = {"api.test": [up.api.addr], "evil.test": [up.evil.addr]}
            local.egress_config = cluster_egress_config(data_dir, hosts, up.test_ca.ca_file)
            local.start()
            started = True
            _wait_for_pool(local)
            admin = httpx.Client(
                base_url=local.url, headers={"Authorization": f"Bearer {local.api_key}"}, timeout=60
            )
            with admin:
                assert admin.post("/v1/projects", json={"name": "egress"}).status_code == 201
                made = admin.post("/v1/keys", json={"project": "egress", "role": "member"})
                assert made.status_code == 201, made.text
            try:
                yield EgressCluster(
                    local, made.json()["key"], up.api, up.evil, up.test_ca.ca_file.read_bytes()
                )
            finally:
                local.stop(purge=True)
    finally:
        if not started:
            with contextlib.suppress(Exception):
                local.stop(purge=True)
            shutil.rmtree(data_dir, ignore_errors=True)
        remove_cgroup_parent("space-egc")
        shutil.rmtree(workdir, ignore_errors=True)
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"
    assert leftovers(tag) == [], "upstream namespaces left behind"


def _wait_for_pool(local: Any) -> None:
    from space.node.agent.identity import default_rpc_token_file
    from space.node.rpc_client import NodeClient

    token = default_rpc_token_file(local.data_dir).read_text().strip()

    async def ready() -> bool:
        async with NodeClient(f"http://127.0.0.1:{local.node_port}", token) as node:
            return (await node.info()).pools.get("python", 0) >= 1

    _wait(lambda: asyncio.run(ready()), "a pooled python sandbox on the node", timeout=120)


def _wait(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s: {what} (last value {value!r})")
        time.sleep(0.2)


def test_control_plane_credential_policy_push_and_audit(egress_cluster: EgressCluster) -> None:
    from space.sdk import Space

    cl = egress_cluster
    client = cl.http()
    sp = Space(url=cl.local.url, api_key=cl.key, transport=httpx.HTTPTransport(verify=False))
    # Credentials are made by admin keys (ADR 0026); the member key only binds them (below).
    manager = httpx.Client(
        base_url=cl.local.url, timeout=120,
        headers={"Authorization": f"Bearer {cl.local.api_key}", "X-Space-Project": "egress"},
    )  # fmt: skip
    put = manager.put(
        "/v1/credentials/gh",
        json={"value": CANARY, "hosts": ["api.test"], "method": "bearer", "env_var": "GH_TOKEN"},
    )
    assert put.status_code in (200, 201), put.text
    sb = sp.sandboxes.create(allow=["api.test"], credentials=["gh"])
    seen: list[str] = []
    try:
        # A pooled sandbox (ADR 0047): everything below holds for one bound to its user at create.
        assert client.get(f"/v1/sandboxes/{sb.id}").json()["created_from"] == "pool"

        def run(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return _fetch_sdk(sb, requests, seen)

        # the test upstreams' CA stands for the public roots of a real trust store (spliced TLS)
        sb.files.write(CA_BUNDLE_PATH, sb.files.read(CA_BUNDLE_PATH) + cl.upstream_ca)
        env = sb.exec("env").stdout_bytes.decode()
        seen.append(env)
        placeholder = next(line.split("=", 1)[1] for line in env.splitlines() if line.startswith("GH_TOKEN="))
        assert placeholder and CANARY not in env
        auth = {"Authorization": "Bearer {GH_TOKEN}"}
        ok, unbound, denied = run([
            {"url": "https://api.test/echo", "headers": auth},
            {"url": "https://evil.test/echo", "headers": auth},
            {"url": f"https://{cl.api.addr}/echo", "headers": auth},
        ])  # fmt: skip
        assert echo(ok)["server"] == "api"
        assert refused(unbound) and refused(denied), (unbound, denied)
        got = [header(e, "authorization") for e in cl.api.requests() if e["path"] == "/echo"]
        assert got == [f"Bearer {CANARY}"], got
        # the control plane and the node agent are not reachable from inside, by proxy or directly
        cp_port, node_port = cl.local.port, cl.local.node_port
        inside = run([
            {"url": f"http://127.0.0.1:{cp_port}/healthz"}, {"url": f"http://localhost:{cp_port}/healthz"},
            {"url": f"http://127.0.0.1:{node_port}/node/v1/info"},
            {"url": f"http://[::1]:{cp_port}/healthz"}, {"url": f"http://2130706433:{cp_port}/healthz"},
        ])  # fmt: skip
        assert all(refused(r) for r in inside), inside
        # a policy change through the API reaches the node at once
        changed = client.put(f"/v1/sandboxes/{sb.id}/egress", json={"allow": ["api.test", "evil.test"]})
        assert changed.status_code == 200 and changed.json()["applied"] is True, changed.text
        [now_ok] = run([{"url": "https://evil.test/echo", "headers": auth}])
        assert echo(now_ok)["server"] == "evil"
        assert header(echo(now_ok), "authorization") == f"Bearer {placeholder}"  # unbound: not replaced

        # the gateway's uses reach the control plane's audit log
        def injected() -> list[dict[str, Any]]:
            entries = client.get("/v1/credentials/gh/audit").json().get("entries", [])
            return [e for e in entries if e.get("action") == "injected" and e.get("sandbox_id") == sb.id]

        _wait(injected, "an 'injected' audit entry from the node")
        # a full checkpoint image on disk never holds the value (it does hold the placeholder)
        snap = sb.snapshots.create(full=True)
        runtime = runtime_id(cl.local.data_dir, sb.id)  # a pooled sandbox's files are its runtime's
        assert runtime != sb.id
        image = cl.local.data_dir / "fs" / "checkpoints" / runtime / snap.id
        assert _host_grep(placeholder, image), "control: the placeholder is not in the checkpoint image"
        assert _host_grep(CANARY, image, cl.local.data_dir / "fs" / "sandboxes" / runtime) == []
        # a fork child has its parent's policy and bindings (the control plane's record), and its own
        # trust store written on restore
        child = sb.fork()
        try:
            ok_child, literal = _fetch_sdk(child, [
                {"url": "https://api.test/echo", "headers": auth}, {"url": f"https://{cl.api.addr}/echo"}
            ], seen)  # fmt: skip
            assert echo(ok_child)["server"] == "api" and refused(literal), (ok_child, literal)
        finally:
            child.delete()
        # suspend (the node lets go of it) and restore: the policy comes back from the control plane, the
        # node's CA is written again, the credential is injected again; nothing in the object store has it
        sb.suspend()
        sb.restore()
        ok_again, unbound_again = run([
            {"url": "https://api.test/echo", "headers": auth},
            {"url": "https://evil.test/echo", "headers": auth},
        ])  # fmt: skip
        assert echo(ok_again)["server"] == "api" and echo(unbound_again)["server"] == "evil"
        got = [header(e, "authorization") for e in cl.api.requests() if e["path"] == "/echo"]
        assert got[-1] == f"Bearer {CANARY}", got
        assert _host_grep(CANARY, cl.local.data_dir / "objects") == []
    finally:
        sb.delete()
        client.close()
    assert all(CANARY not in text for text in seen)


def _fetch_sdk(sb: Any, requests: list[dict[str, Any]], seen: list[str]) -> list[dict[str, Any]]:
    r = sb.exec(["python3", "-c", FETCH, json.dumps(requests)])
    assert r.exit_code == 0, r.stderr_bytes
    seen.append(r.stdout_bytes.decode(errors="replace"))
    results: list[dict[str, Any]] = json.loads(r.stdout_bytes)
    return results


def test_restored_on_another_node_the_sandbox_trusts_that_nodes_ca(egress_node: EgressNode) -> None:
    """Suspend on node A, restore from the object store on node B: B's CA replaces A's in the sandbox's
    trust store, B's gateway applies the policy and injects the credential."""
    node = egress_node
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-egress-b-", dir="/var/tmp")).resolve()
    other = LocalNode(data_dir, network="sandbox", store_url=node.store_url, cgroup_parent="space-egb")
    policy = EgressRequest(allow=["api.test"])
    store = open_store(node.store_url)

    async def scenario() -> None:
        agent_b = await other.start(progress=lambda line: None)
        wiring_b = await install(agent_b, node.settings(data_dir))
        assert wiring_b is not None
        ca_a, ca_b = (
            node.wiring.gateway.ca_certificate_pem.strip(),
            wiring_b.gateway.ca_certificate_pem.strip(),
        )
        assert ca_a != ca_b
        sb = await node.sandbox(policy, env={"GH_TOKEN": PLACEHOLDER}, credential=True)
        auth = {"Authorization": "Bearer {GH_TOKEN}"}
        try:
            [before] = await fetch(sb, [{"url": "https://api.test/echo", "headers": auth}])
            assert echo(before)["server"] == "api"
            prefix = f"suspended/{sb.sandbox_id}/1"
            await node.agent.suspend(
                sb.sandbox_id, store=store, prefix=prefix, snapshot_id=new_snapshot_id(), data_key=None
            )
            spec = SandboxSpec(sb.sandbox_id, sb.spec.template, sb.spec.limits, dict(sb.spec.env))
            await node.agent.delete(sb.sandbox_id)
            # through node B's RPC, with the policy in the request (what a control plane would answer B)
            app = create_app(agent_b, "rpc-token")
            app.state.service.egress = wiring_b
            client = NodeClient("http://node-b", "rpc-token", transport=httpx.ASGITransport(app=app))
            try:
                await client.restore(
                    sb.sandbox_id, store_url=node.store_url, prefix=prefix, template=spec.template,
                    limits=spec.limits, env=spec.env, egress={"allow": policy.allow},
                )  # fmt: skip
            finally:
                await client.aclose()
            restored = agent_b.get(sb.sandbox_id)
            assert wiring_b.recorded(sb.sandbox_id) == policy
            bundle = await restored.session.read_file(CA_BUNDLE_PATH)
            assert ca_b in bundle and ca_a not in bundle and bundle.count(CA_BEGIN) == 1
            ok, denied = await fetch(restored, [
                {"url": "https://api.test/echo", "headers": auth}, {"url": "https://evil.test/echo"}
            ])  # fmt: skip
            assert echo(ok)["server"] == "api" and refused(denied), (ok, denied)
            got = [header(e, "authorization") for e in node.api.requests() if e["path"] == "/echo"]
            assert got[-1] == f"Bearer {CANARY}", got
            assert any(a.get("sandbox_id") == sb.sandbox_id for a in wiring_b.recent_audit)
        finally:
            await delete_quietly(node.agent, sb.sandbox_id)
            await delete_quietly(agent_b, sb.sandbox_id)
            node.credentials.by_sandbox.pop(sb.sandbox_id, None)

    try:
        node.run(scenario(), timeout=1200)
    finally:
        stop_other_node(node, other, "space-egb")
    assert network_traces(node_tag(data_dir)) == [], "node B left network traces"


def test_node_rpc_create_with_egress_and_policy_push(egress_node: EgressNode) -> None:
    """The node's RPC (what the control plane calls): PUT /sandboxes/{id} with an egress policy, then
    PUT /sandboxes/{id}/egress changes it at run time; a malformed policy is a 400 before anything runs."""
    node = egress_node
    app = create_app(node.agent, "rpc-token")
    app.state.service.egress = node.wiring
    client = NodeClient("http://node", "rpc-token", transport=httpx.ASGITransport(app=app))
    sandbox_id = new_sandbox_id()

    async def scenario() -> None:
        try:
            with pytest.raises(errors.InvalidArgument):
                await client.create_sandbox(new_sandbox_id(), egress={"allow": ["bad name"]})
            await client.create_sandbox(sandbox_id, egress={"allow": ["api.test"], "version": 1})
            handle = node.agent.get(sandbox_id)
            await handle.session.write_file(CA_BUNDLE_PATH, node.upstream_ca.read_bytes(), append=True)
            answer = await client.exec(sandbox_id, ["python3", "-c", FETCH, json.dumps([
                {"url": "https://api.test/echo"}, {"url": "https://evil.test/echo"}
            ])])  # fmt: skip
            ok, denied = json.loads(base64.b64decode(answer.stdout_b64))
            assert echo(ok)["server"] == "api" and refused(denied), (ok, denied)
            pushed = await client.set_egress(sandbox_id, {"allow": ["evil.test"], "deny": [], "version": 2})
            assert pushed["applied"] is True, pushed
            stale = await client.set_egress(sandbox_id, {"allow": ["api.test"], "deny": [], "version": 1})
            assert stale["applied"] is False and stale["reason"] == "stale", stale
            [now_ok] = await fetch(handle, [{"url": "https://evil.test/echo"}])
            assert echo(now_ok)["server"] == "evil"
        finally:
            await delete_quietly(node.agent, sandbox_id)
            await client.aclose()

    node.run(scenario())


def test_agent_restart_adopts_running_sandboxes_with_their_policies(egress_node: EgressNode) -> None:
    """The agent goes away (sandboxes keep running) and a new one starts on the same node: its gateway
    knows the adopted sandboxes' policies again before they are handed out (install before recover)."""
    node = egress_node
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-egress-r-", dir="/var/tmp")).resolve()
    other = LocalNode(data_dir, network="sandbox", store_url=node.store_url, cgroup_parent="space-egr")

    async def scenario() -> None:
        first = await other.start(progress=lambda line: None)
        wiring = await install(first, node.settings(data_dir))
        assert wiring is not None
        sandbox_id = new_sandbox_id()
        wiring.remember(sandbox_id, EgressRequest(allow=["evil.test"]))
        handle = await first.create("python", sandbox_id=sandbox_id)
        await handle.session.write_file(CA_BUNDLE_PATH, node.upstream_ca.read_bytes(), append=True)
        [before] = await fetch(handle, [{"url": "https://evil.test/echo"}])
        assert echo(before)["server"] == "evil"
        await first.close()  # the agent process ends; its gateway with it
        second = connect_agent(data_dir, store_url=node.store_url)
        other.agent = second
        again = await install(second, node.settings(data_dir))
        assert again is not None and again is not wiring
        assert sandbox_id in await second.recover()
        adopted = second.get(sandbox_id)
        ok, denied = await fetch(
            adopted, [{"url": "https://evil.test/echo"}, {"url": "https://api.test/echo"}]
        )
        assert echo(ok)["server"] == "evil" and refused(denied), (ok, denied)

    try:
        node.run(scenario(), timeout=1200)
    finally:
        stop_other_node(node, other, "space-egr")
    assert network_traces(node_tag(data_dir)) == [], "the node left network traces"
