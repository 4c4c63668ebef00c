"""Stage 2 of an HTTP exchange, substitute: credential placeholders in the request replaced by their values,
under the credential rules of space.node.egress.credentials (the only place values are written).

Invariants:
- A value is written only for a host the credential is bound to, only where its method says, only over TLS
  (unless the credential allows plain text), only while unexpired and under its rate limit; every other
  placeholder is forwarded unchanged and its outcome audited (unbound host, plain text, misplaced).
- An expired or rate-limited credential refuses the whole request (403 / 429), audited.
- The result names every spelling of every value that may now be in the request (`secret_forms`), so the
  scrub stage can remove them from the response; it is empty when no credential is bound to the host.
- The request body is never looked at (a placeholder there is forwarded as is), except a POST to the origin
  (scheme, host, port, and form action path when set) of a `login` credential (ADR 0063): its body, read
  whole when it is at most MAX_FORM_BODY bytes, gets the username and password written into the bound form
  fields only (http.form), under the same expiry and rate rules, audited `injected`; a bigger body is
  forwarded unchanged and audited `not_replaced_oversized`, a placeholder elsewhere in it
  `not_replaced_misplaced`. A login credential is never written into headers or the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from space.node.egress.credentials import Credential, RateLimiter, Substitution, substitute
from space.node.egress.http.decide import Route
from space.node.egress.http.form import MAX_FORM_BODY, substitute_form
from space.node.egress.http.messages import Header, Refused

__all__ = ["MAX_FORM_BODY", "login_credentials", "substitute_credentials", "substitute_login_body"]

#: GatewayContext.audit's signature: (event, sandbox_id, host, decision, credential_name)
CredentialAudit = Callable[[str, str, str, str, str], None]


@dataclass(frozen=True)
class Substituted:
    """The request's head with credential values in place, and what the response must be scrubbed of."""

    headers: list[Header]
    target: bytes
    bound: bool  # a credential of the sandbox is bound to the destination host (the response is scrubbed)
    secret_forms: frozenset[bytes]


def substitute_credentials(
    credentials: Sequence[Credential],
    route: Route,
    headers: list[Header],
    *,
    limiter: RateLimiter,
    encrypted: bool,
    audit: CredentialAudit,
) -> Substituted:
    """Apply the sandbox's `credentials` to a request's `headers` and target (`route.target`). `encrypted`:
    the request travels over TLS upstream. Raises Refused for an expired or rate-limited credential."""
    host = route.destination.host
    result = substitute(credentials, host, headers, route.target, limiter, encrypted=encrypted)
    _audit_outcome(result, route, audit)
    bound = [c for c in credentials if c.binds(host)]
    forms = secret_forms(bound, headers, result.headers) if bound else frozenset()
    return Substituted(result.headers, result.target, bool(bound), forms)


def _audit_outcome(result: Substitution, route: Route, audit: CredentialAudit) -> None:
    host = route.destination.host
    not_replaced = (
        ("not_replaced_unbound_host", result.unbound),
        ("not_replaced_plaintext", result.plaintext),
        ("not_replaced_misplaced", result.misplaced),
    )
    for outcome, found in not_replaced:
        for credential in found:
            audit("credential", route.sandbox_id, host, outcome, credential.name)
    if result.refused is not None:
        status, reason, credential = result.refused
        decision = "rate_limited" if status == 429 else "expired"
        audit("credential", route.sandbox_id, host, decision, credential.name)
        raise Refused(status, reason)
    for credential in result.injected:
        audit("credential", route.sandbox_id, host, "injected", credential.name)


def secret_forms(
    bound: Sequence[Credential], before: Sequence[Header], after: Sequence[Header]
) -> frozenset[bytes]:
    """Every spelling of a value the bound credentials may have put into the request: their secret forms,
    and each header value substitution wrote (whole, and without its auth scheme)."""
    forms: set[bytes] = set()
    for credential in bound:
        forms.update(credential.secret_forms())
    old = set(before)
    for header in after:
        if header not in old:
            forms.add(header[1])
            _scheme, _, blob = header[1].partition(b" ")
            if blob:
                forms.add(blob)
    # A value injected into the target is quote(value, safe=""), one of secret_forms(): the whole target is
    # not added, or a keep-alive connection would grow the scrub set (and the scrub work) per request.
    return frozenset(forms)


def login_credentials(
    credentials: Sequence[Credential], route: Route, *, method: bytes, encrypted: bool
) -> list[Credential]:
    """The sandbox's login credentials whose form this request may be submitting (POST to the origin)."""
    if method.upper() != b"POST":
        return []
    scheme = "https" if encrypted else "http"
    path = route.target.partition(b"?")[0].decode("latin-1")
    host = route.destination.host
    return [c for c in credentials if c.login_matches(scheme, host, route.port, path)]


def substitute_login_body(
    logins: Sequence[Credential],
    route: Route,
    body: bytes | None,
    content_type: bytes | None,
    *,
    limiter: RateLimiter,
    audit: CredentialAudit,
) -> bytes | None:
    """The form `body` (None: it was over MAX_FORM_BODY and streams through unchanged) with the `logins`'
    placeholders in their fields replaced by the values. Raises Refused (audited) for an expired or
    rate-limited credential whose placeholder the form carries."""
    host = route.destination.host
    if body is None:
        for credential in logins:
            audit("credential", route.sandbox_id, host, "not_replaced_oversized", credential.name)
        return None
    for credential in logins:
        result = substitute_form(body, content_type, credential.login_fields())
        if result.misplaced:
            audit("credential", route.sandbox_id, host, "not_replaced_misplaced", credential.name)
        if not result.replaced:
            continue
        if credential.expired():
            audit("credential", route.sandbox_id, host, "expired", credential.name)
            raise Refused(403, f"credential {credential.name!r} has expired")
        if not limiter.allow(credential):
            audit("credential", route.sandbox_id, host, "rate_limited", credential.name)
            raise Refused(429, f"credential {credential.name!r} is over its rate limit")
        body = result.body
        audit("credential", route.sandbox_id, host, "injected", credential.name)
    return body
