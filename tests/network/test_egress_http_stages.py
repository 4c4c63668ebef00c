"""The HTTP exchange of the egress gateway, stage by stage (space.node.egress.http): each stage's contract,
with a hostile input each: a request that lies about its host (decide), a placeholder sent to a host its
credential is not bound to (substitute), a head beyond the size limit and hop-by-hop smuggling (forward),
an upstream echoing the secret back in every place it can (scrub)."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import pathlib
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import h11
import pytest

from space.node.egress import Credential, StaticCredentials, StaticResolver
from space.node.egress.context import GatewayContext, SandboxEntry
from space.node.egress.credentials import RateLimiter, Scrubber
from space.node.egress.http.decide import Route, decide, note_redirect
from space.node.egress.http.forward import outgoing_request, relay_response, send_request
from space.node.egress.http.messages import MAX_HEAD, Refused
from space.node.egress.http.scrub import ConnectionSecrets, ResponseScrubber
from space.node.egress.http.session import HttpSession
from space.node.egress.http.substitute import Substituted, substitute_credentials
from space.node.egress.http.target import TargetRules, request_target
from space.node.egress.policy import CompiledPolicy, EgressPolicy, normalize_host
from space.node.egress.tls import CertificateAuthority
from space.node.egress.upstream import READ_SIZE, Upstream

SECRET = "s3cr3t-value-0123456789"
SOURCE = "10.200.0.2"
UPSTREAM_ADDRESS = "127.0.0.9"  # loopback: nothing here may reach past the machine


def request(target: str, headers: list[tuple[str, str]], method: str = "GET") -> h11.Request:
    # HTTP/1.0 when there is no Host header (h11 refuses to build an HTTP/1.1 request without one)
    return h11.Request(
        method=method, target=target, headers=headers, http_version="1.1" if headers else "1.0"
    )


def credential(**kw: Any) -> Credential:
    base: dict[str, Any] = {"name": "gh", "value": SECRET, "hosts": ["api.test"]}
    base.update(kw)
    return Credential.model_validate(base)


def route(host: str = "api.test", target: bytes = b"/", port: int = 443) -> Route:
    return Route("sb-1", normalize_host(host), port, target, (ipaddress.ip_address(UPSTREAM_ADDRESS),))


class Audit:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def decisions(self, event: str) -> list[str]:
        return [r["decision"] for r in self.records if r["event"] == event]


def context(
    tmp_path: pathlib.Path, audit: Audit, credentials: list[Credential] | None = None
) -> GatewayContext:
    ctx = GatewayContext(
        ca=CertificateAuthority(tmp_path / "ca"),
        credentials=StaticCredentials({"sb-1": credentials or []}),
        audit_callback=audit,
        resolver=StaticResolver({"api.test": [UPSTREAM_ADDRESS], "other.test": [UPSTREAM_ADDRESS]}),
        upstream_ssl=None,
    )
    policy = CompiledPolicy(
        EgressPolicy(allow=["api.test", "other.test", "127.0.0.0/8"], deny=["evil.test"]),
        operator_allowed=[ipaddress.ip_network("127.0.0.0/8")],
    )
    ctx.sandboxes["sb-1"] = SandboxEntry("sb-1", SOURCE, policy)
    ctx.by_source[SOURCE] = "sb-1"
    return ctx


# -- decide ---------------------------------------------------------------------------------------------


def test_target_rules_refuse_a_request_that_lies_about_its_host() -> None:
    proxy = TargetRules("proxy")
    found = request_target(request("http://API.test:8080/x?y=1", [("host", "api.test:8080")]), proxy)
    assert (found.destination.host, found.port, found.origin) == ("api.test", 8080, b"/x?y=1")
    cases: list[tuple[TargetRules, h11.Request, int, str]] = [
        (proxy, request("http://api.test/", [("host", "evil.test")]), 400, "does not match"),
        (proxy, request("/relative", [("host", "api.test")]), 400, "absolute http://"),
        (proxy, request("https://api.test/", [("host", "api.test")]), 400, "use CONNECT"),
        (TargetRules("transparent"), request("/", []), 400, "missing Host"),
        (
            TargetRules("transparent"),
            request("http://evil.test/", [("host", "api.test")]),
            400,
            "does not match",
        ),
        (TargetRules("transparent"), request("api.test", [("host", "api.test")]), 400, "unsupported"),
        (TargetRules("transparent"), request("/", [("host", "exa mple.test")]), 400, ""),
    ]
    # inside TLS terminated for api.test, a request for another host must not ride on api.test's credential
    intercepted = TargetRules("intercepted", fixed=(normalize_host("api.test"), 443))
    cases += [
        (intercepted, request("/", [("host", "evil.test")]), 421, "TLS server name"),
        (intercepted, request("https://evil.test/", [("host", "api.test")]), 421, "TLS server name"),
    ]
    for rules, bad, status, reason in cases:
        with pytest.raises(Refused) as refused:
            request_target(bad, rules)
        assert refused.value.status == status and reason in refused.value.reason, (bad, refused.value.reason)
    transparent = request_target(
        request("/p", [("host", "api.test:9999")]), TargetRules("transparent", None, 8080)
    )
    assert transparent.port == 8080  # the port the sandbox dialled, never the one its Host header names


def test_decide_allows_only_checked_addresses_and_audits_every_decision(tmp_path: pathlib.Path) -> None:
    audit = Audit()
    ctx = context(tmp_path, audit)
    rules = TargetRules("proxy")

    async def scenario() -> None:
        allowed = await decide(ctx, SOURCE, request("http://api.test/a", [("host", "api.test")]), rules)
        assert allowed == route(target=b"/a", port=80)
        with pytest.raises(Refused) as denied:
            await decide(ctx, SOURCE, request("http://evil.test/", [("host", "evil.test")]), rules)
        assert denied.value.status == 403 and "evil.test" in denied.value.reason
        with pytest.raises(Refused) as stranger:  # an unknown source gets nothing, not even a lookup
            await decide(ctx, "10.200.0.99", request("http://api.test/", [("host", "api.test")]), rules)
        assert stranger.value.status == 403

    asyncio.run(scenario())
    assert audit.decisions("egress") == ["allowed", "denied"]


def test_a_redirect_to_a_refused_host_is_audited_not_followed(tmp_path: pathlib.Path) -> None:
    audit = Audit()
    ctx = context(tmp_path, audit)
    note_redirect(ctx, SOURCE, route(), b"https://other.test/ok")
    note_redirect(ctx, SOURCE, route(), b"/relative")
    note_redirect(ctx, SOURCE, route(), b"https://evil.test/steal")
    note_redirect(ctx, SOURCE, route(), b"http://exa mple.test/")
    assert audit.decisions("redirect") == ["location_refused", "invalid_location"]
    assert audit.records[0]["location_host"] == "evil.test"


# -- substitute -----------------------------------------------------------------------------------------


class CredentialAudit:
    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str]] = []

    def __call__(
        self, event: str, sandbox_id: str, host: str, decision: str, name: str | None = None
    ) -> None:
        assert event == "credential" and sandbox_id == "sb-1" and name is not None
        self.outcomes.append((decision, host))


def test_a_placeholder_sent_to_another_host_is_not_replaced() -> None:
    c = credential()
    audit = CredentialAudit()
    headers = [(b"authorization", f"Bearer {c.placeholder}".encode())]
    target = f"/?token={c.placeholder}".encode()
    result = substitute_credentials(
        [c], route("evil.test", target), headers, limiter=RateLimiter(), encrypted=True, audit=audit
    )
    assert result.headers == headers and result.target == target  # forwarded as is: the value never leaves
    assert not result.bound and result.secret_forms == frozenset()
    assert audit.outcomes == [("not_replaced_unbound_host", "evil.test")]


def test_substitution_for_a_bound_host_names_what_the_response_must_not_carry() -> None:
    c = credential()
    audit = CredentialAudit()
    headers = [(b"authorization", f"Bearer {c.placeholder}".encode()), (b"x-other", c.placeholder.encode())]
    result = substitute_credentials([c], route(), headers, limiter=RateLimiter(), encrypted=True, audit=audit)
    assert result.headers[0] == (b"authorization", f"Bearer {SECRET}".encode())
    assert result.headers[1] == (b"x-other", c.placeholder.encode())  # only where the method says
    assert result.bound and SECRET.encode() in result.secret_forms
    assert f"Bearer {SECRET}".encode() in result.secret_forms
    assert audit.outcomes == [("injected", "api.test")]

    plain = CredentialAudit()
    in_clear = substitute_credentials(
        [c], route(), headers, limiter=RateLimiter(), encrypted=False, audit=plain
    )
    assert in_clear.headers == headers and plain.outcomes == [("not_replaced_plaintext", "api.test")]
    assert in_clear.bound  # nothing was injected, but the response of a bound host is scrubbed anyway


def test_an_expired_or_exhausted_credential_refuses_the_request() -> None:
    expired = credential(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    headers = [(b"authorization", f"Bearer {expired.placeholder}".encode())]
    audit = CredentialAudit()
    with pytest.raises(Refused) as refused:
        substitute_credentials(
            [expired], route(), headers, limiter=RateLimiter(), encrypted=True, audit=audit
        )
    assert refused.value.status == 403 and audit.outcomes == [("expired", "api.test")]

    limited = credential(rate_per_minute=1)
    headers = [(b"authorization", f"Bearer {limited.placeholder}".encode())]
    limiter, audit = RateLimiter(), CredentialAudit()
    substitute_credentials([limited], route(), headers, limiter=limiter, encrypted=True, audit=audit)
    with pytest.raises(Refused) as again:
        substitute_credentials([limited], route(), headers, limiter=limiter, encrypted=True, audit=audit)
    assert again.value.status == 429 and audit.outcomes == [
        ("injected", "api.test"),
        ("rate_limited", "api.test"),
    ]


# -- forward --------------------------------------------------------------------------------------------


def test_the_upstream_request_carries_no_hop_by_hop_or_sandbox_chosen_host() -> None:
    incoming = request(
        "http://api.test/",
        [
            ("host", "api.test"),
            ("connection", "keep-alive, x-smuggle"),
            ("x-smuggle", "1"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("te", "trailers"),
            ("accept-encoding", "gzip"),
            ("expect", "100-continue"),
            ("content-length", "3"),
        ],
        method="POST",
    )
    substituted = Substituted(
        [(n, v) for n, v in incoming.headers], b"/", bound=True, secret_forms=frozenset()
    )
    out = outgoing_request(incoming, substituted, route(port=8443), default_port=443, identity_encoding=True)
    assert out.headers == [
        (b"host", b"api.test:8443"),
        (b"content-length", b"3"),
        (b"accept-encoding", b"identity"),  # so an echoed value can be scrubbed
    ]
    assert out.expects_continue and out.has_body
    ipv6 = Route("sb-1", normalize_host("[2001:db8::1]"), 443, b"/", ())
    plain = outgoing_request(incoming, substituted, ipv6, default_port=443, identity_encoding=False)
    assert plain.headers[0] == (b"host", b"[2001:db8::1]") and (b"accept-encoding", b"gzip") in plain.headers


class FakeClient:
    """The sandbox's end of a session: bytes to read, and what the gateway wrote back."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.written = b""
        self.closed = False

    async def read(self, size: int = 65536) -> bytes:
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk

    async def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def test_an_oversized_request_head_is_refused_before_anything_is_decided(tmp_path: pathlib.Path) -> None:
    audit = Audit()
    ctx = context(tmp_path, audit)
    cookie = b"c=" + b"x" * (READ_SIZE + MAX_HEAD)  # incomplete after a whole read, and beyond MAX_HEAD
    client = FakeClient(b"GET http://api.test/ HTTP/1.1\r\nhost: api.test\r\ncookie: " + cookie + b"\r\n\r\n")
    session = HttpSession(ctx, SOURCE, client, "proxy")  # type: ignore[arg-type]
    asyncio.run(session.run())
    assert client.written.startswith(b"HTTP/1.1 400 ") and b"x-space-egress: refused" in client.written
    assert client.closed and audit.records == [] and ctx.active == {}


