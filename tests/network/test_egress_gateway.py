"""The egress gateway for real: upstream HTTP/HTTPS servers in their own network namespaces (veth to the
host), the gateway on the host, and clients acting as sandboxes (httpx with a proxy, raw sockets for the
transparent listeners and for malformed input). Needs root (netns, veth)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pathlib
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import dns.message
import dns.query
import dns.rcode
import httpx
import pytest

from space.core import errors
from space.node.egress import (
    Credential,
    EgressGateway,
    EgressPolicy,
    StaticCredentials,
    StaticResolver,
)
from tests.support.egress_net import (
    Upstream,
    UpstreamCA,
    client_hello,
    leftovers,
    start_upstream,
    veth_namespace,
    with_extension,
)
from tests.support.loop import BackgroundLoop

pytestmark = pytest.mark.root

SANDBOX = "sb-egress-1"
SOURCE = "127.0.0.1"
CANARY = "CANARY-bearer-" + os.urandom(8).hex()
CANARY_HEADER = "CANARY-header-" + os.urandom(8).hex()
CANARY_QUERY = "CANARY-query-" + os.urandom(8).hex()
CANARY_BASIC = "CANARY-basic-" + os.urandom(8).hex()
CANARY_LIMITED = "CANARY-limited-" + os.urandom(8).hex()
CANARY_EXPIRED = "CANARY-expired-" + os.urandom(8).hex()
ALL_CANARIES = [CANARY, CANARY_HEADER, CANARY_QUERY, CANARY_BASIC, CANARY_LIMITED, CANARY_EXPIRED]


def _credentials() -> list[Credential]:
    return [
        Credential(name="gh", value=CANARY, hosts=["api.test"], method="bearer"),
        Credential(
            name="hdr",
            value=CANARY_HEADER,
            hosts=["api.test"],
            method="header",
            header_name="X-Api-Key",
            header_template="{value}",
            allow_plaintext=True,
        ),
        Credential(name="q", value=CANARY_QUERY, hosts=["api.test"], method="query", query_param="key"),
        Credential(name="basic", value=CANARY_BASIC, hosts=["api.test"], method="basic"),
        Credential(name="limited", value=CANARY_LIMITED, hosts=["other.test"], rate_per_minute=3),
        Credential(
            name="old",
            value=CANARY_EXPIRED,
            hosts=["old.apps.test"],
            expires_at=datetime.now(UTC) - timedelta(minutes=1),
        ),
    ]


POLICY = EgressPolicy(
    allow=[
        "api.test",
        "other.test",
        "unbound.test",
        "*.apps.test",
        "rebind.test",
        "meta.test",
        "private.test",
        "10.98.11.0/24",
    ],
    deny=["blocked.apps.test", "10.98.11.99"],
)


@dataclass
class Env:
    loop: BackgroundLoop
    gateway: EgressGateway
    a: Upstream
    b: Upstream
    creds: dict[str, Credential]
    client_ca: pathlib.Path
    upstream_ca: pathlib.Path
    workdir: pathlib.Path
    audit: list[dict[str, Any]] = field(default_factory=list)
    seen_by_client: list[bytes] = field(default_factory=list)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.ports['proxy']}"

    def client(self, **kw: Any) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.client_ca))
        return httpx.Client(proxy=self.proxy_url, verify=context, timeout=10, **kw)

    def remember(self, response: httpx.Response) -> httpx.Response:
        self.seen_by_client.append(response.content)
        self.seen_by_client.append(repr(list(response.headers.raw)).encode())
        return response

    def audits(self, event: str, decision: str | None = None) -> list[dict[str, Any]]:
        return [
            a for a in self.audit if a["event"] == event and (decision is None or a["decision"] == decision)
        ]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (network namespaces); CI runs as root")
    tag = f"spe{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-egress-", dir="/var/tmp"))
    test_ca = UpstreamCA(workdir)
    cert_a = test_ca.issue(
        "a.pem",
        ["api.test", "other.test", "unbound.test", "*.apps.test", "rebind.test", "private.test"],
        ["10.98.11.2"],
    )
    cert_b = test_ca.issue("b.pem", ["evil.test"], ["10.98.12.2"])
    loop = BackgroundLoop()
    upstreams: list[Upstream] = []
    gateway: EgressGateway | None = None
    try:
        upstreams.append(start_upstream(tag, "a", 11, cert_a, workdir))
        upstreams.append(start_upstream(tag, "b", 12, cert_b, workdir))
        a, b = upstreams
        resolver = StaticResolver(
            {
                "api.test": [a.addr],
                "other.test": [a.addr],
                "unbound.test": [a.addr],
                "x.apps.test": [a.addr],
                "old.apps.test": [a.addr],
                "blocked.apps.test": [a.addr],
                "evil.test": [b.addr],
                "private.test": [b.addr],
                "rebind.test": ["127.0.0.1"],
                "meta.test": ["169.254.169.254"],
            }
        )
        creds = _credentials()
        audit: list[dict[str, Any]] = []
        gateway = EgressGateway(
            ca_dir=workdir / "ca",
            credentials=StaticCredentials({SANDBOX: creds}),
            audit=audit.append,
            resolver=resolver,
            listen_host="127.0.0.1",
            trust_store=test_ca.ca_file,
        )
        loop.run(gateway.start())
        gateway.set_policy(SANDBOX, SOURCE, POLICY)
        client_ca = workdir / "client-trust.pem"
        client_ca.write_bytes(gateway.ca_certificate_pem + test_ca.ca_file.read_bytes())
        environment = Env(
            loop, gateway, a, b, {c.name: c for c in creds}, client_ca, test_ca.ca_file, workdir
        )
        environment.audit = audit
        yield environment
        # nothing the sandbox saw ever contained a credential value
        blob = b"\n".join(environment.seen_by_client)
        for canary in ALL_CANARIES:
            assert canary.encode() not in blob
    finally:
        if gateway is not None:
            loop.run(gateway.close())
        loop.close()
        for upstream in upstreams:
            upstream.close()
        shutil.rmtree(workdir, ignore_errors=True)
        assert leftovers(tag) == [], "network namespaces or veth pairs left behind"


def _last(upstream: Upstream) -> dict[str, Any]:
    found = upstream.requests()
    assert found, "upstream received nothing"
    return found[-1]


def _header(entry: dict[str, Any], name: str) -> str | None:
    for key, value in entry["headers"]:
        if key.lower() == name.lower():
            return str(value)
    return None


def _raw(port: int, data: bytes, source: str = SOURCE) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b"connection: close" in b"".join(chunks).lower():
                pass
        return b"".join(chunks)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


# ---------------------------------------------------------------------------------------------------------
# credentials


def test_https_bearer_injected_for_bound_host_and_scrubbed_from_response(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    with env.client() as client:
        response = env.remember(
            client.get("https://api.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
        )
    assert response.status_code == 200
    received = _last(env.a)
    assert received["tls"] is True
    assert _header(received, "authorization") == f"Bearer {CANARY}"  # the upstream got the real value
    assert CANARY not in response.text  # ... but the echo the sandbox sees is scrubbed
    assert "*" * len(CANARY) in response.text
    assert placeholder not in json.dumps(received)
    assert env.audits("credential", "injected")[-1]["credential"] == "gh"
    # the certificate the sandbox saw was minted by the node CA for api.test
    assert response.extensions.get("http_version") in (b"HTTP/1.1", None)


def test_header_query_and_basic_methods(env: Env) -> None:
    c = env.creds
    with env.client() as client:
        response = env.remember(
            client.get(
                "https://api.test/echo",
                params={"key": c["q"].placeholder, "other": "1"},
                headers={"X-Api-Key": c["hdr"].placeholder},
                auth=("bob", c["basic"].placeholder),
            )
        )
    assert response.status_code == 200
    received = _last(env.a)
    assert received["tls"] is True
    assert _header(received, "x-api-key") == CANARY_HEADER
    assert f"key={CANARY_QUERY}" in received["path"] and "other=1" in received["path"]
    auth = _header(received, "authorization") or ""
    assert base64.b64decode(auth.split(" ", 1)[1]).decode() == f"bob:{CANARY_BASIC}"
    for canary in (CANARY_HEADER, CANARY_QUERY, CANARY_BASIC):
        assert canary not in response.text
    assert auth.split(" ", 1)[1] not in response.text  # the base64 form is scrubbed too


def test_placeholder_to_unbound_host_is_not_replaced_and_audited(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    with env.client() as client:
        plain = env.remember(
            client.get("http://unbound.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
        )
        assert plain.status_code == 200
        assert _header(_last(env.a), "authorization") == f"Bearer {placeholder}"
        assert env.audits("credential", "not_replaced_unbound_host")[-1]["host"] == "unbound.test"
        # HTTPS to an unbound host is not intercepted at all: the sandbox talks TLS with the upstream itself
        tls = env.remember(
            client.get("https://unbound.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
        )
    assert tls.status_code == 200
    received = _last(env.a)
    assert received["tls"] is True and _header(received, "authorization") == f"Bearer {placeholder}"
    spliced = [a for a in env.audits("egress", "allowed") if a["host"] == "unbound.test"]
    assert spliced[-1]["mode"] == "connect-splice"


def test_misplaced_placeholder_on_bound_host_is_not_replaced(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    with env.client() as client:
        response = env.remember(client.get("https://api.test/echo", headers={"X-Other": placeholder}))
    assert response.status_code == 200
    assert _header(_last(env.a), "x-other") == placeholder
    assert env.audits("credential", "not_replaced_misplaced")


def test_rate_limit_answers_429_and_audits(env: Env) -> None:
    placeholder = env.creds["limited"].placeholder
    statuses = []
    with env.client() as client:
        for _ in range(5):
            response = env.remember(
                client.get("https://other.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
            )
            statuses.append(response.status_code)
    assert statuses[:3] == [200, 200, 200]
    assert statuses[3:] == [429, 429]
    assert len(env.audits("credential", "rate_limited")) >= 2


def test_expired_credential_is_refused(env: Env) -> None:
    before = len(env.a.requests())
    placeholder = env.creds["old"].placeholder
    with env.client() as client:
        response = env.remember(
            client.get("https://old.apps.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
        )
    assert response.status_code == 403
    assert "expired" in response.text
    assert len(env.a.requests()) == before
    assert env.audits("credential", "expired")


def test_redirect_to_forbidden_host_is_checked_and_leaks_nothing(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    with env.client() as client:
        first = env.remember(
            client.get(
                "https://api.test/redirect",
                params={"to": "http://evil.test/echo"},
                headers={"Authorization": f"Bearer {placeholder}"},
            )
        )
        assert first.status_code == 302
        assert first.headers["location"] == "http://evil.test/echo"
        assert CANARY not in first.headers["x-echo-auth"]  # the upstream echoed it; the gateway masked it
        assert env.audits("redirect", "location_refused")
        before = len(env.b.requests())
        follow = env.remember(
            client.get(first.headers["location"], headers={"Authorization": f"Bearer {placeholder}"})
        )
        assert follow.status_code == 403
        assert len(env.b.requests()) == before  # the forbidden host never saw the request
        # a Location that carries an injected secret (reflected query) is scrubbed
        second = env.remember(
            client.get("https://api.test/reflect-redirect", params={"key": env.creds["q"].placeholder})
        )
    assert second.status_code == 302
    assert CANARY_QUERY in _last(env.a)["path"]
    assert CANARY_QUERY not in second.headers["location"]


def test_following_redirects_with_httpx_never_reaches_forbidden_host(env: Env) -> None:
    before = len(env.b.requests())
    with env.client(follow_redirects=True) as client:
        response = env.remember(
            client.get("http://api.test/redirect", params={"to": "http://evil.test/echo"})
        )
    assert response.status_code == 403
    assert len(env.b.requests()) == before


# ---------------------------------------------------------------------------------------------------------
# policy


@pytest.mark.parametrize(
    "url",
    [
        "http://evil.test/echo",  # not allowed
        "http://blocked.apps.test/echo",  # deny wins over *.apps.test
        "http://10.98.12.2/echo",  # private address not allowed
        "http://10.98.11.99/echo",  # deny CIDR inside an allowed CIDR
        "http://rebind.test/echo",  # allowed name resolving to loopback
        "http://meta.test/echo",  # allowed name resolving to the metadata address
        "http://private.test/echo",  # allowed name resolving to a private address no CIDR allows
        "http://169.254.169.254/latest/meta-data/",
        "http://2130706433/",  # 127.0.0.1, decimal
        "http://0177.0.0.1/",  # octal
        "http://0x7f.1/",  # hex, short form
        "http://127.1/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::1]/",
        "http://0x0a.0x62.12.2/echo",  # 10.98.12.2 in hex
    ],
)
def test_denied_destinations_over_http_proxy(env: Env, url: str) -> None:
    before_a, before_b = len(env.a.requests()), len(env.b.requests())
    authority = url.split("://", 1)[1].split("/", 1)[0]
    raw = _raw(
        env.gateway.ports["proxy"],
        f"GET {url} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert _status(raw) == 403, raw[:300]
    assert b"x-space-egress: refused" in raw.lower()
    assert (len(env.a.requests()), len(env.b.requests())) == (before_a, before_b)


@pytest.mark.parametrize("url", ["https://evil.test/", "https://10.98.12.2/", "https://rebind.test/"])
def test_denied_destinations_over_connect(env: Env, url: str) -> None:
    with env.client() as client, pytest.raises(httpx.ProxyError):
        client.get(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://0x0a.0x62.11.2/echo",  # 10.98.11.2 in hex: allowed by CIDR
        "http://174197506/echo",  # 10.98.11.2 as one decimal number
        "http://[::ffff:10.98.11.2]/echo",
        "http://x.apps.test/echo",
    ],
)
def test_allowed_destinations_in_odd_notation(env: Env, url: str) -> None:
    authority = url.split("://", 1)[1].split("/", 1)[0]
    raw = _raw(
        env.gateway.ports["proxy"],
        f"GET {url} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert _status(raw) == 200, raw[:300]
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["server"] == "a"


def test_trailing_dot_and_case_are_normalized_and_still_bound(env: Env) -> None:
    placeholder = env.creds["hdr"].placeholder  # this one may be sent over plain HTTP
    request = (
        f"GET http://API.Test./echo HTTP/1.1\r\nHost: API.Test.\r\nX-Api-Key: {placeholder}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    raw = _raw(env.gateway.ports["proxy"], request)
    env.seen_by_client.append(raw)
    assert _status(raw) == 200
    assert _header(_last(env.a), "x-api-key") == CANARY_HEADER
    assert CANARY_HEADER.encode() not in raw


def test_credential_is_not_injected_into_plain_http_unless_allowed(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    with env.client() as client:
        response = env.remember(
            client.get("http://api.test/echo", headers={"Authorization": f"Bearer {placeholder}"})
        )
    assert response.status_code == 200
    assert _header(_last(env.a), "authorization") == f"Bearer {placeholder}"
    assert env.audits("credential", "not_replaced_plaintext")[-1]["credential"] == "gh"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET http://api.test\x01/echo HTTP/1.1\r\nHost: api.test\r\n\r\n",
        b"GET http://api.test%00.evil.test/echo HTTP/1.1\r\nHost: api.test\r\n\r\n",
        b"GET http://api..test/echo HTTP/1.1\r\nHost: api..test\r\n\r\n",
        b"GET http://api.test/echo HTTP/1.1\r\nHost: evil.test\r\n\r\n",  # Host differs from the URL
        b"GET http://api.test/echo HTTP/1.1\r\nHost: api.test\r\nHost: evil.test\r\n\r\n",
        b"GET http://user@evil.test@api.test/echo HTTP/1.1\r\nHost: api.test\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nHost: api.test\r\n\r\n",  # origin-form to the explicit proxy
        b"GET http://api.test /echo HTTP/1.1\r\nHost: api.test\r\n\r\n",
    ],
)
def test_malformed_requests_are_refused(env: Env, request_bytes: bytes) -> None:
    before = len(env.a.requests())
    raw = _raw(env.gateway.ports["proxy"], request_bytes)
    assert _status(raw) in (400, 403), raw[:200]
    assert len(env.a.requests()) == before


def test_unknown_source_has_no_egress(env: Env) -> None:
    raw = _raw(
        env.gateway.ports["proxy"],
        b"GET http://api.test/echo HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n",
        source="127.0.0.3",
    )
    assert _status(raw) == 403


# ---------------------------------------------------------------------------------------------------------
# transparent listeners


def test_transparent_http_decides_by_host_header(env: Env) -> None:
    port = env.gateway.ports["transparent_http"]
    ok = _raw(port, b"GET /echo HTTP/1.1\r\nHost: x.apps.test\r\nConnection: close\r\n\r\n")
    assert _status(ok) == 200 and b'"server": "a"' in ok
    for host in (b"evil.test", b"2130706433", b"10.98.12.2", b"rebind.test"):
        raw = _raw(port, b"GET /echo HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
        assert _status(raw) == 403, host


def _tls_get(
    port: int, sni: str, host: str, path: str, extra: str = "", cafile: pathlib.Path | None = None
) -> bytes:
    context = ssl.create_default_context(cafile=str(cafile))  # verifies the name too
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    with context.wrap_socket(sock, server_hostname=sni) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
        chunks = []
        while True:
            try:
                chunk = tls.recv(65536)
            except (ssl.SSLError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_transparent_tls_intercepts_bound_host(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    raw = _tls_get(
        env.gateway.ports["transparent_tls"],
        "api.test",
        "api.test",
        "/echo",
        f"Authorization: Bearer {placeholder}\r\n",
        env.client_ca,
    )
    env.seen_by_client.append(raw)
    assert _status(raw) == 200
    assert _header(_last(env.a), "authorization") == f"Bearer {CANARY}"
    assert CANARY.encode() not in raw


def test_transparent_tls_splices_unbound_host(env: Env) -> None:
    # trusting only the upstream's CA proves the bytes were not intercepted
    raw = _tls_get(
        env.gateway.ports["transparent_tls"], "unbound.test", "unbound.test", "/echo", cafile=env.upstream_ca
    )
    assert _status(raw) == 200


def test_transparent_tls_refuses_denied_sni(env: Env) -> None:
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        raw = _tls_get(
            env.gateway.ports["transparent_tls"], "evil.test", "evil.test", "/echo", cafile=env.upstream_ca
        )
        assert raw == b""
        raise ConnectionResetError("closed without a response")


def test_sni_host_mismatch_on_intercepted_connection_is_refused(env: Env) -> None:
    before = len(env.b.requests())
    raw = _tls_get(
        env.gateway.ports["transparent_tls"], "api.test", "evil.test", "/echo", cafile=env.client_ca
    )
    assert _status(raw) == 421
    assert len(env.b.requests()) == before


def _connect_then_tls(env: Env, connect_host: str, sni: str) -> bytes:
    context = ssl.create_default_context(cafile=str(env.client_ca))
    context.check_hostname = False
    with socket.create_connection(("127.0.0.1", env.gateway.ports["proxy"]), timeout=10) as sock:
        sock.sendall(f"CONNECT {connect_host}:443 HTTP/1.1\r\nHost: {connect_host}:443\r\n\r\n".encode())
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200")
        with context.wrap_socket(sock, server_hostname=sni) as tls:
            tls.sendall(f"GET /echo HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            return tls.recv(65536)


@pytest.mark.parametrize("connect_host", ["api.test", "unbound.test"])
def test_connect_with_different_sni_is_refused(env: Env, connect_host: str) -> None:
    before = len(env.b.requests())
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        _connect_then_tls(env, connect_host, "evil.test")
    assert len(env.b.requests()) == before
    assert [a for a in env.audit if a.get("sni") == "evil.test"]


# ---------------------------------------------------------------------------------------------------------
# DNS


def test_dns_answers_only_allowed_names(env: Env) -> None:
    port = env.gateway.ports["dns"]

    def ask(name: str, source: str = SOURCE, tcp: bool = False) -> dns.message.Message:
        query = dns.message.make_query(name, "A")
        if tcp:
            return dns.query.tcp(query, "127.0.0.1", port=port, timeout=5, source=source)
        return dns.query.udp(query, "127.0.0.1", port=port, timeout=5, source=source)

    answer = ask("api.test")
    assert answer.rcode() == dns.rcode.NOERROR
    assert [r.to_text() for rrset in answer.answer for r in rrset] == [env.a.addr]
    assert ask("API.TEST.", tcp=True).rcode() == dns.rcode.NOERROR
    assert ask("evil.test").rcode() == dns.rcode.NXDOMAIN
    assert ask("blocked.apps.test").rcode() == dns.rcode.NXDOMAIN
    assert ask("rebind.test").rcode() == dns.rcode.REFUSED  # allowed name, loopback address
    assert ask("private.test").rcode() == dns.rcode.REFUSED
    assert ask("api.test", source="127.0.0.3").rcode() == dns.rcode.REFUSED  # no sandbox there
    assert env.audits("dns", "denied")


# ---------------------------------------------------------------------------------------------------------
# policy changes, forget, CA


def test_policy_change_applies_to_the_next_request_and_closes_tunnels(env: Env) -> None:
    sandbox, source = "sb-egress-2", "127.0.0.2"
    env.gateway.set_policy(sandbox, source, EgressPolicy(allow=["unbound.test", "10.98.11.0/24"]))
    try:
        request = b"GET http://unbound.test/ HTTP/1.1\r\nHost: unbound.test\r\nConnection: close\r\n\r\n"
        assert _status(_raw(env.gateway.ports["proxy"], request, source=source)) == 200
        # an open tunnel to unbound.test
        tunnel = socket.create_connection(
            ("127.0.0.1", env.gateway.ports["proxy"]), timeout=10, source_address=(source, 0)
        )
        tunnel.sendall(b"CONNECT unbound.test:80 HTTP/1.1\r\nHost: unbound.test:80\r\n\r\n")
        assert tunnel.recv(4096).startswith(b"HTTP/1.1 200")
        tunnel.sendall(b"GET / HTTP/1.1\r\nHost: unbound.test\r\n\r\n")
        seen = b""
        while b"ok a" not in seen:
            chunk = tunnel.recv(4096)
            assert chunk, seen
            seen += chunk
        started = time.monotonic()
        env.gateway.set_policy(sandbox, source, EgressPolicy(allow=["10.98.11.0/24"]))
        assert _status(_raw(env.gateway.ports["proxy"], request, source=source)) == 403
        elapsed = time.monotonic() - started
        assert elapsed < 1.0
        tunnel.settimeout(5)
        assert tunnel.recv(4096) == b""  # closed by the policy change
        tunnel.close()
        # one source address belongs to one sandbox
        with pytest.raises(errors.Conflict):
            env.gateway.set_policy("sb-egress-3", source, EgressPolicy(allow=["unbound.test"]))
    finally:
        env.gateway.forget(sandbox)
    assert _status(_raw(env.gateway.ports["proxy"], request, source=source)) == 403
    assert env.gateway.policy(sandbox) is None


def test_ca_is_private_and_created_once(env: Env) -> None:
    ca_dir = env.workdir / "ca"
    assert stat.S_IMODE((ca_dir / "ca.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(ca_dir.stat().st_mode) == 0o700
    again = EgressGateway(
        ca_dir=ca_dir, credentials=StaticCredentials(), audit=lambda record: None, listen_host="127.0.0.1"
    )
    assert again.ca_certificate_pem == env.gateway.ca_certificate_pem


def test_large_download_through_intercepted_connection_is_intact(env: Env) -> None:
    size = 8 << 20
    with env.client() as client:
        response = client.get(
            "https://api.test/bytes",
            params={"n": size},
            headers={"Authorization": f"Bearer {env.creds['gh'].placeholder}"},
        )
    assert response.status_code == 200
    assert len(response.content) == size and response.content == b"x" * size


def test_request_body_is_forwarded_and_not_searched_for_placeholders(env: Env) -> None:
    placeholder = env.creds["gh"].placeholder
    body = (f"token={placeholder}&" + "x" * 200_000).encode()
    with env.client() as client:
        response = env.remember(
            client.post(
                "https://api.test/echo",
                content=body,
                headers={"Authorization": f"Bearer {placeholder}", "Expect": "100-continue"},
            )
        )
    assert response.status_code == 200
    received = _last(env.a)
    assert received["body"] == body.decode()  # forwarded intact, the placeholder in it untouched
    assert _header(received, "authorization") == f"Bearer {CANARY}"


def test_unreachable_upstream_answers_502(env: Env) -> None:
    raw = _raw(
        env.gateway.ports["proxy"],
        b"GET http://api.test:81/ HTTP/1.1\r\nHost: api.test:81\r\nConnection: close\r\n\r\n",
    )
    assert _status(raw) == 502
    connect = _raw(
        env.gateway.ports["proxy"], b"CONNECT unbound.test:81 HTTP/1.1\r\nHost: unbound.test:81\r\n\r\n"
    )
    assert _status(connect) == 502


def test_keepalive_requests_are_each_decided(env: Env) -> None:
    """Two requests on one client connection: the second to a forbidden host is refused."""
    request = (
        b"GET http://api.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n"
        b"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"
    )
    before = len(env.b.requests())
    raw = _raw(env.gateway.ports["proxy"], request)
    assert raw.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 403" in raw
    assert len(env.b.requests()) == before


@pytest.mark.parametrize("port_name", ["transparent_tls", "proxy"])
def test_encrypted_client_hello_is_refused(env: Env, port_name: str) -> None:
    """ECH hides the real server name behind a public one: the gateway cannot decide, so it refuses."""
    hello = with_extension(client_hello("unbound.test"), 0xFE0D, b"\x00" * 8)
    with socket.create_connection(("127.0.0.1", env.gateway.ports[port_name]), timeout=10) as sock:
        if port_name == "proxy":
            sock.sendall(b"CONNECT unbound.test:443 HTTP/1.1\r\nHost: unbound.test:443\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(hello)
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert answer == b""
    assert [a for a in env.audit if a.get("reason") == "encrypted ClientHello"]


# ---------------------------------------------------------------------------------------------------------
# A sandbox-like client in its own network namespace whose traffic is redirected by nftables (the shape
# H-net's per-sandbox network gives it): it ignores proxy settings and talks to the upstream's address; the
# gateway learns the original port with SO_ORIGINAL_DST and decides by Host / SNI.

REDIRECTED_SANDBOX = "sb-egress-redirected"

CLIENT_CODE = r"""
import json, socket, ssl, sys
import dns.message, dns.query
mode, target, port, name, extra, cafile = sys.argv[1:7]
if mode == "dns":
    answer = dns.query.udp(dns.message.make_query(name, "A"), target, port=int(port), timeout=5)
    print(json.dumps({"rcode": answer.rcode(), "answer": [r.to_text() for s in answer.answer for r in s]}))
    raise SystemExit
