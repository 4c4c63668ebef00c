"""Where an HTTP request wants to go: destination, port and origin-form target, read from its request line
and Host header and checked for consistency under the rules of the listener it came in on. Pure (no I/O).

Invariants:
- At most one Host header; only origin-form (`/...`, `*` for OPTIONS) and absolute http(s) URLs.
- proxy: an absolute http:// URL is required (https goes through CONNECT); a Host header must name the
  URL's host.
- transparent: the Host header names the destination, the port is the one the sandbox dialled; an
  absolute URL must name the same host.
- intercepted: the TLS server name fixed destination and port; Host header and absolute URL must both name
  that host (421 otherwise), so a credential bound to one host cannot be sent to another over its TLS.
- Every host goes through normalize_host; anything it refuses is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass

import h11

from space.core import errors
from space.node.egress.context import Mode
from space.node.egress.http.messages import Refused
from space.node.egress.policy import Destination, normalize_host, split_authority


@dataclass(frozen=True)
class TargetRules:
    """The listener's rules for reading a request's destination."""

    mode: Mode
    fixed: tuple[Destination, int] | None = None  # intercepted: the TLS server name and port
    default_port: int = 80  # transparent: the port the sandbox dialled


@dataclass(frozen=True)
class RequestTarget:
    destination: Destination
    port: int
    origin: bytes  # the target in origin form, as sent upstream


@dataclass(frozen=True)
class _Parsed:
    origin: str
    absolute: tuple[str, str] | None  # (scheme, authority) of an absolute-form target
    host_header: str | None


def request_target(request: h11.Request, rules: TargetRules) -> RequestTarget:
    """The request's destination under `rules`; raises Refused for an inconsistent or malformed request."""
    parsed = _parse(request)
    try:
        if rules.mode == "proxy":
            return _proxied(parsed)
        if parsed.host_header is None:
            raise Refused(400, "missing Host header")
        if rules.mode == "transparent":
            return _transparent(parsed, parsed.host_header, rules.default_port)
        assert rules.fixed is not None
        return _intercepted(parsed, parsed.host_header, rules.fixed)
    except errors.InvalidArgument as exc:
        raise Refused(400, exc.message) from exc


def _parse(request: h11.Request) -> _Parsed:
    raw_target = request.target.decode("latin-1")
    hosts = [v.decode("latin-1") for n, v in request.headers if n == b"host"]
    if len(hosts) > 1:
        raise Refused(400, "more than one Host header")
    host_header = hosts[0] if hosts else None
    lowered = raw_target.lower()
    if lowered.startswith("http://") or lowered.startswith("https://"):
        scheme, authority, origin = _split_absolute(raw_target)
        return _Parsed(origin, (scheme, authority), host_header)
    if raw_target.startswith("/") or (raw_target == "*" and request.method == b"OPTIONS"):
        return _Parsed(raw_target, None, host_header)
    raise Refused(400, "unsupported request target form")


def _split_absolute(raw_target: str) -> tuple[str, str, str]:
    """(lower-case scheme, authority, origin-form rest) of an absolute URL."""
    scheme, rest = raw_target.split("://", 1)
    cut = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
    authority, path = rest[:cut], rest[cut:] or "/"
    if path.startswith("?"):
        path = "/" + path
    return scheme.lower(), authority, path


def _host_of(authority: str, default_port: int) -> Destination:
    return normalize_host(split_authority(authority, default_port)[0])


def _proxied(parsed: _Parsed) -> RequestTarget:
    if parsed.absolute is None:
        raise Refused(400, "a proxy request needs an absolute http:// URL")
    scheme, authority = parsed.absolute
    if scheme != "http":
        raise Refused(400, "use CONNECT for https through the proxy")
    raw_host, port = split_authority(authority, 80)
    destination = normalize_host(raw_host)
    if parsed.host_header is not None and _host_of(parsed.host_header, port) != destination:
        raise Refused(400, "Host header does not match the request URL")
    return RequestTarget(destination, port, parsed.origin.encode("latin-1"))


def _transparent(parsed: _Parsed, host_header: str, port: int) -> RequestTarget:
    destination = _host_of(host_header, port)
    if parsed.absolute is not None and _host_of(parsed.absolute[1], port) != destination:
        raise Refused(400, "Host header does not match the request URL")
    return RequestTarget(destination, port, parsed.origin.encode("latin-1"))


def _intercepted(parsed: _Parsed, host_header: str, fixed: tuple[Destination, int]) -> RequestTarget:
    destination, port = fixed
    if _host_of(host_header, port) != destination:
        raise Refused(421, "Host header does not match the TLS server name")
    if parsed.absolute is not None and _host_of(parsed.absolute[1], port) != destination:
        raise Refused(421, "request URL does not match the TLS server name")
    return RequestTarget(destination, port, parsed.origin.encode("latin-1"))