class FakeWriter:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class FakePeers:
    """Both ends for the forward stage: scripted client and upstream events, every upstream connection."""

    def __init__(self, client: list[Any], answers: list[list[Any]], reused: list[bool]) -> None:
        self.client = client
        self.answers = answers  # per upstream connection handed out: its events (an exception is raised)
        self.reused = reused
        self.handed: list[Upstream] = []
        self.sent: list[Any] = []
        self.closed = 0

    async def client_event(self) -> Any:
        return self.client.pop(0)

    async def send_client(self, event: Any) -> None:
        self.sent.append(event)

    async def upstream_event(self, upstream: Upstream) -> Any:
        event = self.answers[self.handed.index(upstream)].pop(0)
        if isinstance(event, Exception):
            raise event
        return event

    async def upstream_for(self, route: Route) -> tuple[Upstream, bool]:
        conn = h11.Connection(h11.CLIENT)
        upstream = Upstream(route_key(route), asyncio.StreamReader(), FakeWriter(), conn, 0)  # type: ignore[arg-type]
        self.handed.append(upstream)
        return upstream, self.reused[len(self.handed) - 1]

    def close_upstream(self) -> None:
        self.closed += 1


def route_key(found: Route) -> tuple[str, str, int, bool, str]:
    return (found.sandbox_id, found.destination.host, found.port, True, str(found.addresses[0]))


