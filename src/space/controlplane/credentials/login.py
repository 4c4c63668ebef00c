"""Login credentials (ADR 0063): validation of a `login` credential's origin and form, and its vault value
(no I/O).

Invariants:
- An origin is `https://host[:port]` (never http: the values would cross the network in clear), its host a
  name accepted by the same rules as every credential host (spec.normalize_host: no address, wildcard or
  public suffix), stored canonical (`:443` dropped) so the gateway compares parsed origins.
- The vault value is one JSON object {"username", "password"}; both are given together.
- The username's placeholder is derived from the credential's placeholder by the gateway's own function,
  so both sides agree on it.
"""

from __future__ import annotations

import json
import re
from typing import Final

from space.controlplane.credentials.spec import Injection, LoginForm, _quote, normalize_host
from space.core import errors
from space.node.egress.credentials import username_placeholder

# A login form's field name: what HTML allows in practice, minus controls and the form encodings' separators.
FORM_FIELD_PATTERN: Final = re.compile(r"[^\x00-\x1f\x7f&=\"%+;\\]{1,128}")
FORM_ACTION_PATTERN: Final = re.compile(r"/[A-Za-z0-9._~!$'()*+,;=:@/%-]{0,1023}")
MAX_LOGIN_PART: Final = 4096


def parse_login(
    origin: object, username_field: object, password_field: object, form_action: object = None
) -> Injection:
    """A `login` injection (ADR 0063): `origin` is https://host[:port] (a host name as for other
    credentials, never an address; no path, user info, query), the two field names differ, and
    `form_action` (optional) is an absolute path. Stored as the canonical `https://host[:port]`."""
    if not isinstance(origin, str) or not origin.startswith("https://"):
        raise errors.InvalidArgument(
            "login.origin must be https://host[:port] (a login's values never cross the network in clear)",
            field="login.origin",
        )
    rest = origin[len("https://") :].rstrip("/")
    if not rest or any(ch in rest for ch in "/?#@[]"):
        raise errors.InvalidArgument(
            "invalid login.origin: https://host[:port] without path, query or user info, got "
            + _quote(origin),
            field="login.origin",
        )
    host_text, _, port_text = rest.partition(":")
    host = normalize_host(host_text, "login.origin")
    if host.startswith("*."):
        raise errors.InvalidArgument("login.origin names one host, not a wildcard", field="login.origin")
    port: int | None = None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise errors.InvalidArgument(
                f"invalid login.origin port {_quote(port_text)}", field="login.origin"
            )
        port = int(port_text)
    canonical = f"https://{host}" + (f":{port}" if port not in (None, 443) else "")
    names: list[str] = []
    for value, where in ((username_field, "login.username_field"), (password_field, "login.password_field")):
        if not isinstance(value, str) or FORM_FIELD_PATTERN.fullmatch(value) is None:
            raise errors.InvalidArgument(
                f"invalid {where}: a form field name, got {_quote(value)}", field=where
            )
        names.append(value)
    if names[0] == names[1]:
        raise errors.InvalidArgument(
            "login.username_field and login.password_field must differ", field="login"
        )
    if form_action is not None and (
        not isinstance(form_action, str) or FORM_ACTION_PATTERN.fullmatch(form_action) is None
    ):
        raise errors.InvalidArgument(
            f"invalid login.form_action: an absolute path such as '/session', got {_quote(form_action)}",
            field="login.form_action",
        )
    return Injection("login", login=LoginForm(canonical, names[0], names[1], form_action))


def login_value(username: object, password: object) -> bytes:
    """What the vault holds for a login credential: its username and password as one JSON object."""
    parts: dict[str, str] = {}
    for value, where in ((username, "username"), (password, "password")):
        if not isinstance(value, str) or not value or len(value) > MAX_LOGIN_PART:
            raise errors.InvalidArgument(f"{where} must be a non-empty string (at most 4096)", field=where)
        if any(ch in value for ch in "\0"):
            raise errors.InvalidArgument(f"{where} may not contain NUL", field=where)
        parts[where] = value
    return json.dumps(parts).encode("utf-8")


def login_username_placeholder(placeholder: str) -> str:
    """A login credential's second placeholder (its username's), derived exactly as the gateway does."""
    return username_placeholder(placeholder)


def split_login_value(value: str) -> tuple[str, str]:
    """(username, password) of a login credential's vault value (login_value)."""
    parts = json.loads(value)
    return str(parts["username"]), str(parts["password"])
