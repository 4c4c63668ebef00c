"""Egress policy: host normalization table and allow/deny decisions (pure logic, no sockets)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from space.core import errors
from space.node.egress.policy import CompiledPolicy, EgressPolicy, normalize_host, split_authority

NORMALIZED = [
    # names: case, trailing dot, IDNA, UTS-46 mapping (fullwidth letters and dots)
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("EXAMPLE.com.", "example.com"),
    ("bücher.de", "xn--bcher-kva.de"),
    ("BÜCHER.de", "xn--bcher-kva.de"),
    ("xn--bcher-kva.de", "xn--bcher-kva.de"),
    ("ｅｘａｍｐｌｅ.com", "example.com"),  # noqa: RUF001
    ("example。com", "example.com"),
    ("a_b.example.com", "a_b.example.com"),
    ("localhost", "localhost"),
    # IPv4 in every notation a URL parser accepts
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("0X7F000001", "127.0.0.1"),
    ("017700000001", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0177.0000.0000.0001", "127.0.0.1"),
    ("0x7f.0.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("0x7f.0x0.0x0.0x1", "127.0.0.1"),
    ("１２７.０.０.１", "127.0.0.1"),  # noqa: RUF001 - fullwidth digits map to an address, not a name
    ("169.254.169.254", "169.254.169.254"),
    ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
    ("2852039166", "169.254.169.254"),
    ("0", "0.0.0.0"),
    ("10.98.11.2", "10.98.11.2"),
    ("174197506", "10.98.11.2"),
    # IPv6, bracketed or not; IPv4-mapped becomes the IPv4 address
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("[::ffff:127.0.0.1]", "127.0.0.1"),
    ("[::ffff:7f00:1]", "127.0.0.1"),
    ("[::FFFF:169.254.169.254]", "169.254.169.254"),
    ("[2001:DB8::1]", "2001:db8::1"),
    ("[fe80::1]", "fe80::1"),
]

INVALID = [
    "",
    ".",
    "..",
    "a..b",
    ".example.com",
    "example.com..",
    "exa mple.com",
    "example.com ",
    " example.com",
    "exa\tmple.com",
    "example.com\r\nX: y",
    "exa\x00mple.com",
    "exa\x7fmple.com",
    "exa\x85mple.com",
    "exa\u3000mple.com",  # ideographic space
    "exa%6dple.com",
    "user@example.com",
    "example.com/path",
    "example.com\\x",
    "*.example.com",
    "exa*mple.com",
    "1.2.3.4.5",
    "256.0.0.1",
    "1.2.3.256",
    "0x100.0.0.1",
    "1.2.65536",
    "4294967296",
    "09.0.0.1",
    "0x7g.0.0.1",
    "1_0.0.0.1",
    "example.123",
    "[::1",
    "[::1]x",
    "[fe80::1%25eth0]",
    "[fe80::1%eth0]",
    "[1.2.3.4]",
    ":::",
    "xn--zz.example",
    "a" * 64 + ".com",
    ".".join(["a" * 60] * 5),
]


@pytest.mark.parametrize(("raw", "expected"), NORMALIZED)
def test_normalization(raw: str, expected: str) -> None:
    assert normalize_host(raw).host == expected


@pytest.mark.parametrize("raw", INVALID)
def test_invalid_hosts_are_refused(raw: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        normalize_host(raw)


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        ("example.com", ("example.com", 80)),
        ("example.com:8080", ("example.com", 8080)),
        ("example.com:", ("example.com", 80)),
        ("[::1]", ("[::1]", 80)),
        ("[::1]:443", ("[::1]", 443)),
    ],
)
def test_split_authority(authority: str, expected: tuple[str, int]) -> None:
    assert split_authority(authority, 80) == expected


@pytest.mark.parametrize("authority", ["", "a@b", "::1", "a:b", "a:0", "a:65536", "[::1]x", "a:-1", "a: 80"])
def test_split_authority_refuses(authority: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        split_authority(authority, 80)


POLICY = CompiledPolicy(
    EgressPolicy(
        allow=["api.example.com", "*.apps.example.com", "10.98.11.0/24", "0.0.0.0/0", "::/0", "Bücher.de."],
        deny=["blocked.apps.example.com", "10.98.11.99", "203.0.113.0/24"],
    )
)


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("api.example.com", True),
        ("API.EXAMPLE.COM.", True),
        ("x.apps.example.com", True),
        ("a.b.apps.example.com", True),
        ("apps.example.com", False),  # *.suffix does not match the suffix itself
        ("blocked.apps.example.com", False),  # deny wins
        ("evilapps.example.com", False),
        ("api.example.com.evil.test", False),
        ("example.com", False),
        ("xn--bcher-kva.de", True),
        ("bücher.de", True),
        ("10.98.11.2", True),
        ("0x0a.0x62.0x0b.2", True),
        ("10.98.11.99", False),  # deny CIDR inside allow CIDR
        ("10.98.12.2", False),  # private: 0.0.0.0/0 does not open it
        ("8.8.8.8", True),  # public, allowed by 0.0.0.0/0
        ("203.0.113.5", False),
        ("127.0.0.1", False),
        ("2130706433", False),
        ("0177.0.0.1", False),
        ("127.1", False),
        ("0", False),
        ("169.254.169.254", False),
        ("[::ffff:127.0.0.1]", False),
        ("[::ffff:169.254.169.254]", False),
        ("[::1]", False),
        ("[fe80::1]", False),
        ("[64:ff9b::7f00:1]", False),  # NAT64 of 127.0.0.1
        ("[2002:7f00:1::1]", False),  # 6to4 of 127.0.0.1
        ("[::127.0.0.1]", False),  # IPv4-compatible
        ("[fd00:ec2::254]", False),  # private (unique local)
        ("[2606:4700::1111]", True),
        ("224.0.0.1", False),
        ("255.255.255.255", False),
    ],
)
def test_decisions(host: str, allowed: bool) -> None:
    destination = normalize_host(host)
    decision = POLICY.decide_name(destination)
    assert decision.allowed is allowed, decision.reason


def test_empty_policy_allows_nothing() -> None:
    empty = CompiledPolicy(EgressPolicy())
    for host in ("example.com", "8.8.8.8", "[2606:4700::1111]"):
        assert not empty.decide_name(normalize_host(host)).allowed


def test_resolved_addresses_are_checked_and_filtered() -> None:
    destination = normalize_host("api.example.com")
    assert POLICY.decide_name(destination).allowed
    addresses = [ipaddress.ip_address(a) for a in ("127.0.0.1", "10.98.11.2", "169.254.169.254", "8.8.4.4")]
    decision = POLICY.filter_addresses(destination, addresses)
    assert decision.allowed
    assert [str(a) for a in decision.addresses] == ["10.98.11.2", "8.8.4.4"]
    only_bad = POLICY.filter_addresses(destination, [ipaddress.ip_address("127.0.0.1")])
    assert not only_bad.allowed and "never reachable" in only_bad.reason
    assert not POLICY.filter_addresses(destination, []).allowed
    mapped = POLICY.filter_addresses(destination, [ipaddress.ip_address("::ffff:10.98.12.2")])
    assert not mapped.allowed


def test_private_range_needs_an_explicit_cidr() -> None:
    name_only = CompiledPolicy(EgressPolicy(allow=["internal.test"]))
    internal = normalize_host("internal.test")
    assert not name_only.filter_addresses(internal, [ipaddress.ip_address("10.1.2.3")]).allowed
    explicit = CompiledPolicy(EgressPolicy(allow=["internal.test", "10.1.0.0/16"]))
    assert explicit.filter_addresses(internal, [ipaddress.ip_address("10.1.2.3")]).allowed
    # a tenant cannot open loopback or link-local, however explicitly
    loopback = CompiledPolicy(EgressPolicy(allow=["127.0.0.0/8", "169.254.169.254/32"]))
    assert not loopback.decide_name(normalize_host("127.0.0.1")).allowed
    assert not loopback.decide_name(normalize_host("169.254.169.254")).allowed
    # ... only the operator can (e.g. a benchmark against a loopback upstream)
    operator = CompiledPolicy(
        EgressPolicy(allow=["127.0.0.0/8"]), operator_allowed=[ipaddress.ip_network("127.0.0.0/8")]
    )
    assert operator.decide_name(normalize_host("127.0.0.1")).allowed


def test_name_resolved_through_wildcard_any() -> None:
    anything = CompiledPolicy(EgressPolicy(allow=["*"], deny=["*.evil.test"]))
    assert anything.decide_name(normalize_host("whatever.example")).allowed
    assert not anything.decide_name(normalize_host("x.evil.test")).allowed
    assert not anything.decide_name(normalize_host("8.8.8.8")).allowed  # "*" is about names, not addresses


@pytest.mark.parametrize(
    ("entry", "canonical"),
    [
        ("Example.COM.", "example.com"),
        ("*.Apps.Example.com", "*.apps.example.com"),
        ("10.0.0.1", "10.0.0.1/32"),
        ("10.0.0.1/8", "10.0.0.0/8"),
        ("2130706433", "127.0.0.1/32"),
        ("::1", "::1/128"),
        ("[2001:db8::]/32", "2001:db8::/32"),
        ("*", "*"),
    ],
)
def test_policy_entries_are_canonical(entry: str, canonical: str) -> None:
    assert EgressPolicy(allow=[entry]).allow == [canonical]


@pytest.mark.parametrize("entry", ["a..b", "10.0.0.0/33", "*.1.2.3.4", "exa mple.com", "*.", "**.a.com", ""])
def test_bad_policy_entries_are_rejected(entry: str) -> None:
    with pytest.raises(ValidationError):
        EgressPolicy(allow=[entry])


HOST_ALPHABET = "abcxyz0189.-_:[]%@ \t\x00\x7fX\u00dc\u00fc\uff45\uff11\u30020x"


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=HOST_ALPHABET, max_size=40))
def test_normalization_is_total_and_idempotent(raw: str) -> None:
    """Any input either fails with InvalidArgument or gives a canonical host that normalizes to itself."""
    try:
        destination = normalize_host(raw)
    except errors.InvalidArgument:
        return
    again = normalize_host(destination.host if destination.address is None or ":" not in destination.host
                           else f"[{destination.host}]")  # fmt: skip
    assert again == destination
    if destination.address is None:
        assert destination.host == destination.host.lower().strip(".")
        assert all(label for label in destination.host.split("."))
        assert destination.host.isascii()
    decision = POLICY.decide_name(destination)
    assert isinstance(decision.allowed, bool)


@settings(max_examples=2000, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.sampled_from(["dec", "hex", "oct", "dotted-hex"]))
def test_every_ipv4_spelling_parses_to_the_same_address(value: int, style: str) -> None:
    address = ipaddress.IPv4Address(value)
    octets = [int(o) for o in str(address).split(".")]
    spelled = {
        "dec": str(value),
        "hex": hex(value),
        "oct": "0" + format(value, "o"),
        "dotted-hex": ".".join(hex(o) for o in octets),
    }[style]
    assert normalize_host(spelled).address == address
    loopback_or_link_local = address.is_loopback or address.is_link_local
    if loopback_or_link_local:
        assert not POLICY.decide_name(normalize_host(spelled)).allowed


# The resolver's timeouts and the DNS server's caps: tests/network/test_egress_dns_limits.py