data = b""
try:
    sock = socket.create_connection((target, int(port)), timeout=10)
    if mode == "tls":
        sock = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=name)
    sock.sendall(f"GET /echo HTTP/1.1\r\nHost: {name}\r\n{extra}Connection: close\r\n\r\n".encode())
    while chunk := sock.recv(65536):
        data += chunk
except (ConnectionError, ssl.SSLError, TimeoutError):
    pass
print(json.dumps({"raw": data.decode("latin-1")}))
"""


@dataclass
class Redirected:
    namespace: str
    gateway: EgressGateway
    audit: list[dict[str, Any]]
    ca_file: pathlib.Path

    def run(self, mode: str, target: str, port: int, name: str, extra: str = "") -> dict[str, Any]:
        out = subprocess.run(
            [
                "nsenter", f"--net=/var/run/netns/{self.namespace}", sys.executable, "-c", CLIENT_CODE,
                mode, target, str(port), name, extra, str(self.ca_file),
            ],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return dict(json.loads(out.stdout))


@pytest.fixture(scope="module")
def redirected(env: Env) -> Iterator[Redirected]:
    tag = f"spx{os.getpid() % 100000:05d}"
    namespace, host_if, peer_if = f"{tag}-sbx", f"{tag}sh", f"{tag}sn"
    host_addr, addr = "10.98.13.1", "10.98.13.2"
    table = f"space_egress_test_{os.getpid()}"
    audit: list[dict[str, Any]] = []
    gateway: EgressGateway | None = None
    try:
        veth_namespace(namespace, host_if, peer_if, host_addr, addr, default_route=True)
        gateway = EgressGateway(
            ca_dir=env.workdir / "ca-redirected",
            credentials=StaticCredentials({REDIRECTED_SANDBOX: list(env.creds.values())}),
            audit=audit.append,
            resolver=env.gateway.ctx.resolver,
            listen_host=host_addr,
            trust_store=env.upstream_ca,
            # wrong on purpose: a request that works proves the original port came from SO_ORIGINAL_DST
            transparent_default_ports={"http": 9, "tls": 9},
        )
        env.loop.run(gateway.start())
        gateway.set_policy(REDIRECTED_SANDBOX, addr, POLICY)
        ports = gateway.ports
        rules = f"""
