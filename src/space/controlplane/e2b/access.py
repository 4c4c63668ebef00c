"""Per-sandbox envd access tokens: what E2B calls `envdAccessToken`, the only credential its SDK sends on
in-sandbox (envd) traffic (`X-Access-Token`, and the key of signed `/files` URLs).

Invariants:
- A token is an HMAC-SHA256 of the sandbox id under a key derived from the cluster's node token (which
  every control-plane replica has, and no sandbox or tenant ever sees): stable for the sandbox's whole
  life (create, connect, pause, resume give the same one, as E2B requires), different for every
  sandbox, and checked without any storage. It grants access to that one sandbox only.
- Only keys that may change a sandbox (member, admin) are shown a token: a read-only key that could read
  it would otherwise gain exec rights through the in-sandbox API.
- Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac

#: Domain separation: a token derived for E2B's envd is never valid as anything else.
_PURPOSE = b"space/e2b/envd-access-token/v1"


def _key(node_token: str) -> bytes:
    return hmac.new(node_token.encode(), _PURPOSE, hashlib.sha256).digest()


def envd_access_token(node_token: str, sandbox_id: str) -> str:
    """The envd access token of `sandbox_id` (hex, 64 characters)."""
    return hmac.new(_key(node_token), sandbox_id.encode(), hashlib.sha256).hexdigest()


def token_matches(node_token: str, sandbox_id: str, presented: str | None) -> bool:
    """Whether `presented` is `sandbox_id`'s token (constant time; None or junk matches nothing)."""
    if not presented or len(presented) > 256:
        return False
    return hmac.compare_digest(envd_access_token(node_token, sandbox_id), presented)
