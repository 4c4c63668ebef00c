"""Credentials as the egress gateway sees them, placeholder substitution, rate limits and scrubbing.

Invariants:
- A sandbox only ever holds a placeholder (`space-cred-<name>-<random>`). The real value is written into a
  request only when the request goes to a host bound to that credential, only at the place the credential's
  method names (Authorization bearer/basic, one named header, one query parameter), only while the credential
  is unexpired and under its rate limit, and (unless the credential allows plain text) only over TLS.
  A `login` credential (ADR 0063) is written only into the named fields of a form submission (the request
  body) to its one origin (scheme, host, port), never into headers or the target (http.substitute, http.form).
  Everything else (placeholder to an unbound host, in the body, in
  another header) is forwarded unchanged and audited.
- The value never flows back: responses from hosts a credential is bound to are scrubbed of every form of
  every value the gateway may have injected (raw, percent-encoded, basic-auth base64), replaced by a mask of
  the same length so message framing (Content-Length) is unchanged.
"""

from __future__ import annotations

import base64
import html
import json
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, Protocol
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from space.node.egress.policy import _parse_entry, name_matches

Method = Literal["header", "bearer", "basic", "query", "login"]
PLACEHOLDER_PREFIX = "space-cred-"
USERNAME_PLACEHOLDER_PREFIX = "space-user-"


def username_placeholder(placeholder: str) -> str:
    """A login credential's username placeholder, from its (password) placeholder: the same random tail
    under another prefix, so neither placeholder contains the other."""
    if placeholder.startswith(PLACEHOLDER_PREFIX):
        return USERNAME_PLACEHOLDER_PREFIX + placeholder[len(PLACEHOLDER_PREFIX) :]
    return USERNAME_PLACEHOLDER_PREFIX + placeholder


