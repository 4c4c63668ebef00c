"""Sandbox capabilities on the node RPC: proof that the control plane authorized a call for ONE sandbox.

A capability is the text `<sandbox_id>.<expiry>.<mac>`, sent in the `X-Space-Capability` header next to the
node token: `expiry` is a Unix time in whole seconds, `mac` the lowercase hex HMAC-SHA256, keyed by the
node's RPC token, of `space-node-capability/v1 \\0 <sandbox_id> \\0 <expiry>`. The control plane mints one
per call from the sandbox id of the record it has authorized (never from a client's path); the node
refuses a sandbox-scoped call whose capability names another sandbox, has expired, or does not verify.
So a gateway bug that builds the wrong node URL cannot reach a sandbox the caller was not authorized for.

Invariants (pure: no I/O, no clock; callers pass `now`):
- `verify(key, mint(key, sid, now=t), sandbox_id=sid, now=t')` returns for `t' < t + ttl`, and raises
  `PermissionDenied` for any other sandbox id, once expired, for a capability minted with another key, for
  one whose lifetime exceeds MAX_LIFETIME_S, and for any text that is not exactly the format above.
- The MAC is compared in constant time; the sandbox id is checked with `space.core.ids` before anything
  else, so no malformed text reaches the MAC or an error message whole.
- The domain prefix keeps these MACs from ever equalling another HMAC made with the same token.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from typing import Final

from space.core.errors import InvalidArgument, PermissionDenied
from space.core.ids import SANDBOX_ID_PATTERN, SandboxId, parse_sandbox_id

CAPABILITY_HEADER: Final = "X-Space-Capability"
DEFAULT_TTL_S: Final = 60.0
#: The longest lifetime a node accepts, whatever the minter wrote (bounds a captured capability, and
#: tolerates this much clock skew between the control plane and a node).
MAX_LIFETIME_S: Final = 300.0
_DOMAIN: Final = b"space-node-capability/v1"
_MAC_HEX_LENGTH: Final = 64
_FORMAT: Final = re.compile(rf"({SANDBOX_ID_PATTERN})\.([1-9][0-9]{{0,11}})\.([0-9a-f]{{{_MAC_HEX_LENGTH}}})")
#: Longest well-formed text (the id, two dots, 12 digits, the MAC): anything longer is refused unread.
_MAX_LENGTH: Final = 3 + 26 + 1 + 12 + 1 + _MAC_HEX_LENGTH


def _key(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise InvalidArgument("a capability needs a non-empty key", field="key")
    return key


def _mac(key: bytes, sandbox_id: str, expiry: int) -> str:
    message = b"\0".join((_DOMAIN, sandbox_id.encode("ascii"), str(expiry).encode("ascii")))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def mint(secret: str | bytes, sandbox_id: str, *, now: float, ttl_s: float = DEFAULT_TTL_S) -> str:
    """A capability for `sandbox_id` valid from `now` for `ttl_s` seconds (rounded up to a whole second)."""
    sandbox_id = parse_sandbox_id(sandbox_id)
    if not 0 < ttl_s <= MAX_LIFETIME_S:
        raise InvalidArgument(f"a capability lives 0 < ttl_s <= {MAX_LIFETIME_S:.0f} s", field="ttl_s")
    expiry = math.ceil(now + ttl_s)
    return f"{sandbox_id}.{expiry}.{_mac(_key(secret), sandbox_id, expiry)}"


def verify(secret: str | bytes, capability: str | None, *, sandbox_id: str, now: float) -> SandboxId:
    """The sandbox id the capability grants, if it grants exactly `sandbox_id` at `now`; else
    PermissionDenied (with a reason that never quotes the capability)."""
    if not capability:
        raise PermissionDenied(f"this call needs an {CAPABILITY_HEADER} for its sandbox")
    if len(capability) > _MAX_LENGTH:
        raise PermissionDenied(f"malformed {CAPABILITY_HEADER}")
    match = _FORMAT.fullmatch(capability)
    if match is None:
        raise PermissionDenied(f"malformed {CAPABILITY_HEADER}")
    granted, expiry_text, mac = match.groups()
    expiry = int(expiry_text)
    if not hmac.compare_digest(mac, _mac(_key(secret), granted, expiry)):
        raise PermissionDenied(f"{CAPABILITY_HEADER} does not verify")
    if expiry <= now:
        raise PermissionDenied(f"{CAPABILITY_HEADER} expired", expired_at=expiry)
    if expiry > now + MAX_LIFETIME_S:
        raise PermissionDenied(f"{CAPABILITY_HEADER} lives longer than {MAX_LIFETIME_S:.0f} s")
    if granted != sandbox_id:  # ids are not secret; `sandbox_id` is a route's text, possibly not even ASCII
        raise PermissionDenied(f"{CAPABILITY_HEADER} was issued for another sandbox")
    return SandboxId(granted)
