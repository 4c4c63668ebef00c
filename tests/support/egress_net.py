"""Upstream test servers for the egress gateway, each in its own network namespace joined to the host by a
veth pair (host side X.1, namespace side X.2 of a /24), plus a test CA that signs their certificates.

Everything created here is removed by `close()` (the namespace's deletion removes its veth pair);
`leftovers(tag)` lists what a run left behind, for the leak check.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass
class UpstreamCA:
    directory: pathlib.Path
    ca_file: pathlib.Path = field(init=False)
    _key: ec.EllipticCurvePrivateKey = field(init=False)
    _cert: x509.Certificate = field(init=False)

    def __post_init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test upstream CA")])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = self.directory / "upstream-ca.pem"
        self.ca_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, filename: str, names: list[str], addresses: list[str]) -> pathlib.Path:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        path = self.directory / filename
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            + cert.public_bytes(serialization.Encoding.PEM)
            + self._cert.public_bytes(serialization.Encoding.PEM)
        )
        return path


def veth_namespace(
    namespace: str, host_if: str, peer_if: str, host_addr: str, addr: str, *, default_route: bool = False
) -> None:
    """Namespace `namespace` joined to the host by a veth pair: `host_if` = host_addr/24 on the host,
    `peer_if` = addr/24 inside (lo up too); with `default_route`, the namespace routes everything via the
    host side. The caller deletes the namespace and `host_if`, also when this fails half-way."""
    _run("ip", "netns", "add", namespace)
    _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
    _run("ip", "link", "set", peer_if, "netns", namespace)
    _run("ip", "addr", "add", f"{host_addr}/24", "dev", host_if)
    _run("ip", "link", "set", host_if, "up")
    _run("ip", "-n", namespace, "addr", "add", f"{addr}/24", "dev", peer_if)
    _run("ip", "-n", namespace, "link", "set", peer_if, "up")
    _run("ip", "-n", namespace, "link", "set", "lo", "up")
    if default_route:
        _run("ip", "-n", namespace, "route", "add", "default", "via", host_addr)


def wait_port(host: str, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Upstream:
    name: str
    namespace: str
    host_addr: str
    addr: str
    log: pathlib.Path
    host_if: str = ""
    process: subprocess.Popen[bytes] | None = None

    def requests(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.host_if:
            # deleting the namespace would destroy the pair too, but asynchronously: delete it here
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)


def start_upstream(
    tag: str,
    name: str,
    subnet: int,
    cert: pathlib.Path,
    workdir: pathlib.Path,
    *,
    accounts: pathlib.Path | None = None,
) -> Upstream:
    """An upstream at 10.98.<subnet>.2 (ports 80 and 443) in namespace `<tag>-<name>`; `accounts` (a JSON
    list of [username, password]) is what its /session accepts."""
    namespace = f"{tag}-{name}"
    host_if = f"{tag[-8:]}{name[:2]}h"[-15:]
    peer_if = f"{tag[-8:]}{name[:2]}n"[-15:]
    host_addr, addr = f"10.98.{subnet}.1", f"10.98.{subnet}.2"
    upstream = Upstream(name, namespace, host_addr, addr, workdir / f"upstream-{name}.jsonl", host_if)
    try:
        veth_namespace(namespace, host_if, peer_if, host_addr, addr)
        upstream.process = subprocess.Popen(
            [
                # nsenter, not `ip netns exec`: the latter makes a private mount namespace that keeps a
                # copy of every btrfs mount alive, so other nodes' loop devices could not detach.
                "nsenter",
                f"--net=/var/run/netns/{namespace}",
                sys.executable,
                "-m",
                "tests.support.egress_upstream",
                "--name",
                name,
                "--cert",
                str(cert),
                "--log",
                str(upstream.log),
                *(["--accounts", str(accounts)] if accounts is not None else []),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        wait_port(addr, 80)
        wait_port(addr, 443)
    except BaseException:
        upstream.close()
        raise
    return upstream


@dataclass
class ApiAndEvil:
    """The two upstreams of the egress end-to-end tests: `api` (an allowed host) and `evil` (a denied one)."""

    test_ca: UpstreamCA
    api: Upstream
    evil: Upstream

    def names(self, *api_aliases: str) -> dict[str, list[str]]:
        """What the gateway's resolver answers: api.test (and `api_aliases`), evil.test, and meta.test at
        the metadata address (which the gateway must refuse whatever resolves to it)."""
        from tests.support.egress_probe import METADATA

        api = [self.api.addr]
        return {"api.test": api, **{alias: api for alias in api_aliases}, "evil.test": [self.evil.addr],
                "meta.test": [METADATA]}  # fmt: skip


@contextlib.contextmanager
def api_and_evil(tag: str, workdir: pathlib.Path, subnet: int, *api_aliases: str) -> Iterator[ApiAndEvil]:
    """`api` at 10.98.<subnet>.2 (certificate for api.test and `api_aliases`) and `evil` at
    10.98.<subnet + 1>.2 (evil.test), signed by a test CA under `workdir`; both closed after."""
    test_ca = UpstreamCA(workdir)
    cert_api = test_ca.issue("api.pem", ["api.test", *api_aliases], [f"10.98.{subnet}.2"])
    cert_evil = test_ca.issue("evil.pem", ["evil.test"], [f"10.98.{subnet + 1}.2"])
    upstreams: list[Upstream] = []
    try:
        upstreams.append(start_upstream(tag, "api", subnet, cert_api, workdir))
        upstreams.append(start_upstream(tag, "evil", subnet + 1, cert_evil, workdir))
        yield ApiAndEvil(test_ca, *upstreams)
    finally:
        for upstream in upstreams:
            upstream.close()


def cluster_egress_config(
    data_dir: pathlib.Path, hosts: dict[str, list[str]], ca_file: pathlib.Path
) -> pathlib.Path:
    """The egress configuration file of an embedded cluster (LocalCluster.egress_config) whose gateway
    resolves `hosts` and trusts the test CA: written where its unprivileged node agent can read it."""
    os.chmod(data_dir, 0o755)  # LocalCluster does the same
    trust = data_dir / "upstream-ca.pem"
    trust.write_bytes(ca_file.read_bytes())
    config = data_dir / "egress-config.json"
    config.write_text(
        json.dumps({"hosts": hosts, "trust_store": str(trust), "allow_networks": ["10.98.0.0/16"]})
    )
    trust.chmod(0o644)
    config.chmod(0o644)
    return config


def leftovers(tag: str) -> list[str]:
    found = [
        line
        for line in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        if tag in line
    ]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    found += [line for line in links.splitlines() if tag[-8:] in line]
    return found


def client_hello(server_name: str) -> bytes:
    """The real first flight (ClientHello record) a stdlib TLS client sends for `server_name`."""
    import ssl

    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _extensions_offset(body: bytes) -> int:
    pos = 2 + 32
    pos += 1 + body[pos]
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")
    pos += 1 + body[pos]
    return pos


def with_extension(record: bytes, ext_type: int, data: bytes) -> bytes:
    """A ClientHello record with one more extension appended (lengths fixed up)."""
    assert record[0] == 22
    handshake = record[5:]
    body = bytearray(handshake[4:])
    offset = _extensions_offset(bytes(body))
    total = int.from_bytes(body[offset : offset + 2], "big")
    extra = ext_type.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
    body[offset : offset + 2] = (total + len(extra)).to_bytes(2, "big")
    body += extra
    new_handshake = bytes([1]) + len(body).to_bytes(3, "big") + bytes(body)
    return record[:3] + len(new_handshake).to_bytes(2, "big") + new_handshake


def split_records(record: bytes, at: int) -> bytes:
    """The same handshake message fragmented into two TLS records."""
    payload = record[5:]
    first, second = payload[:at], payload[at:]
    head = record[:3]
    return head + len(first).to_bytes(2, "big") + first + head + len(second).to_bytes(2, "big") + second


def remove_cgroup_parent(name: str) -> None:
    """A node's own (now empty) cgroup parent; the kernel may lag a moment after the last sandbox."""
    for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{name}"):
        for _attempt in range(50):
            try:
                parent.rmdir()
                break
            except OSError:
                time.sleep(0.1)
