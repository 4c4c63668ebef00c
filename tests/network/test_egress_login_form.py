"""Login-form parsing and substitution (space.node.egress.http.form) and the `login` credential's rules
(pure logic; the gateway for real is in test_egress_login.py)."""

from __future__ import annotations

from urllib.parse import parse_qs, quote_plus

import pytest
from pydantic import ValidationError

from space.node.egress.credentials import Credential, RateLimiter, substitute
from space.node.egress.http.form import form_type, substitute_form

UPH, PPH = "space-user-site-aaaaaaaaaaaaaaaa", "space-cred-site-aaaaaaaaaaaaaaaa"
WANTED = {"user": (UPH, "alice"), "pass": (PPH, "p&w=d +é")}
URLENCODED = b"application/x-www-form-urlencoded"


def login(**kw: object) -> Credential:
    base: dict[str, object] = {
        "name": "site", "value": "hunter2-secret", "username": "alice", "hosts": ["login.example.com"],
        "method": "login", "origin": "https://login.example.com", "username_field": "user",
        "password_field": "pass", "placeholder": PPH,
    }  # fmt: skip
    base.update(kw)
    return Credential.model_validate(base)


def test_urlencoded_fields_are_replaced_and_re_encoded_the_rest_kept_byte_for_byte() -> None:
    body = f"csrf=a%2Fb+c&user={UPH}&pass={PPH}&x".encode()
    result = substitute_form(body, URLENCODED + b"; charset=UTF-8", WANTED)
    assert result.replaced == {"user", "pass"} and not result.misplaced
    assert result.body == b"csrf=a%2Fb+c&user=alice&pass=" + quote_plus("p&w=d +é").encode() + b"&x"
    assert parse_qs(result.body.decode())["pass"] == ["p&w=d +é"]


@pytest.mark.parametrize(
    "body",
    [
        f"other={PPH}",  # another field
        f"pass=x{PPH}",  # part of a value
        f"pass={PPH}x",
        f"user={PPH}",  # the password's placeholder in the username field
        f"pass={UPH}",
        f"pass%00={PPH}",
    ],
)
def test_a_placeholder_anywhere_but_its_own_field_is_kept_and_reported(body: str) -> None:
    result = substitute_form(body.encode(), URLENCODED, WANTED)
    assert result.body == body.encode()
    assert result.replaced == set() and result.misplaced


@pytest.mark.parametrize("content_type", [None, b"text/plain", b"application/json", b"multipart/form-data"])
def test_other_bodies_are_never_changed(content_type: bytes | None) -> None:
    body = f"pass={PPH}".encode()
    assert substitute_form(body, content_type, WANTED).body == body
    assert form_type(content_type) is None


def test_multipart_field_replaced_file_and_headers_kept() -> None:
    boundary = b"XyZ"
    parts = [
        (b'Content-Disposition: form-data; name="user"', UPH.encode()),
        (b'Content-Disposition: form-data; name="pass"; filename="p.txt"', PPH.encode()),
        (b'Content-Disposition: form-data; name="pass"', PPH.encode()),
    ]
    body = b"".join(b"--XyZ\r\n" + h + b"\r\n\r\n" + c + b"\r\n" for h, c in parts) + b"--XyZ--\r\n"
    result = substitute_form(body, b'multipart/form-data; boundary="XyZ"', WANTED)
    assert result.replaced == {"user", "pass"}
    assert result.misplaced  # the file part
    expected = body.replace(b"\r\n\r\n" + UPH.encode(), b"\r\n\r\nalice")
    expected = expected.replace(
        b'name="pass"\r\n\r\n' + PPH.encode(), b'name="pass"\r\n\r\n' + "p&w=d +é".encode()
    )
    assert result.body == expected
    assert form_type(b"multipart/form-data; boundary=" + boundary) == (b"multipart/form-data", boundary)


def test_a_value_holding_the_boundary_is_not_written_into_multipart() -> None:
    body = b'--B\r\nContent-Disposition: form-data; name="pass"\r\n\r\n' + PPH.encode() + b"\r\n--B--\r\n"
    result = substitute_form(body, b"multipart/form-data; boundary=B", {"pass": (PPH, "a\r\n--B--x")})
    assert result.body == body and not result.replaced


def test_login_credential_rules() -> None:
    credential = login()
    assert credential.username_placeholder == UPH
    assert credential.login_matches("https", "login.example.com", 443, "/anything")
    assert not credential.login_matches("http", "login.example.com", 443, "/")
    assert not credential.login_matches("https", "login.example.com", 8443, "/")
    assert not credential.login_matches("https", "other.example.com", 443, "/")
    action = login(origin="https://login.example.com:8443", form_action="/session")
    assert action.login_matches("https", "login.example.com", 8443, "/session")
    assert not action.login_matches("https", "login.example.com", 8443, "/session/x")
    assert "alice" not in repr(credential) and "hunter2" not in repr(credential)
    assert {b"alice", b"hunter2-secret"} <= set(credential.secret_forms())
    quoted = login(value='pw<"&>\u00e9').secret_forms()  # as a login page may echo it
    assert {b"pw&lt;&quot;&amp;&gt;\xc3\xa9", b'pw<\\"&>\\u00e9', b"pw%3C%22%26%3E%C3%A9"} <= set(quoted)
    for bad in (
        {"origin": None},
        {"username": None},
        {"password_field": "user"},
        {"hosts": ["other.example.com"]},
        {"origin": "https://login.example.com/path"},
        {"origin": "ftp://login.example.com"},
        {"origin": "https://u:p@login.example.com"},
        {"form_action": "session"},
    ):
        with pytest.raises(ValidationError):
            login(**bad)


def test_a_login_placeholder_in_the_head_is_never_injected() -> None:
    credential = login()
    headers = [(b"authorization", f"Bearer {PPH}".encode()), (b"x-user", UPH.encode())]
    result = substitute([credential], "login.example.com", headers, b"/?pass=" + PPH.encode(), RateLimiter())
    assert result.headers == headers and result.target == b"/?pass=" + PPH.encode()
    assert result.misplaced == [credential] and not result.injected
    other = substitute([credential], "other.example.com", headers, b"/", RateLimiter())
    assert other.unbound == [credential]
