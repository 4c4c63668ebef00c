"""Egress policy: host normalization and allow/deny decisions.

Invariants:
- Every decision is made on a parsed, normalized destination, never on the raw string a sandbox sent:
  names are lower-cased, UTS-46 mapped, IDNA (A-label) encoded, trailing dot stripped; anything with control
  bytes, whitespace, empty labels or characters outside [a-z0-9_-] is refused as invalid. A host that
  *ends in a number* is an IPv4 literal in the loose notation every URL parser accepts (decimal
  `2130706433`, octal `0177.0.0.1`, hex `0x7f.1`, short forms `127.1`) and is parsed to an address, or
  refused; IPv6 literals (bracketed or not, with embedded IPv4) are parsed to addresses.
- Deny wins over allow. No policy (or an empty one) allows nothing.
- Names are resolved only when an allow *domain* pattern matches them (so the gateway's resolver cannot be
  used to exfiltrate data through DNS queries for arbitrary names). IP literals are allowed only by an allow
  CIDR.
- Every address a connection would use (the literal, or each resolved address) is checked again: deny CIDRs,
  addresses that are never reachable from a sandbox (loopback, link-local incl. the metadata address,
  multicast, unspecified, reserved), and private ranges, which are reachable only when an allow CIDR lying
  inside that private range names them explicitly (so `0.0.0.0/0` never opens 10/8) and, when the policy
  carries `private_networks` (a node with a control plane: what an org admin approved for the project,
  ADR 0026), that allow CIDR also lies inside one of those. IPv6 forms that embed an IPv4 address
  (mapped, compatible, NAT64, 6to4) are checked under every address they embed.
- The gateway connects to the checked address itself (pinning), so DNS rebinding between check and
  connect is impossible.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

import idna
from pydantic import BaseModel, Field, field_validator

from space.core import errors

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]  # noqa: UP007 (runtime alias)
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]  # noqa: UP007

MAX_NAME_LENGTH = 253
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_DEC = re.compile(r"^[0-9]+$")
_OCT = re.compile(r"^[0-7]+$")
_HEX = re.compile(r"^[0-9a-fA-F]*$")

# Never reachable from a sandbox through a tenant policy (only an operator may open them, e.g. a benchmark
# against a loopback upstream).
ALWAYS_BLOCKED: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "192.0.0.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "100::/64",
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)
# Reachable only when an allow CIDR inside the range names them.
PRIVATE: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "100.64.0.0/10",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "192.0.2.0/24",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "fc00::/7",
        "2001:db8::/32",
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPAT = ipaddress.ip_network("::/96")


@dataclass(frozen=True)
class Destination:
    """A normalized destination host: a name (A-label form) or an address (`address` set)."""

    host: str
    address: IPAddress | None = None

    @property
    def is_address(self) -> bool:
        return self.address is not None


def _invalid(raw: str, why: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"invalid destination host {raw!r}: {why}", host=raw)


def _ipv4_number(part: str) -> int | None:
    """One part of a loose IPv4 literal (WHATWG URL rules): decimal, 0-prefixed octal or 0x-hex."""
    if part == "":
        return None
    if part[:2] in ("0x", "0X"):
        digits = part[2:]
        if not _HEX.match(digits):
            return None
        return int(digits, 16) if digits else 0
    if len(part) > 1 and part[0] == "0":
        return int(part[1:], 8) if _OCT.match(part[1:]) else None
    return int(part) if _DEC.match(part) else None


def _ends_in_number(labels: Sequence[str]) -> bool:
    last = labels[-1]
    if _DEC.match(last):
        return True
    return last[:2] in ("0x", "0X") and bool(_HEX.match(last[2:]))


def _parse_loose_ipv4(raw: str, labels: Sequence[str]) -> ipaddress.IPv4Address:
    if len(labels) > 4:
        raise _invalid(raw, "not an IPv4 address (too many parts)")
    numbers: list[int] = []
    for label in labels:
        number = _ipv4_number(label)
        if number is None:
            raise _invalid(raw, "not an IPv4 address")
        numbers.append(number)
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        raise _invalid(raw, "IPv4 part out of range")
    value = last
    for index, number in enumerate(head):
        value += number << (8 * (3 - index))
    return ipaddress.IPv4Address(value)


def _parse_ipv6(raw: str, text: str) -> ipaddress.IPv6Address:
    if "%" in text:
        raise _invalid(raw, "IPv6 zone identifiers are not allowed")
    try:
        return ipaddress.IPv6Address(text)
    except ValueError as exc:
        raise _invalid(raw, "not an IPv6 address") from exc


def _check_characters(raw: str) -> None:
    for char in raw:
        code = ord(char)
        if code <= 0x20 or code == 0x7F or (0x80 <= code <= 0x9F) or char.isspace():
            raise _invalid(raw, "control bytes or whitespace")


def normalize_host(raw: str) -> Destination:
    """Parse a host as a sandbox sent it (URL authority host, Host header, SNI, CONNECT, DNS question).

    Raises errors.InvalidArgument for anything that is not a well-formed name or address.
    """
    if not isinstance(raw, str) or raw == "":
        raise _invalid(str(raw), "empty")
    _check_characters(raw)
    if raw.startswith("["):
        if not raw.endswith("]"):
            raise _invalid(raw, "unbalanced brackets")
        return _address_destination(_parse_ipv6(raw, raw[1:-1]))
    if ":" in raw:
        return _address_destination(_parse_ipv6(raw, raw))
    labels = _labels(raw, _mapped(raw))
    if _ends_in_number(labels):
        return _address_destination(_parse_loose_ipv4(raw, labels))
    return _name_destination(raw, labels)


def _mapped(raw: str) -> str:
    """`raw` in lower case, non-ASCII names through the UTS-46 mapping (then checked again)."""
    if raw.isascii():
        return raw.lower()
    try:
        text = idna.uts46_remap(raw, std3_rules=False, transitional=False)
    except idna.IDNAError as exc:
        raise _invalid(raw, f"IDNA mapping failed ({exc})") from exc
    _check_characters(text)
    return text.lower()


def _labels(raw: str, text: str) -> list[str]:
    """The labels of a mapped name (one trailing dot dropped); none may be empty."""
    if text.endswith("."):
        text = text[:-1]
    if text == "":
        raise _invalid(raw, "empty")
    labels = text.split(".")
    if any(label == "" for label in labels):
        raise _invalid(raw, "empty label")
    return labels


def _a_label(raw: str, label: str) -> str:
    """The ASCII (A-label) form of one label; an xn-- label must be valid punycode."""
    if label.isascii():
        if label.startswith("xn--"):
            try:
                idna.ulabel(label)
            except (idna.IDNAError, UnicodeError) as exc:
                raise _invalid(raw, f"bad punycode label {label!r}") from exc
        return label
    try:
        return idna.alabel(label).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        raise _invalid(raw, f"label {label!r} is not valid IDNA ({exc})") from exc


def _name_destination(raw: str, labels: list[str]) -> Destination:
    encoded = [_a_label(raw, label) for label in labels]
    for label in encoded:
        if not _LABEL.match(label):
            raise _invalid(raw, f"label {label!r} has characters outside [a-z0-9_-] or is too long")
    name = ".".join(encoded)
    if len(name) > MAX_NAME_LENGTH:
        raise _invalid(raw, "name too long")
    return Destination(host=name)


def _address_destination(address: IPAddress) -> Destination:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return Destination(host=str(address), address=address)


def split_authority(authority: str, default_port: int) -> tuple[str, int]:
    """Split "host", "host:port", "[v6]", "[v6]:port" into (raw host, port). Raises InvalidArgument."""
    if authority == "" or "@" in authority:
        raise errors.InvalidArgument(f"invalid authority {authority!r}", authority=authority)
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise errors.InvalidArgument(f"invalid authority {authority!r}", authority=authority)
        host, rest = authority[: end + 1], authority[end + 1 :]
        if rest == "":
            return host, default_port
        if not rest.startswith(":"):
            raise errors.InvalidArgument(f"invalid authority {authority!r}", authority=authority)
        port_text = rest[1:]
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    elif ":" in authority:
        raise errors.InvalidArgument(f"unbracketed IPv6 in authority {authority!r}", authority=authority)
    else:
        return authority, default_port
    if port_text == "":
        return host, default_port
    if not _DEC.match(port_text) or not 0 < int(port_text) < 65536:
        raise errors.InvalidArgument(f"invalid port in authority {authority!r}", authority=authority)
    return host, int(port_text)


def embedded_addresses(address: IPAddress) -> list[IPAddress]:
    """The address and every IPv4 address it embeds (all of them must pass the checks)."""
    found: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            found.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            found.append(address.sixtofour)
        if address.teredo is not None:
            found.extend(address.teredo)
        if address in _NAT64 or (address in _COMPAT and int(address) > 1):
            found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


# ---------------------------------------------------------------------------------------------------------
# Policy model


def _parse_entry(entry: str) -> str:
    """Canonical form of one allow/deny entry: a CIDR, an address (as /32, /128), `*`, a name or `*.name`."""
    text = entry.strip()
    if text == "*":
        return "*"
    if "/" in text:
        try:
            return str(ipaddress.ip_network(text.replace("[", "").replace("]", ""), strict=False))
        except ValueError as exc:
            raise ValueError(f"invalid CIDR {entry!r}") from exc
    if text.startswith("*."):
        try:
            suffix = normalize_host(text[2:])
        except errors.InvalidArgument as exc:
            raise ValueError(exc.message) from exc
        if suffix.is_address:
            raise ValueError(f"wildcard over an address {entry!r}")
        return "*." + suffix.host
    try:
        destination = normalize_host(text)
    except errors.InvalidArgument as exc:
        raise ValueError(exc.message) from exc
    if destination.address is not None:
        return str(ipaddress.ip_network(destination.address))
    return destination.host


class EgressPolicy(BaseModel):
    """Allowed and denied destinations of one sandbox: domains (exact or `*.suffix`, `*` = any name) and
    CIDRs (or single addresses). Deny wins; an empty policy allows nothing. `private_networks`: the private
    networks an org admin approved for the sandbox's project (sent by the control plane); an allow CIDR in
    a private range opens it only inside one of them. None: no org layer (a node without a control plane,
    whose operator writes the policies)."""

    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    private_networks: list[str] | None = None

    @field_validator("allow", "deny")
    @classmethod
    def _canonical(cls, entries: list[str]) -> list[str]:
        return [_parse_entry(entry) for entry in entries]

    @field_validator("private_networks")
    @classmethod
    def _networks(cls, entries: list[str] | None) -> list[str] | None:
        if entries is None:
            return None
        try:
            return [str(ipaddress.ip_network(entry, strict=False)) for entry in entries]
        except ValueError as exc:
            raise ValueError(f"invalid private network: {exc}") from exc


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    host: str = ""
    addresses: tuple[IPAddress, ...] = ()


@dataclass
class _Rules:
    any_name: bool = False
    names: set[str] = field(default_factory=set)
    suffixes: list[str] = field(default_factory=list)
    networks: list[IPNetwork] = field(default_factory=list)

    def add(self, entry: str) -> None:
        if entry == "*":
            self.any_name = True
        elif entry.startswith("*."):
            self.suffixes.append(entry[1:])
        elif "/" in entry:
            self.networks.append(ipaddress.ip_network(entry))
        else:
            self.names.add(entry)

    def matches_name(self, name: str) -> bool:
        return self.any_name or name in self.names or any(name.endswith(s) for s in self.suffixes)

    def matches_address(self, address: IPAddress) -> bool:
        return any(address.version == n.version and address in n for n in self.networks)


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """True when a normalized name matches one of the normalized patterns (exact, `*.suffix`, `*`)."""
    rules = _Rules()
    for pattern in patterns:
        rules.add(pattern)
    return rules.matches_name(name)


class CompiledPolicy:
    """A policy ready for decisions; immutable once built (the gateway swaps whole objects atomically)."""

    def __init__(self, policy: EgressPolicy, *, operator_allowed: Sequence[IPNetwork] = ()) -> None:
        self.policy = policy
        self._allow = _Rules()
        self._deny = _Rules()
        for entry in policy.allow:
            self._allow.add(entry)
        for entry in policy.deny:
            self._deny.add(entry)
        self._operator_allowed = tuple(operator_allowed)
        self._approved: tuple[IPNetwork, ...] | None = (
            None
            if policy.private_networks is None
            else tuple(ipaddress.ip_network(n) for n in policy.private_networks)
        )

    def decide_name(self, destination: Destination) -> Decision:
        """First step for a destination: may it be contacted (and, for a name, resolved) at all?"""
        if destination.address is not None:
            return self.decide_address(destination.address, literal=True, host=destination.host)
        name = destination.host
        if self._deny.matches_name(name):
            return Decision(False, "name denied by policy", name)
        if not self._allow.matches_name(name):
            return Decision(False, "name not allowed by policy", name)
        return Decision(True, "name allowed", name)

    def decide_address(self, address: IPAddress, *, literal: bool, host: str = "") -> Decision:
        """Check one address a connection would use. `literal`: the sandbox named the address itself, so
        an allow CIDR must cover it; resolved addresses of an allowed name need not be listed."""
        host = host or str(address)
        candidates = embedded_addresses(address)
        for candidate in candidates:
            if self._deny.matches_address(candidate):
                return Decision(False, f"address {candidate} denied by policy", host)
            if self._operator(candidate):
                continue
            if any(candidate.version == n.version and candidate in n for n in ALWAYS_BLOCKED):
                return Decision(False, f"address {candidate} is never reachable from a sandbox", host)
            private = next((n for n in PRIVATE if candidate.version == n.version and candidate in n), None)
            if private is not None and not self._explicitly_allowed(candidate, private):
                return Decision(False, f"private address {candidate} not explicitly allowed", host)
        if literal and not any(self._allow.matches_address(c) for c in candidates):
            return Decision(False, f"address {address} not allowed by policy", host)
        return Decision(True, "address allowed", host, (address,))

    def filter_addresses(self, destination: Destination, addresses: Iterable[IPAddress]) -> Decision:
        """Resolved addresses of an allowed name: keep those that pass; refuse if none does."""
        kept: list[IPAddress] = []
        last = Decision(False, "name resolved to no address", destination.host)
        for resolved in addresses:
            address = resolved
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            decision = self.decide_address(address, literal=False, host=destination.host)
            if decision.allowed:
                if address not in kept:
                    kept.append(address)
            else:
                last = decision
        if not kept:
            return last
        return Decision(True, "name allowed", destination.host, tuple(kept))

    def operator_allows(self, address: IPAddress) -> bool:
        """Inside a range the operator opened (never set by a tenant policy)."""
        return self._operator(address)

    def _operator(self, address: IPAddress) -> bool:
        return any(address.version == n.version and address in n for n in self._operator_allowed)

    def _explicitly_allowed(self, address: IPAddress, private: IPNetwork) -> bool:
        for network in self._allow.networks:
            if network.version != private.version or address not in network:
                continue
            if not network.subnet_of(private):  # type: ignore[arg-type]
                continue
            if self._approved is None or any(
                network.version == a.version and network.subnet_of(a)  # type: ignore[arg-type]
                for a in self._approved
            ):
                return True
        return False


NO_EGRESS = CompiledPolicy(EgressPolicy())
