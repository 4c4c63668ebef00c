"""TLS on the control plane -> node RPC (ADR 0079 "TLS to nodes"), real TLS end to end: a node agent
process (`python -m space.node.agent.server --driver fake --tls-cert --tls-key`) serving HTTPS with a
certificate of a test CA, called by the control plane's node pools. With the nodes' CA the pools create a
sandbox and exec in it (control and data pool); with another CA, or the system trust store, the node is
Unavailable (typed), and nothing is retried in plain HTTP; a certificate without its key, or a key others
can read, is refused before the agent or `space node join` starts anything. End to end: a control plane
with SPACE_NODES_CA_FILE and a TLS agent that registers its default (https) URL serve a tenant's sandbox
and exec through the API."""

from __future__ import annotations

import pathlib
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from space.controlplane.node_pools import PoolSettings, traffic_owner
from space.controlplane.nodes import NodePool
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.agent.identity import check_tls_files
from tests.support import cluster as c
from tests.support.egress_net import UpstreamCA
from tests.support.hop import CLUSTER_TOKEN, enrol
from tests.support.loop import BackgroundLoop

TOKEN = "tls-node-token-0123456789"


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    running = BackgroundLoop()
    yield running
    running.close()


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    url = sqlite_url(tmp_path)
    migrate(url)
    made = Store(url)
    yield made
    made.close()


def _agent_argv(data_dir: pathlib.Path, port: int, *tls: str) -> list[str]:
    token_file = data_dir / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return [sys.executable, "-m", "space.node.agent.server", "--driver", "fake", "--no-prepare",
            "--data-dir", str(data_dir), "--listen", f"127.0.0.1:{port}", "--rpc-token-file", str(token_file),
            "--log-level", "warning", *tls]  # fmt: skip


