"""`login` credentials in the real egress gateway (ADR 0063): an HTTPS upstream in its own network namespace
(veth to the host, certificate from a test CA), the gateway on the host, httpx through its proxy acting as
the sandbox. The upstream logs every request it receives, so each test sees exactly what left the node.
Needs root (netns, veth)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, quote, quote_plus

import httpx
import pytest

from space.node.egress import Credential, EgressGateway, EgressPolicy, StaticCredentials, StaticResolver
from space.node.egress.http.form import MAX_FORM_BODY
from tests.support.egress_net import Upstream, UpstreamCA, leftovers, start_upstream
from tests.support.loop import BackgroundLoop

pytestmark = pytest.mark.root

SANDBOX = "sb-login-1"
SOURCE = "127.0.0.1"
USERNAME = "alice-" + os.urandom(6).hex()
PASSWORD = "P&ss w=rd+ü%-" + os.urandom(8).hex()  # every character a form must encode
LIMITED_PASSWORD = "limited-" + os.urandom(8).hex()
EXPIRED_PASSWORD = "expired-" + os.urandom(8).hex()
SECRETS = [USERNAME, PASSWORD, quote_plus(PASSWORD), LIMITED_PASSWORD, EXPIRED_PASSWORD]


def _login(name: str, host: str, password: str, **kw: Any) -> Credential:
    return Credential(
        name=name,
        value=password,
        username=USERNAME,
        hosts=[host],
        method="login",
        origin=f"https://{host}",
        username_field="user",
        password_field="pass",
        **kw,
    )


@dataclass
class Env:
    gateway: EgressGateway
    upstream: Upstream
    creds: dict[str, Credential]
    client_ca: pathlib.Path
    audit: list[dict[str, Any]]
    seen_by_client: list[bytes] = field(default_factory=list)

    def client(self, **kw: Any) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.client_ca))
        proxy = f"http://127.0.0.1:{self.gateway.ports['proxy']}"
        return httpx.Client(proxy=proxy, verify=context, timeout=10, **kw)

    def post(self, url: str, **kw: Any) -> httpx.Response:
        with self.client() as client:
            response = client.post(url, **kw)
        self.seen_by_client.append(response.content + repr(list(response.headers.raw)).encode())
        return response

    def received(self) -> dict[str, Any]:
        found = self.upstream.requests()
        assert found, "upstream received nothing"
        return found[-1]

    def decisions(self, credential: str) -> list[str]:
        return [a["decision"] for a in self.audit if a["credential"] == credential]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (network namespaces); CI runs as root")
    tag = f"spl{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-login-", dir="/var/tmp"))
    test_ca = UpstreamCA(workdir)
    names = ["login.test", "other.test", "limited.test", "old.test"]
    cert = test_ca.issue("login.pem", names, ["10.98.15.2"])
    loop = BackgroundLoop()
    upstream: Upstream | None = None
    gateway: EgressGateway | None = None
    try:
        upstream = start_upstream(tag, "login", 15, cert, workdir)
        creds = [
            _login("site", "login.test", PASSWORD, form_action="/echo"),
            _login("limited", "limited.test", LIMITED_PASSWORD, rate_per_minute=2),
            _login("old", "old.test", EXPIRED_PASSWORD, expires_at=datetime.now(UTC) - timedelta(minutes=1)),
        ]
        audit: list[dict[str, Any]] = []
        gateway = EgressGateway(
            ca_dir=workdir / "ca",
            credentials=StaticCredentials({SANDBOX: creds}),
            audit=audit.append,
            resolver=StaticResolver({name: [upstream.addr] for name in names}),
            listen_host="127.0.0.1",
            trust_store=test_ca.ca_file,
        )
        loop.run(gateway.start())
        gateway.set_policy(SANDBOX, SOURCE, EgressPolicy(allow=[*names, "10.98.15.0/24"]))
        client_ca = workdir / "client-trust.pem"
        client_ca.write_bytes(gateway.ca_certificate_pem + test_ca.ca_file.read_bytes())
        environment = Env(gateway, upstream, {c.name: c for c in creds}, client_ca, audit)
        yield environment
        # nothing the sandbox saw ever held a username or password (echoes are scrubbed)
        blob = b"\n".join(environment.seen_by_client)
        for secret in SECRETS:
            assert secret.encode() not in blob
    finally:
        if gateway is not None:
            loop.run(gateway.close())
        loop.close()
        if upstream is not None:
            upstream.close()
        shutil.rmtree(workdir, ignore_errors=True)
        assert leftovers(tag) == [], "network namespaces or veth pairs left behind"


def _placeholders(env: Env, name: str = "site") -> tuple[str, str]:
    credential = env.creds[name]
    return credential.username_placeholder, credential.placeholder


def test_form_post_to_the_bound_origin_arrives_with_the_real_values(env: Env) -> None:
    user, password = _placeholders(env)
    response = env.post(
        "https://login.test/echo",
        data={"user": user, "pass": password, "csrf": "token-1"},
        headers={"Expect": "100-continue"},
    )
    assert response.status_code == 200
    received = env.received()
    assert received["tls"] is True
    form = parse_qs(received["body"].encode("latin-1").decode(), keep_blank_values=True)
    assert form == {"user": [USERNAME], "pass": [PASSWORD], "csrf": ["token-1"]}
    assert f"pass={quote_plus(PASSWORD)}" in received["body"]  # re-encoded for the form
    # the upstream read exactly Content-Length bytes, and that was the whole substituted body
    length = dict((k.lower(), v) for k, v in received["headers"])["content-length"]
    assert int(length) == len(received["body"].encode("latin-1"))
    assert PASSWORD not in response.text and quote_plus(PASSWORD) not in response.text
    assert env.decisions("site")[-1] == "injected"


def test_the_same_post_to_another_origin_or_path_carries_only_placeholders(env: Env) -> None:
    user, password = _placeholders(env)
    before = len(env.decisions("site"))
    for url in ("https://other.test/echo", "https://login.test/elsewhere", "http://login.test/echo"):
        env.post(url, data={"user": user, "pass": password})
        body = env.received()["body"]
        assert f"user={user}&pass={password}" == body, url
    assert "injected" not in env.decisions("site")[before:]


def test_placeholders_in_headers_query_and_other_fields_are_not_substituted(env: Env) -> None:
    user, password = _placeholders(env)
    env.post(
        f"https://login.test/echo?pass={password}",
        data={"note": password, "user": user, "pass": f"x{password}"},
        headers={"X-Pass": password},
    )
    received = env.received()
    assert received["path"] == f"/echo?pass={password}"
    assert dict((k.lower(), v) for k, v in received["headers"])["x-pass"] == password
    form = parse_qs(received["body"])
    assert form["note"] == [password]
    assert form["pass"] == [f"x{password}"]  # not the whole value: not the placeholder
    assert form["user"] == [USERNAME]
    assert PASSWORD not in received["body"]
    assert "not_replaced_misplaced" in env.decisions("site")[-3:]


def test_percent_encoded_names_and_chunked_split_bodies_are_substituted(env: Env) -> None:
    user, password = _placeholders(env)
    body = f"p%61ss={quote(password, safe='')}&us%65r={user}".encode()

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(body), 7):  # the placeholders cross chunk boundaries
            yield body[i : i + 7]

    env.post(
        "https://login.test/echo",
        content=pieces(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    received = env.received()
    assert parse_qs(received["body"].encode("latin-1").decode()) == {"pass": [PASSWORD], "user": [USERNAME]}
    assert received["body"].startswith("p%61ss=")  # the rest of the body is kept as sent


def test_multipart_fields_are_substituted_but_never_a_file(env: Env) -> None:
    user, password = _placeholders(env)
    env.post(
        "https://login.test/echo",
        data={"user": user, "pass": password},
        files={"pass": ("pass.txt", password.encode(), "text/plain")},
    )
    body = env.received()["body"].encode("latin-1")
    assert body.count(PASSWORD.encode()) == 1  # the field, not the file part of the same name
    assert password.encode() in body
    assert USERNAME.encode() in body
    assert b'filename="pass.txt"\r\nContent-Type: text/plain\r\n\r\n' + password.encode() in body


def test_an_oversized_body_is_forwarded_unchanged_and_audited(env: Env) -> None:
    user, password = _placeholders(env)
    padding = "x" * MAX_FORM_BODY
    env.post("https://login.test/echo", data={"user": user, "pass": password, "pad": padding})
    body = env.received()["body"]
    assert f"user={user}&pass={password}&pad=" in body
    assert len(body) > MAX_FORM_BODY
    assert env.decisions("site")[-1] == "not_replaced_oversized"


def test_rate_limit_and_expiry_refuse_the_submission_and_are_audited(env: Env) -> None:
    user, password = _placeholders(env, "limited")
    statuses = [
        env.post("https://limited.test/echo", data={"user": user, "pass": password}).status_code
        for _ in range(3)
    ]
    assert statuses == [200, 200, 429]
    assert env.decisions("limited")[-3:] == ["injected", "injected", "rate_limited"]
    user, password = _placeholders(env, "old")
    count = len(env.upstream.requests())
    response = env.post("https://old.test/echo", data={"user": user, "pass": password})
    assert response.status_code == 403
    assert len(env.upstream.requests()) == count  # nothing left the node
    assert env.decisions("old")[-1] == "expired"
    assert json.dumps(env.audit).find(PASSWORD) == -1
