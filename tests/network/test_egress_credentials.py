"""Credential substitution, rate limiting and response scrubbing (pure logic)."""

from __future__ import annotations

import base64
import random
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from space.node.egress.credentials import Credential, RateLimiter, Scrubber, make_placeholder, substitute

SECRET = "s3cr3t-value-0123456789"


def cred(**kw: object) -> Credential:
    base: dict[str, object] = {"name": "gh", "value": SECRET, "hosts": ["api.example.com", "*.corp.example"]}
    base.update(kw)
    return Credential.model_validate(base)


def test_placeholder_shape() -> None:
    placeholder = make_placeholder("GitHub Token")
    assert placeholder.startswith("space-cred-github-token-") and len(placeholder) > 30
    assert make_placeholder("x") != make_placeholder("x")
    assert SECRET not in repr(cred())


def test_bearer_injected_only_for_bound_hosts() -> None:
    c = cred()
    headers = [(b"authorization", f"Bearer {c.placeholder}".encode())]
    done = substitute([c], "api.example.com", headers, b"/", RateLimiter())
    assert done.headers == [(b"authorization", f"Bearer {SECRET}".encode())]
    assert done.injected == [c]
    sub = substitute([c], "x.corp.example", headers, b"/", RateLimiter())
    assert sub.injected == [c]
    other = substitute([c], "evil.example", headers, b"/", RateLimiter())
    assert other.headers == headers and other.unbound == [c] and not other.injected
    suffix_trick = substitute([c], "api.example.com.evil.example", headers, b"/", RateLimiter())
    assert suffix_trick.unbound == [c]


def test_header_query_basic_methods() -> None:
    header = cred(name="k", method="header", header_name="X-Api-Key", header_template="key={value}")
    done = substitute(
        [header], "api.example.com", [(b"x-api-key", header.placeholder.encode())], b"/", RateLimiter()
    )
    assert done.headers == [(b"x-api-key", f"key={SECRET}".encode())]

    query = cred(name="q", method="query", query_param="token")
    target = f"/v1/x?a=1&token={query.placeholder}&b=2".encode()
    done = substitute([query], "api.example.com", [], target, RateLimiter())
    assert done.target == f"/v1/x?a=1&token={SECRET}&b=2".encode()
    wrong_param = substitute(
        [query], "api.example.com", [], f"/x?other={query.placeholder}".encode(), RateLimiter()
    )
    assert wrong_param.misplaced == [query] and query.placeholder.encode() in wrong_param.target

    basic = cred(name="b", method="basic")
    blob = base64.b64encode(f"alice:{basic.placeholder}".encode())
    done = substitute([basic], "api.example.com", [(b"authorization", b"Basic " + blob)], b"/", RateLimiter())
    scheme, encoded = done.headers[0][1].split(b" ")
    assert scheme == b"Basic" and base64.b64decode(encoded) == f"alice:{SECRET}".encode()


def test_placeholder_in_wrong_header_is_not_replaced() -> None:
    c = cred()
    headers = [(b"x-forwarded", c.placeholder.encode())]
    done = substitute([c], "api.example.com", headers, b"/", RateLimiter())
    assert done.headers == headers and done.misplaced == [c]


def test_expiry_and_rate_limit() -> None:
    old = cred(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    done = substitute(
        [old], "api.example.com", [(b"authorization", old.placeholder.encode())], b"/", RateLimiter()
    )
    assert done.refused is not None and done.refused[0] == 403
    limited = cred(rate_per_minute=2)
    limiter = RateLimiter()
    statuses = []
    for _ in range(4):
        r = substitute(
            [limited], "api.example.com", [(b"authorization", limited.placeholder.encode())], b"/", limiter
        )
        statuses.append(r.refused[0] if r.refused else 200)
    assert statuses == [200, 200, 429, 429]


@pytest.mark.parametrize(
    "fields",
    [
        {"hosts": []},
        {"hosts": ["10.0.0.0/8"]},
        {"hosts": ["*"]},
        {"method": "query"},
        {"method": "header", "header_template": "no placeholder"},
        {"placeholder": "short"},
        {"placeholder": "x" + SECRET + "x"},
        {"rate_per_minute": 0},
    ],
)
def test_invalid_credentials(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        cred(**fields)


def test_scrubber_masks_secrets_across_chunk_boundaries() -> None:
    secret = SECRET.encode()
    body = b"".join(random.choice([b"abc", secret, b"\n", secret[:5]]) for _ in range(2000))
    for size in (1, 3, 7, 64, 1000):
        scrubber = Scrubber([secret, b"other-secret"])
        out = (
            b"".join(scrubber.feed(body[i : i + size]) for i in range(0, len(body), size)) + scrubber.flush()
        )
        assert len(out) == len(body)
        assert secret not in out
        assert out == body.replace(secret, b"*" * len(secret))