def parse_origin(origin: str) -> tuple[str, str, int]:
    """(scheme, normalized host, port) of `scheme://host[:port]` (no path, query, user info)."""
    parts = urlsplit(origin)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.username or parts.password:
        raise ValueError(f"origin must be scheme://host[:port], got {origin!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"origin must not have a path, query or fragment, got {origin!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, _parse_entry(parts.hostname), port


def make_placeholder(name: str) -> str:
    """A fresh placeholder for credential `name` (what the sandbox sees instead of the value)."""
    safe = "".join(c if c.isalnum() or c in "_-" else "-" for c in name.lower())[:40]
    return f"{PLACEHOLDER_PREFIX}{safe}-{secrets.token_hex(12)}"


class Credential(BaseModel):
    """One credential the gateway may inject for a sandbox. `value` never leaves the node's gateway."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1, max_length=200)
    value: str = Field(min_length=1, repr=False)
    hosts: list[str] = Field(min_length=1)
    method: Method = "bearer"
    header_name: str = "Authorization"
    header_template: str = "Bearer {value}"
    query_param: str | None = None
    expires_at: datetime | None = None
    placeholder: str = ""
    rate_per_minute: float | None = None
    # Inject also into unencrypted HTTP requests (the value would cross the network in clear text).
    allow_plaintext: bool = False
    # Identity for rate limits and audit (a control-plane id); defaults to the name.
    id: str = ""
    # method "login" (ADR 0063): `value` is the password, `username` the user name; both are written only
    # into the fields `username_field` / `password_field` of a form posted to `origin` (at `form_action`,
    # a path, when set).
    origin: str | None = None
    username: str | None = Field(default=None, repr=False)
    username_field: str | None = None
    password_field: str | None = None
    form_action: str | None = None

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        out = [_parse_entry(h) for h in hosts]
        if any("/" in h for h in out):
            raise ValueError("credential hosts are names or *.wildcards, not CIDRs")
        if "*" in out:
            raise ValueError("a credential cannot be bound to every host")
        return out

    @model_validator(mode="after")
    def _complete(self) -> Credential:
        if not self.placeholder:
            object.__setattr__(self, "placeholder", make_placeholder(self.name))
        if not self.id:
            object.__setattr__(self, "id", self.name)
        if len(self.placeholder) < 16:
            raise ValueError("placeholder too short (at least 16 characters, so it cannot occur by chance)")
        if self.placeholder in self.value or self.value in self.placeholder:
            raise ValueError("placeholder and value must not contain each other")
        if self.method == "query" and not self.query_param:
            raise ValueError("method 'query' needs query_param")
        if self.method == "header" and "{value}" not in self.header_template:
            raise ValueError("header_template must contain {value}")
        if self.rate_per_minute is not None and self.rate_per_minute <= 0:
            raise ValueError("rate_per_minute must be positive")
        if self.method == "login":
            self._check_login()
        return self

    def _check_login(self) -> None:
        if not (self.origin and self.username and self.username_field and self.password_field):
            raise ValueError("method 'login' needs origin, username, username_field and password_field")
        _scheme, host, _port = parse_origin(self.origin)
        if self.hosts != [host]:
            raise ValueError("a login credential's hosts are exactly its origin's host")
        if self.username_field == self.password_field:
            raise ValueError("username_field and password_field must differ")
        if self.form_action is not None and not self.form_action.startswith("/"):
            raise ValueError("form_action is a path starting with '/'")
        user_ph = self.username_placeholder
        if user_ph in self.username or self.username in user_ph or user_ph in self.value:
            raise ValueError("placeholder and value must not contain each other")

    @property
    def username_placeholder(self) -> str:
        return username_placeholder(self.placeholder)

    def placeholders(self) -> list[str]:
        """The placeholders a sandbox holds for this credential (a login has one per field)."""
        if self.method == "login":
            return [self.placeholder, self.username_placeholder]
        return [self.placeholder]

    def login_matches(self, scheme: str, host: str, port: int, path: str) -> bool:
        """Is a request to scheme://host:port/path a submission to this login credential's form?"""
        if self.method != "login" or self.origin is None:
            return False
        if parse_origin(self.origin) != (scheme, host, port):
            return False
        return self.form_action is None or path == self.form_action

    def login_fields(self) -> dict[str, tuple[str, str]]:
        """field name -> (placeholder, value) of a login credential."""
        assert self.username_field and self.password_field and self.username is not None
        return {
            self.username_field: (self.username_placeholder, self.username),
            self.password_field: (self.placeholder, self.value),
        }

    def binds(self, host: str) -> bool:
        """Is `host` (normalized) one this credential may be sent to?"""
        return name_matches(host, self.hosts)

    def expired(self, now: datetime | None = None) -> bool:
        if self.expires_at is None:
            return False
        expires = self.expires_at if self.expires_at.tzinfo else self.expires_at.replace(tzinfo=UTC)
        return (now or datetime.now(UTC)) >= expires

    def secret_forms(self) -> list[bytes]:
        """Every spelling of the value the gateway could inject (for scrubbing responses)."""
        values = [self.value] + ([self.username] if self.method == "login" and self.username else [])
        forms: set[str] = set()
        for value in values:
            forms |= {value, quote(value, safe=""), quote(value, safe="/"), quote_plus(value)}
            if self.method == "login":  # a login page may echo a submitted field into HTML or JSON
                forms |= {html.escape(value), json.dumps(value)[1:-1]}
        if self.method == "basic" and ":" in self.value:
            forms.add(base64.b64encode(self.value.encode()).decode())
        if self.method == "header":
            forms.add(self.header_template.replace("{value}", self.value))
        return [f.encode() for f in forms if f]


class CredentialSource(Protocol):
    async def credentials(self, sandbox_id: str) -> list[Credential]: ...


class StaticCredentials:
    """A fixed map sandbox id -> credentials (tests, benchmarks, single-node demos)."""

    def __init__(self, by_sandbox: dict[str, list[Credential]] | None = None) -> None:
        self.by_sandbox: dict[str, list[Credential]] = dict(by_sandbox or {})

    async def credentials(self, sandbox_id: str) -> list[Credential]:
        return list(self.by_sandbox.get(sandbox_id, []))


class TokenBucket:
    """`rate_per_minute` uses per minute, bursts up to the same number."""

    def __init__(self, rate_per_minute: float) -> None:
        self.capacity = float(rate_per_minute)
        self.tokens = float(rate_per_minute)
        self.per_second = rate_per_minute / 60.0
        self.updated = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.per_second)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class RateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[tuple[str, float], TokenBucket] = {}

    def allow(self, credential: Credential) -> bool:
        if credential.rate_per_minute is None:
            return True
        key = (credential.id, credential.rate_per_minute)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(credential.rate_per_minute)
        return bucket.take()


Header = tuple[bytes, bytes]


@dataclass
class Substitution:
    """Outcome of applying one sandbox's credentials to one request."""

    headers: list[Header]
    target: bytes
    injected: list[Credential] = field(default_factory=list)
    unbound: list[Credential] = field(default_factory=list)  # placeholder seen, host not bound
    misplaced: list[Credential] = field(default_factory=list)  # bound host, placeholder not where method says
    plaintext: list[Credential] = field(default_factory=list)  # bound host, but the request is not encrypted
    refused: tuple[int, str, Credential] | None = None  # (status, reason) answered by the gateway


def _basic_decoded(value: bytes) -> bytes:
    scheme, _, blob = value.partition(b" ")
    if scheme.lower() != b"basic":
        return b""
    try:
        return base64.b64decode(blob.strip(), validate=True)
    except ValueError:
        return b""


def _contains(headers: Sequence[Header], target: bytes, needle: bytes) -> bool:
    if needle in target:
        return True
    for name, value in headers:
        if needle in value:
            return True
        if name.lower() == b"authorization" and needle in _basic_decoded(value):
            return True
    return False


def _replace_query(target: bytes, param: str, placeholder: str, value: str) -> tuple[bytes, bool]:
    text = target.decode("latin-1")
    path, sep, query = text.partition("?")
    if not sep:
        return target, False
    query, hash_sep, fragment = query.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    changed = False
    out: list[tuple[str, str]] = []
    for key, val in pairs:
        if key == param and val == placeholder:
            out.append((key, value))
            changed = True
        else:
            out.append((key, val))
    if not changed:
        return target, False
    rebuilt = path + "?" + urlencode(out, quote_via=quote) + (hash_sep + fragment if hash_sep else "")
    return rebuilt.encode("latin-1"), True


def _inject(credential: Credential, headers: list[Header], target: bytes) -> tuple[list[Header], bytes, bool]:
    placeholder = credential.placeholder
    ph = placeholder.encode()
    if credential.method == "query":
        assert credential.query_param is not None
        target, done = _replace_query(target, credential.query_param, placeholder, credential.value)
        return headers, target, done
    wanted = b"authorization" if credential.method in ("bearer", "basic") else credential.header_name.lower()
    wanted = wanted.encode() if isinstance(wanted, str) else wanted
    out: list[Header] = []
    done = False
    for name, value in headers:
        if name.lower() != wanted:
            out.append((name, value))
            continue
        if credential.method == "basic":
            scheme, _, blob = value.partition(b" ")
            if scheme.lower() == b"basic":
                try:
                    decoded = base64.b64decode(blob.strip(), validate=True).decode("utf-8")
                except (ValueError, UnicodeDecodeError):
                    decoded = ""
                if placeholder in decoded:
                    new = decoded.replace(placeholder, credential.value)
                    out.append((name, b"Basic " + base64.b64encode(new.encode())))
                    done = True
                    continue
            if ph in value and b":" not in value:
                out.append((name, b"Basic " + base64.b64encode(credential.value.encode())))
                done = True
                continue
        elif ph in value:
            if credential.method == "bearer":
                out.append((name, b"Bearer " + credential.value.encode()))
            else:
                rendered = credential.header_template.replace("{value}", credential.value)
                out.append((name, rendered.encode()))
            done = True
            continue
        out.append((name, value))
    return out, target, done


def substitute(
    credentials: Iterable[Credential],
    host: str,
    headers: list[Header],
    target: bytes,
    limiter: RateLimiter,
    *,
    encrypted: bool = True,
    now: datetime | None = None,
) -> Substitution:
    """Apply every credential whose placeholder the request carries (headers or target). `encrypted`: the
    request will travel over TLS to the upstream (else only credentials with allow_plaintext apply)."""
    result = Substitution(headers=list(headers), target=target)
    for credential in credentials:
        if not any(_contains(result.headers, result.target, p.encode()) for p in credential.placeholders()):
            continue
        if not credential.binds(host):
            result.unbound.append(credential)
            continue
        if credential.method == "login":  # a login goes only into a form body, never into the head
            result.misplaced.append(credential)
            continue
        if not encrypted and not credential.allow_plaintext:
            result.plaintext.append(credential)
            continue
        if credential.expired(now):
            result.refused = (403, f"credential {credential.name!r} has expired", credential)
            return result
        if not limiter.allow(credential):
            result.refused = (429, f"credential {credential.name!r} is over its rate limit", credential)
            return result
        new_headers, new_target, done = _inject(credential, result.headers, result.target)
        if done:
            result.headers, result.target = new_headers, new_target
            result.injected.append(credential)
        else:
            result.misplaced.append(credential)
    return result


class Scrubber:
    """Streaming replacement of secret byte strings by same-length masks (framing stays valid)."""

    def __init__(self, secrets_: Iterable[bytes]) -> None:
        self.secrets = sorted({s for s in secrets_ if s}, key=len, reverse=True)
        self.keep = max((len(s) for s in self.secrets), default=1) - 1
        self._tail = b""

    @property
    def active(self) -> bool:
        return bool(self.secrets)

    def scrub(self, data: bytes) -> bytes:
        """Whole-value scrub (headers)."""
        for secret in self.secrets:
            if secret in data:
                data = data.replace(secret, b"*" * len(secret))
        return data

    def feed(self, chunk: bytes) -> bytes:
        if not self.secrets:
            return chunk
        buffer = self.scrub(self._tail + chunk)
        if self.keep == 0:
            self._tail = b""
            return buffer
        self._tail = buffer[-self.keep :] if len(buffer) > self.keep else buffer
        return buffer[: len(buffer) - len(self._tail)]

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail
