"""Validation and normalization of credential metadata and egress policies (no I/O).

Invariants:
- Every rejection is `errors.InvalidArgument` whose `field` names the offending request field
  (`hosts[1]`, `header`, `egress.allow[0]`, ...).
- Hosts and policy entries are stored in the canonical form of the node's egress gateway, parsed by its
  own code (space.node.egress.policy): lower case, no trailing dot, IDNA A-labels, IP literals in any
  notation as addresses, CIDRs. So the control plane accepts exactly what the gateway enforces, and the
  gateway compares *parsed* destinations with these, never raw strings.
- A credential's wildcard host `*.example.com` matches strict subdomains only and needs at least two labels
  after the `*.`; a bare `*` is refused for credentials (a secret goes only to hosts named for it). Policy
  entries follow the gateway (`*` there means "any name", still subject to its address checks).
- No host pattern spans registrants (ADR 0026): a wildcard over a public suffix of the Public Suffix List
  (ICANN or private section: `*.com`, `*.co.uk`, `*.github.io`) is refused for credentials and in allow
  lists, and a credential's exact host may not be an ICANN suffix (`com`) or an unknown TLD. The list is
  the copy shipped in the `publicsuffixlist` package, read from disk once; nothing is fetched at run time.
- An allow-list CIDR inside a private, shared, loopback, link-local or other special range is refused
  unless it lies inside a network the org admin approved for the project (`approved`); loopback,
  link-local and the other never-reachable ranges cannot be approved at all (the gateway never reaches
  them; only the node's operator can open them).
- A placeholder (`space-cred-<name>-<16 random [a-z0-9]>`, ~83 random bits from `secrets`) is chosen once
  per credential and kept across rotations; it is never derived from the value, so it reveals nothing.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from publicsuffixlist import PublicSuffixList
from pydantic import ValidationError

from space.core import errors
from space.node.egress.policy import ALWAYS_BLOCKED, PRIVATE, Destination, EgressPolicy, IPNetwork
from space.node.egress.policy import normalize_host as gateway_normalize_host

Scope = Literal["org", "project", "sandbox"]
Method = Literal["header", "bearer", "basic", "query", "login"]
SCOPES: Final[tuple[Scope, ...]] = ("org", "project", "sandbox")
METHODS: Final[tuple[Method, ...]] = ("header", "bearer", "basic", "query", "login")
# Most specific first: a sandbox's own credential shadows its project's, which shadows the org's.
SCOPE_PRECEDENCE: Final[tuple[Scope, ...]] = ("sandbox", "project", "org")

NAME_PATTERN: Final = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
ENV_VAR_PATTERN: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
HEADER_NAME_PATTERN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")  # RFC 9110 token
QUERY_PARAM_PATTERN: Final = re.compile(r"[A-Za-z0-9_.~-]{1,128}")
MAX_HOSTS: Final = 64
MAX_PRIVATE_NETWORKS: Final = 64
_IPV4_CARRIERS: Final = (ipaddress.IPv6Network("::ffff:0:0/96"), ipaddress.IPv6Network("64:ff9b::/96"))
MAX_POLICY_ENTRIES: Final = 512
MAX_RATE_PER_MINUTE: Final = 1_000_000
PLACEHOLDER_PREFIX: Final = "space-cred-"
_PLACEHOLDER_RANDOM_CHARS: Final = 16
_PLACEHOLDER_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz0123456789"
_QUOTE: Final = 60


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE else text[: _QUOTE - 3] + "..."


def validate_name(name: object, field: str = "name") -> str:
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise errors.InvalidArgument(
            f"invalid {field}: a letter, then up to 63 letters, digits, '_', '.' or '-', got {_quote(name)}",
            field=field,
        )
    return name


def default_env_var(name: str) -> str:
    """The environment variable a bound credential's placeholder appears in: its name, upper case, with
    every character outside [A-Z0-9_] as '_' (`openai.key` -> `OPENAI_KEY`)."""
    return re.sub(r"[^A-Z0-9_]", "_", name.upper())


def validate_env_var(value: object, field: str = "env_var") -> str:
    if not isinstance(value, str) or ENV_VAR_PATTERN.fullmatch(value) is None:
        raise errors.InvalidArgument(f"invalid {field}: not an environment variable name", field=field)
    return value


def new_placeholder(name: str) -> str:
    """`space-cred-<name>-<16 random>`: what the sandbox sees instead of the value (module invariants)."""
    readable = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "x"
    tail = "".join(secrets.choice(_PLACEHOLDER_ALPHABET) for _ in range(_PLACEHOLDER_RANDOM_CHARS))
    return f"{PLACEHOLDER_PREFIX}{readable}-{tail}"


@functools.cache
def _suffix_list(icann_only: bool) -> PublicSuffixList:
    """The Public Suffix List shipped with `publicsuffixlist` (a file in the package: never fetched)."""
    return PublicSuffixList(only_icann=icann_only)


def is_public_suffix(name: str, *, icann_only: bool = False) -> bool:
    """Is the normalized (A-label) `name` a public suffix, i.e. a zone under which unrelated parties
    register names (`com`, `co.uk`, and, unless `icann_only`, private ones such as `github.io`)? Unknown
    top-level labels count as public (`corp`, `localhost`)."""
    return bool(_suffix_list(icann_only).is_public(name))


def _refuse_public_wildcard(suffix: str, value: object, field: str) -> None:
    if is_public_suffix(suffix):
        raise errors.InvalidArgument(
            f"invalid {field}: {_quote(value)} spans a public suffix ({suffix!r} is on the Public Suffix "
            "List: its subdomains belong to unrelated owners); name the domain you mean, e.g. "
            f"'*.example.{suffix}'",
            field=field,
        )


def _gateway_host(value: str, field: str) -> Destination:
    try:
        return gateway_normalize_host(value.strip())
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"invalid {field}: {exc.message}", field=field) from exc


def normalize_host(value: object, field: str) -> str:
    """A credential host: an exact name or a `*.` wildcard (never an address), in the gateway's canonical form
    (its own parser, space.node.egress.policy, so both sides agree on every spelling)."""
    if not isinstance(value, str) or not value.strip():
        raise errors.InvalidArgument(f"invalid {field}: expected a host name", field=field)
    text = value.strip()
    if "/" in text or "://" in text:
        raise errors.InvalidArgument(
            f"invalid {field}: a host without port, scheme or path, got {_quote(value)}", field=field
        )
    if text.startswith("*."):
        rest = _gateway_host(text[2:], field)
        if rest.is_address or rest.host.count(".") < 1:
            raise errors.InvalidArgument(
                f"invalid {field}: a wildcard needs a domain of at least two labels after '*.', "
                f"got {_quote(value)}",
                field=field,
            )
        _refuse_public_wildcard(rest.host, value, field)
        return f"*.{rest.host}"
    if "*" in text:
        raise errors.InvalidArgument(
            f"invalid {field}: '*' is allowed only as a leading '*.' label (never alone: a credential "
            "is sent only to hosts named for it)",
            field=field,
        )
    parsed = _gateway_host(text, field)
    if parsed.is_address:
        # The gateway binds credentials to names (it sees them in SNI/Host and checks certificates for
        # them), never to addresses.
        raise errors.InvalidArgument(
            f"invalid {field}: a credential is bound to host names, not addresses ({_quote(value)})",
            field=field,
        )
    if is_public_suffix(parsed.host, icann_only=True):
        raise errors.InvalidArgument(
            f"invalid {field}: {_quote(value)} is a public suffix, not a host (a credential is sent only to "
            "hosts of one owner)",
            field=field,
        )
    return parsed.host


def normalize_hosts(values: object, field: str = "hosts") -> list[str]:
    if not isinstance(values, list | tuple) or not values:
        raise errors.InvalidArgument(f"{field}: at least one host is required", field=field)
    if len(values) > MAX_HOSTS:
        raise errors.InvalidArgument(f"{field}: at most {MAX_HOSTS} hosts", field=field)
    out: list[str] = []
    for i, value in enumerate(values):
        host = normalize_host(value, f"{field}[{i}]")
        if host not in out:
            out.append(host)
    return out


def _judged(network: IPNetwork) -> IPNetwork:
    """`network`, or the IPv4 network an IPv4-carrying IPv6 network (mapped, NAT64) embeds."""
    if isinstance(network, ipaddress.IPv6Network):
        for carrier in _IPV4_CARRIERS:
            if network.subnet_of(carrier):
                offset = int(network.network_address) & 0xFFFFFFFF
                return ipaddress.IPv4Network((offset, network.prefixlen - 96))
    return network


def _special_range(network: IPNetwork) -> tuple[IPNetwork, bool] | None:
    """The special range `network` lies inside, and whether that range can never be reached (loopback,
    link-local, ...) rather than needing approval (private, shared, documentation); None for public. An
    IPv6 network that embeds IPv4 addresses (mapped `::ffff:0:0/96`, NAT64 `64:ff9b::/96`) is judged by
    the IPv4 network it embeds, as the gateway judges its addresses."""
    network = _judged(network)
    for ranges, never in ((ALWAYS_BLOCKED, True), (PRIVATE, False)):
        for special in ranges:
            if network.version == special.version and network.subnet_of(special):  # type: ignore[arg-type]
                return special, never
    return None


def _check_allowed_cidr(entry: str, approved: Sequence[IPNetwork], field: str) -> None:
    network = _judged(ipaddress.ip_network(entry))
    special = _special_range(network)
    if special is None:
        return
    inside, never = special
    if never:
        raise errors.InvalidArgument(
            f"invalid {field}: {entry} is inside {inside}, which a sandbox can never reach", field=field
        )
    if not any(network.version == a.version and network.subnet_of(a) for a in approved):  # type: ignore[arg-type]
        raise errors.InvalidArgument(
            f"invalid {field}: {entry} is inside the private range {inside}; an organization admin must "
            "first allow it for this project (PUT /v1/projects/{project}/private-networks)",
            field=field,
        )


def within_approval(allow: Sequence[str], approved: Sequence[str]) -> list[str]:
    """A stored allow list without the CIDRs its project's approval no longer covers (an org admin narrowed
    it after the policy was written): what a node is handed, so a narrowing takes effect at the next
    hand-out without rewriting stored policies."""
    networks = [ipaddress.ip_network(a) for a in approved]
    kept: list[str] = []
    for entry in allow:
        if "/" in entry:
            try:
                _check_allowed_cidr(entry, networks, "allow")
            except (errors.InvalidArgument, ValueError):
                continue
        kept.append(entry)
    return kept


def normalize_private_networks(values: object, field: str = "allowed_private_networks") -> list[str]:
    """The private networks an org admin opens for a project's allow lists: CIDRs, each inside one of the
    gateway's private ranges (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7, ...); never-reachable
    ranges (loopback, link-local, ...) and public addresses are refused."""
    if not isinstance(values, list | tuple):
        raise errors.InvalidArgument(f"{field}: expected a list of CIDRs", field=field)
    if len(values) > MAX_PRIVATE_NETWORKS:
        raise errors.InvalidArgument(f"{field}: at most {MAX_PRIVATE_NETWORKS} networks", field=field)
    out: list[str] = []
    for i, value in enumerate(values):
        where = f"{field}[{i}]"
        if not isinstance(value, str):
            raise errors.InvalidArgument(f"invalid {where}: expected a CIDR string", field=where)
        try:
            network = ipaddress.ip_network(value.strip(), strict=False)
        except ValueError as exc:
            why = f"invalid {where}: not a CIDR ({_quote(value)})"
            raise errors.InvalidArgument(why, field=where) from exc
        special = _special_range(network)
        if special is None:
            raise errors.InvalidArgument(
                f"invalid {where}: {network} is not inside a private range (public addresses need no "
                "approval)",
                field=where,
            )
        if special[1]:
            raise errors.InvalidArgument(
                f"invalid {where}: {network} is inside {special[0]}, which a sandbox can never reach",
                field=where,
            )
        if str(network) not in out:
            out.append(str(network))
    return out


def normalize_policy(
    allow: Sequence[object],
    deny: Sequence[object],
    field: str = "egress",
    *,
    approved: Sequence[str] = (),
) -> tuple[list[str], list[str]]:
    """allow/deny lists in the gateway's canonical form (EgressPolicy of space.node.egress.policy, which
    is what the node enforces); an invalid entry is named by its index. Allow entries must not span a
    public suffix (`*.com`), and an allow CIDR inside a special range must lie inside one of the
    `approved` private networks of the project (module invariants); deny entries may name anything."""
    approved_networks = [ipaddress.ip_network(a) for a in approved]
    result: list[list[str]] = []
    for kind, values in (("allow", allow), ("deny", deny)):
        if len(values) > MAX_POLICY_ENTRIES:
            raise errors.InvalidArgument(
                f"{field}.{kind}: at most {MAX_POLICY_ENTRIES} entries", field=f"{field}.{kind}"
            )
        entries: list[str] = []
        for i, value in enumerate(values):
            where = f"{field}.{kind}[{i}]"
            if not isinstance(value, str):
                raise errors.InvalidArgument(f"invalid {where}: expected a string", field=where)
            try:
                entry = EgressPolicy(allow=[value]).allow[0]
            except ValidationError as exc:
                why = "; ".join(str(err.get("msg", "invalid")) for err in exc.errors())
                raise errors.InvalidArgument(f"invalid {where}: {why}", field=where) from exc
            if kind == "allow" and entry.startswith("*."):
                _refuse_public_wildcard(entry[2:], value, where)
            elif kind == "allow" and "/" in entry:
                _check_allowed_cidr(entry, approved_networks, where)
            if entry not in entries:
                entries.append(entry)
        result.append(entries)
    return result[0], result[1]


@dataclass(frozen=True, slots=True)
class LoginForm:
    """Where a `login` credential goes (ADR 0063): a form posted to `origin` (https://host[:port]) at
    `form_action` (a path; None: any path of the origin), its values in these two fields."""

    origin: str
    username_field: str
    password_field: str
    form_action: str | None = None

    @property
    def host(self) -> str:
        return _origin_parts(self.origin)[1]

    def to_json(self) -> dict[str, str | None]:
        return {
            "origin": self.origin,
            "username_field": self.username_field,
            "password_field": self.password_field,
            "form_action": self.form_action,
        }


@dataclass(frozen=True, slots=True)
class Injection:
    """How the gateway puts a value into a request to a bound host."""

    method: Method
    header_name: str | None = None
    header_template: str | None = None  # "{value}" is replaced by the value (basic: base64(value))
    query_param: str | None = None
    login: LoginForm | None = None  # method "login" only

    def render(self, value: str) -> tuple[str, str]:
        """(header or query parameter name, what to send) for `value` (used by tests and the gateway)."""
        if self.method == "query":
            assert self.query_param is not None
            return self.query_param, value
        if self.method == "login":
            assert self.login is not None
            return self.login.password_field, value
        assert self.header_name is not None and self.header_template is not None
        if self.method == "basic":
            value = base64.b64encode(value.encode()).decode()
        return self.header_name, self.header_template.replace("{value}", value)


def parse_injection(method: object, header: object = None, query_param: object = None) -> Injection:
    """method "header" needs `header` ("Name: template with {value}"); "bearer" and "basic" fix the
    Authorization header; "query" needs `query_param`. A `header` alone implies method "header"."""
    if method is None:
        method = "header" if header is not None else "query" if query_param is not None else "bearer"
    if method not in METHODS:
        raise errors.InvalidArgument(
            f"invalid method {_quote(method)}: expected one of {list(METHODS)}", field="method"
        )
    if method == "login":
        raise errors.InvalidArgument("method 'login' needs login (origin and field names)", field="login")
    if method != "header" and header is not None:
        raise errors.InvalidArgument(
            f"header is only for method 'header' (method is {method!r})", field="header"
        )
    if method != "query" and query_param is not None:
        raise errors.InvalidArgument(
            f"query_param is only for method 'query' (method is {method!r})", field="query_param"
        )
    if method == "bearer":
        return Injection("bearer", "Authorization", "Bearer {value}")
    if method == "basic":
        return Injection("basic", "Authorization", "Basic {value}")
    if method == "query":
        return _query_injection(query_param)
    return _header_injection(header)


def _query_injection(query_param: object) -> Injection:
    if not isinstance(query_param, str) or QUERY_PARAM_PATTERN.fullmatch(query_param) is None:
        raise errors.InvalidArgument(
            "method 'query' needs query_param (a parameter name)", field="query_param"
        )
    return Injection("query", query_param=query_param)


def _header_injection(header: object) -> Injection:
    if not isinstance(header, str) or ":" not in header:
        raise errors.InvalidArgument(
            "method 'header' needs header, e.g. 'Authorization: Bearer {value}'", field="header"
        )
    name, _, template = header.partition(":")
    name, template = name.strip(), template.strip()
    if HEADER_NAME_PATTERN.fullmatch(name) is None:
        raise errors.InvalidArgument(f"invalid header name {_quote(name)}", field="header")
    if any(ch in template for ch in "\r\n\0") or template.count("{value}") != 1:
        raise errors.InvalidArgument(
            "the header template must contain '{value}' exactly once, on one line", field="header"
        )
    leftover = template.replace("{value}", "")
    if "{" in leftover or "}" in leftover:
        raise errors.InvalidArgument(
            "the header template may contain no placeholder but '{value}'", field="header"
        )
    return Injection("header", name, template)


def _origin_parts(origin: str) -> tuple[str, str, int | None]:
    scheme, _sep, rest = origin.partition("://")
    host, _, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    return scheme, host, int(port) if port else None


def validate_value(value: object, injection: Injection, field: str = "value") -> bytes:
    if not isinstance(value, str) or not value:
        raise errors.InvalidArgument(f"{field} must be a non-empty string", field=field)
    if any(ch in value for ch in "\r\n\0"):
        raise errors.InvalidArgument(
            f"{field} may not contain CR, LF or NUL (it is sent in headers)", field=field
        )
    if injection.method == "login":
        raise errors.InvalidArgument(
            "a login credential's value is given as username and password, not value", field=field
        )
    if injection.method == "basic" and ":" not in value:
        raise errors.InvalidArgument(f"method 'basic' needs {field} as 'user:password'", field=field)
    return value.encode("utf-8")


def validate_rate(value: object, field: str = "rate_per_minute") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_RATE_PER_MINUTE:
        raise errors.InvalidArgument(
            f"{field} must be an integer from 1 to {MAX_RATE_PER_MINUTE}", field=field
        )
    return value


def validate_expiry(value: datetime | None, now: datetime, field: str = "expires_at") -> datetime | None:
    if value is None:
        return None
    if value.tzinfo is None or value.utcoffset() is None:
        raise errors.InvalidArgument(f"{field} needs a time zone (e.g. '...Z')", field=field)
    if value <= now:
        raise errors.InvalidArgument(f"{field} is in the past", field=field)
    return value