@pytest.fixture
def tls_node(tmp_path: pathlib.Path) -> Iterator[tuple[UpstreamCA, int]]:
    """A node agent serving its RPC over HTTPS only, its certificate (127.0.0.1, localhost) from a test CA."""
    ca = UpstreamCA(tmp_path)
    pem = ca.issue("node.pem", ["localhost"], ["127.0.0.1"])  # key + certificate chain in one file
    pem.chmod(0o600)
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    port = c.free_port()
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _agent_argv(data_dir, port, "--tls-cert", str(pem), "--tls-key", str(pem)), stdout=log, stderr=log
        )
    trusting = ssl.create_default_context(cafile=str(ca.ca_file))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                httpx.get(f"https://127.0.0.1:{port}/healthz", verify=trusting, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the node's HTTPS RPC did not come up"
                time.sleep(0.1)
        yield ca, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in log_path.read_text()


def _create_and_exec(loop: BackgroundLoop, pool: NodePool, node_id: str) -> int:
    sandbox_id = new_sandbox_id()

    async def call() -> int:
        client = pool.client(node_id)
        await client.create_sandbox(sandbox_id)  # control pool
        traffic_owner.set("key-tls")  # a tenant's data-plane call: the data pool
        try:
            return (await client.exec(sandbox_id, ["true"])).exit_code
        finally:
            traffic_owner.set(None)
            await client.delete_sandbox(sandbox_id)

    return loop.run(call(), timeout=60)


def _info(loop: BackgroundLoop, pool: NodePool, node_id: str) -> str:
    async def call() -> str:
        return (await pool.client(node_id).info()).driver

    return loop.run(call(), timeout=30)


def test_the_nodes_ca_verifies_a_tls_node_and_execs_through_it(
    tls_node: tuple[UpstreamCA, int], store: Store, loop: BackgroundLoop
) -> None:
    ca, port = tls_node
    node_id = enrol(store, f"https://127.0.0.1:{port}", TOKEN)
    settings = ControlPlaneSettings.from_env({"SPACE_NODES_CA_FILE": str(ca.ca_file)})
    pool = NodePool(store, CLUSTER_TOKEN, pools=PoolSettings.of(settings))
    try:
        assert pool.pools.ca_file == str(ca.ca_file)
        assert _create_and_exec(loop, pool, node_id) == 0
        assert _info(loop, pool, node_id) == "fake"
    finally:
        loop.run(pool.aclose())


@pytest.mark.parametrize("trust", ["another-ca", "system"])
def test_a_node_certificate_that_does_not_verify_is_unreachable_without_a_plain_http_fallback(
    tls_node: tuple[UpstreamCA, int], store: Store, loop: BackgroundLoop, tmp_path: pathlib.Path, trust: str
) -> None:
    _ca, port = tls_node
    (tmp_path / "other").mkdir()
    ca_file = str(UpstreamCA(tmp_path / "other").ca_file)
    node_id = enrol(store, f"https://127.0.0.1:{port}", TOKEN)
    pool = NodePool(
        store, CLUSTER_TOKEN, pools=PoolSettings(ca_file=ca_file if trust == "another-ca" else None)
    )
    try:
        with pytest.raises(errors.Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            _info(loop, pool, node_id)
        with pytest.raises(errors.Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            _create_and_exec(loop, pool, node_id)
    finally:
        loop.run(pool.aclose())


def test_an_http_url_of_a_tls_node_is_not_answered(
    tls_node: tuple[UpstreamCA, int], store: Store, loop: BackgroundLoop
) -> None:
    """The agent serves HTTPS only: a registered http URL of it gets no answer (nor a secret in clear)."""
    ca, port = tls_node
    node_id = enrol(store, f"http://127.0.0.1:{port}", TOKEN)
    pool = NodePool(store, CLUSTER_TOKEN, pools=PoolSettings(ca_file=str(ca.ca_file)))
    try:
        with pytest.raises(errors.Unavailable):
            _info(loop, pool, node_id)
    finally:
        loop.run(pool.aclose())


def test_a_certificate_without_its_key_or_a_key_others_read_is_refused(tmp_path: pathlib.Path) -> None:
    pem = UpstreamCA(tmp_path).issue("node.pem", ["localhost"], ["127.0.0.1"])
    pem.chmod(0o600)
    assert check_tls_files(None, None) is False
    assert check_tls_files(str(pem), str(pem)) is True
    with pytest.raises(errors.InvalidArgument, match="both a certificate and its key"):
        check_tls_files(str(pem), None)
    with pytest.raises(errors.InvalidArgument, match="does not exist"):
        check_tls_files(str(pem), str(tmp_path / "missing.key"))
    pem.chmod(0o644)
    with pytest.raises(errors.PermissionDenied, match="readable by others"):
        check_tls_files(str(pem), str(pem))
    # The agent: refused before it builds or serves anything.
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    port = c.free_port()
    refused = subprocess.run(
        _agent_argv(data_dir, port, "--tls-cert", str(pem)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "--tls-cert and --tls-key go together" in refused.stderr
    leaked = subprocess.run(
        _agent_argv(data_dir, port, "--tls-cert", str(pem), "--tls-key", str(pem)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert leaked.returncode != 0 and "readable by others" in leaked.stderr
    assert not (data_dir / "objects").exists()  # nothing was built
    # `space node join`: refused before it checks prerequisites or starts a helper.
    joined = subprocess.run(
        [sys.executable, "-m", "space.cli.main", "node", "join", "https://cp.example.com:8470",
         "--token", "t", "--data-dir", str(tmp_path / "joined"), "--tls-cert", str(pem)],
        capture_output=True, text=True, timeout=120, env=c._child_env(), cwd=c.REPO, check=False,
    )  # fmt: skip
    assert joined.returncode != 0
    assert "both a certificate and its key" in joined.stdout + joined.stderr
    assert not (tmp_path / "joined").exists()


def test_a_nodes_ca_file_that_cannot_be_loaded_stops_the_control_plane_before_it_starts(
    tmp_path: pathlib.Path,
) -> None:
    data_dir = tmp_path / "cp"
    done = subprocess.run(
        [sys.executable, "-m", "space.cli.main", "controlplane", "run", "--data-dir", str(data_dir),
         "--nodes-ca-file", str(tmp_path / "missing.pem")],
        capture_output=True, text=True, timeout=120, env=c._child_env(), cwd=c.REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "nodes CA file" in done.stderr + done.stdout
    assert not data_dir.exists()  # nothing was started
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    with pytest.raises(errors.Unavailable, match="cannot be loaded"):
        PoolSettings.of(ControlPlaneSettings.from_env({"SPACE_NODES_CA_FILE": str(garbage)}))


def test_a_control_plane_with_the_nodes_ca_serves_a_sandbox_on_a_tls_node(tmp_path: pathlib.Path) -> None:
    ca = UpstreamCA(tmp_path)
    pem = ca.issue("node.pem", ["localhost"], ["127.0.0.1"])
    pem.chmod(0o600)
    with c.start_fake_cluster(
        tmp_path / "cluster",
        node_args=("--tls-cert", str(pem), "--tls-key", str(pem)),
        control_plane_env={"SPACE_NODES_CA_FILE": str(ca.ca_file)},
    ) as cluster:
        record = cluster.node_record()
        assert record is not None and record.url.startswith("https://")  # the default advertised URL
        with cluster.sdk() as sp:
            sandbox = sp.sandboxes.create(limits=c.SMALL)
            try:
                assert sandbox.exec("echo over-tls").stdout.strip() == "over-tls"
            finally:
                sandbox.delete()