table ip {table} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{host_if}" tcp dport 80 redirect to :{ports["transparent_http"]}
    iifname "{host_if}" tcp dport 443 redirect to :{ports["transparent_tls"]}
    iifname "{host_if}" udp dport 53 redirect to :{ports["dns"]}
  }}
}}
"""
        subprocess.run(["nft", "-f", "-"], input=rules, check=True, capture_output=True, text=True)
        ca_file = env.workdir / "redirected-trust.pem"
        ca_file.write_bytes(gateway.ca_certificate_pem + env.upstream_ca.read_bytes())
        yield Redirected(namespace, gateway, audit, ca_file)
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True, check=False)
        if gateway is not None:
            env.loop.run(gateway.close())
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
        assert table not in tables
        assert leftovers(tag) == []


def test_redirected_http_is_decided_by_host_with_the_original_port(env: Env, redirected: Redirected) -> None:
    ok = redirected.run("http", env.a.addr, 80, "x.apps.test")["raw"]
    assert ok.startswith("HTTP/1.1 200") and '"server": "a"' in ok
    allowed = [a for a in redirected.audit if a["event"] == "egress" and a["decision"] == "allowed"]
    assert allowed[-1]["port"] == 80 and allowed[-1]["mode"] == "transparent"
    # the address the client dialled does not matter: the Host header is the destination that is decided
    refused = redirected.run("http", env.a.addr, 80, "evil.test")["raw"]
    assert refused.startswith("HTTP/1.1 403")


def test_redirected_tls_intercepts_bound_host_and_splices_others(env: Env, redirected: Redirected) -> None:
    placeholder = env.creds["gh"].placeholder
    raw = redirected.run("tls", env.a.addr, 443, "api.test", f"Authorization: Bearer {placeholder}\r\n")[
        "raw"
    ]
    env.seen_by_client.append(raw.encode("latin-1"))
    assert raw.startswith("HTTP/1.1 200")
    assert _header(_last(env.a), "authorization") == f"Bearer {CANARY}"
    assert CANARY not in raw
    spliced = redirected.run("tls", env.a.addr, 443, "unbound.test")["raw"]
    assert spliced.startswith("HTTP/1.1 200")
    refused = redirected.run("tls", env.a.addr, 443, "evil.test")["raw"]
    assert refused == ""
    # no SNI (a client dialling an IP literal sends none): the original destination address is decided
    by_address = redirected.run("tls", env.a.addr, 443, env.a.addr)["raw"]
    assert by_address.startswith("HTTP/1.1 200")
    assert redirected.run("tls", env.b.addr, 443, env.b.addr)["raw"] == ""  # 10.98.12.2: not allowed


def test_redirected_dns_answers_only_allowed_names(env: Env, redirected: Redirected) -> None:
    resolver = "10.98.13.1"
    allowed = redirected.run("dns", resolver, 53, "api.test")
    assert allowed == {"rcode": 0, "answer": [env.a.addr]}
    assert redirected.run("dns", resolver, 53, "evil.test")["rcode"] == dns.rcode.NXDOMAIN


def test_addresses_of_the_node_itself_are_refused(env: Env) -> None:
    """10.98.11.1 is the host side of upstream a's veth: inside the allowed 10.98.11.0/24, but the node's
    own address, so a host service listening on all addresses must stay out of reach."""
    service = socket.create_server(("0.0.0.0", 0))
    service.settimeout(0.5)
    port = service.getsockname()[1]
    try:
        for authority in (f"{env.a.host_addr}:{port}", f"0x0a.0x62.11.1:{port}"):
            request = f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
            raw = _raw(env.gateway.ports["proxy"], request.encode())
            assert _status(raw) == 403 and b"node itself" in raw
        connect = _raw(
            env.gateway.ports["proxy"],
            f"CONNECT {env.a.host_addr}:{port} HTTP/1.1\r\nHost: {env.a.host_addr}:{port}\r\n\r\n".encode(),
        )
        assert _status(connect) == 403
        with pytest.raises(TimeoutError):
            service.accept()  # nothing ever reached the host service
    finally:
        service.close()


def test_connections_per_source_are_capped(env: Env) -> None:
    small = EgressGateway(
        ca_dir=env.workdir / "ca",
        credentials=StaticCredentials(),
        audit=lambda record: None,
        resolver=env.gateway.ctx.resolver,
        listen_host="127.0.0.1",
        max_connections_per_source=2,
    )
    env.loop.run(small.start())
    held: list[socket.socket] = []
    try:
        small.set_policy("sb-cap", SOURCE, POLICY)
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", small.ports["proxy"]), timeout=5)
            sock.sendall(b"CONNECT unbound.test:80 HTTP/1.1\r\nHost: unbound.test:80\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            held.append(sock)
        third = socket.create_connection(("127.0.0.1", small.ports["proxy"]), timeout=5)
        third.sendall(b"CONNECT unbound.test:80 HTTP/1.1\r\nHost: unbound.test:80\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert third.recv(4096) == b""  # closed at once
        third.close()
        held.pop().close()
        time.sleep(0.2)
        again = socket.create_connection(("127.0.0.1", small.ports["proxy"]), timeout=5)
        again.sendall(b"CONNECT unbound.test:80 HTTP/1.1\r\nHost: unbound.test:80\r\n\r\n")
        assert again.recv(4096).startswith(b"HTTP/1.1 200")  # a freed slot is usable again
        held.append(again)
    finally:
        for sock in held:
            sock.close()
        env.loop.run(small.close())


class _BrokenSource:
    async def credentials(self, sandbox_id: str) -> list[Credential]:
        raise errors.Unavailable("control plane unreachable for credentials")


def test_unavailable_credential_source_fails_closed(env: Env) -> None:
    broken = EgressGateway(
        ca_dir=env.workdir / "ca",
        credentials=_BrokenSource(),
        audit=lambda record: None,
        resolver=env.gateway.ctx.resolver,
        listen_host="127.0.0.1",
    )
    env.loop.run(broken.start())
    before = len(env.a.requests())
    try:
        broken.set_policy("sb-broken", SOURCE, POLICY)
        plain = _raw(
            broken.ports["proxy"],
            b"GET http://unbound.test/ HTTP/1.1\r\nHost: unbound.test\r\nConnection: close\r\n\r\n",
        )
        assert _status(plain) == 502
        tunnel = _raw(
            broken.ports["proxy"], b"CONNECT unbound.test:443 HTTP/1.1\r\nHost: unbound.test:443\r\n\r\n"
        )
        assert _status(tunnel) == 503
        assert len(env.a.requests()) == before
    finally:
        env.loop.run(broken.close())