def _outgoing(headers: list[tuple[bytes, bytes]]) -> Any:
    incoming = request("/", [(n.decode(), v.decode()) for n, v in headers])
    substituted = Substituted(list(headers), b"/", bound=False, secret_forms=frozenset())
    return outgoing_request(incoming, substituted, route(), default_port=443, identity_encoding=False)


def test_only_a_bodiless_request_on_a_reused_connection_is_retried_once() -> None:
    ok = h11.Response(status_code=204, headers=[])
    outgoing = _outgoing([(b"host", b"api.test")])

    async def scenario() -> None:
        stale = FakePeers([h11.EndOfMessage()], [[h11.ConnectionClosed()], [ok]], reused=[True, False])
        upstream, first = await send_request(stale, route(), outgoing)
        assert first is ok and upstream is stale.handed[1] and stale.closed == 1
        assert stale.handed[1].writer.data.startswith(b"GET / HTTP/1.1\r\nhost: api.test\r\n")

        fresh = FakePeers([h11.EndOfMessage()], [[ConnectionResetError()]], reused=[False])
        with pytest.raises(ConnectionError):
            await send_request(fresh, route(), outgoing)
        assert len(fresh.handed) == 1 and fresh.closed == 1  # a fresh connection failing is not retried

        twice = FakePeers(
            [h11.EndOfMessage()], [[h11.ConnectionClosed()], [h11.ConnectionClosed()]], [True, True]
        )
        with pytest.raises(ConnectionError):
            await send_request(twice, route(), outgoing)
        assert len(twice.handed) == 2  # one retry, never more

        body = _outgoing([(b"host", b"api.test"), (b"content-length", b"3")])
        streaming = FakePeers([h11.Data(data=b"abc"), h11.EndOfMessage()], [[]], reused=[False])
        upstream, first = await send_request(streaming, route(), body)
        assert first is None and upstream.writer.data.endswith(b"\r\n\r\nabc")  # type: ignore[attr-defined]

    asyncio.run(scenario())


# -- scrub ----------------------------------------------------------------------------------------------


def test_a_secret_echoed_by_the_upstream_never_reaches_the_sandbox() -> None:
    c = credential(method="basic", value=f"user:{SECRET}")
    substituted = Substituted([], b"/", bound=True, secret_forms=frozenset(c.secret_forms()))
    scrubber = ConnectionSecrets().scrubber(substituted)
    locations: list[bytes] = []
    value = c.value.encode()
    encoded = base64.b64encode(value)
    escaped = quote(c.value, safe="").encode()
    events: list[Any] = [
        h11.InformationalResponse(status_code=103, headers=[("link", b"</" + value + b">")]),
        h11.InformationalResponse(status_code=101, headers=[("upgrade", "evil")]),
        h11.Response(
            status_code=302,
            headers=[
                ("location", b"https://evil.test/?leak=" + escaped),
                ("x-echo", b"Basic " + encoded),
                ("keep-alive", b"timeout=5"),
                ("transfer-encoding", b"chunked"),
            ],
        ),
        h11.Data(data=b"echo: " + value[:9]),  # a value split across chunks
        h11.Data(data=value[9:] + b" done"),
        h11.EndOfMessage(headers=[("x-trailer", value)]),
    ]
    peers = FakePeers([], [events[1:]], reused=[False])

    async def scenario() -> None:
        upstream, _reused = await peers.upstream_for(route())
        await relay_response(peers, upstream, events[0], ResponseScrubber(scrubber, locations.append))

    asyncio.run(scenario())
    early, head, *body, end = peers.sent
    assert isinstance(early, h11.InformationalResponse) and early.status_code == 103  # no 101 forwarded
    assert isinstance(head, h11.Response)
    assert [n for n, _ in head.headers] == [b"location", b"x-echo", b"transfer-encoding"]
    assert locations == [b"https://evil.test/?leak=" + b"*" * len(escaped)]  # audited, scrubbed too
    assert isinstance(end, h11.EndOfMessage) and list(end.headers) == []  # trailers dropped
    text = b"".join(bytes(d.data) for d in body)
    seen = b"".join(bytes(v) for e in (early, head) for _, v in e.headers) + text
    assert SECRET.encode() not in seen and encoded not in seen and escaped not in seen
    assert text == b"echo: " + b"*" * len(value) + b" done"  # same length: framing unchanged


def test_later_responses_on_a_connection_are_scrubbed_of_earlier_values() -> None:
    secrets = ConnectionSecrets()
    first = secrets.scrubber(Substituted([], b"/", bound=True, secret_forms=frozenset({b"first-value-1234"})))
    assert first.scrub(b"first-value-1234") == b"*" * 16
    later = secrets.scrubber(Substituted([], b"/", bound=True, secret_forms=frozenset({b"later-value-5678"})))
    assert later.scrub(b"first-value-1234 later-value-5678") == b"*" * 16 + b" " + b"*" * 16
    unbound = secrets.scrubber(Substituted([], b"/", bound=False, secret_forms=frozenset()))
    assert not unbound.active  # nothing of the sandbox's can come from a host no credential is bound to
    passthrough = ResponseScrubber(Scrubber([]), lambda _location: None)
    assert passthrough.body(b"first-value-1234") == b"first-value-1234" and passthrough.end() == b""
