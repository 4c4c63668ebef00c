"""Who calls the in-sandbox (envd) front, and which sandbox the call is for.

Invariants:
- The sandbox is named by the `E2b-Sandbox-Id` header (E2B's SDK sends it on every envd request when
  `E2B_SANDBOX_URL` is set); a request without it, or with a malformed id, is refused before any lookup.
- Credentials, in this order: `X-Access-Token` (the sandbox's envd access token, `e2b.access`, or a SPACE
  API key), `X-API-Key`, `Authorization: Bearer` (SPACE API keys, checked by `deps.authenticate`). An
  `Authorization: Basic` header names the in-sandbox user (E2B's convention), never a credential.
- An envd access token acts for exactly the sandbox it was derived from, with a member's rights in that
  sandbox's project; it is worth nothing for any other id (constant-time check; tokens are stored
  nowhere, the principal of a checked one is remembered for `auth_cache_s` like a key's).
- A sandbox of another project, a deleted one and a missing one are the same "not found".
- A signed `/files` URL (E2B's `download_url` / `upload_url`: no headers, `signature` = v1 of
  sha256(path:operation:user:token[:expiration])) names its sandbox only through the signature: the
  front finds the one live sandbox whose envd token makes it (at most SIGNED_SCAN sandboxes, constant-time
  comparisons), refuses it once `signature_expiration` has passed, and then acts with that token's rights.
  A signature is bound to its path, operation and user: any change is "unauthenticated".
- Every resolved caller passes the front's request limits (`limits.EnvdLimits.admit`) before any node call.
- The sandbox is brought to running the way SPACE's own data plane does (`deps.running_sandbox`: a paused
  sandbox is resumed), and every call counts as the sandbox's activity.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from space.controlplane.api.deps import (
    Principal,
    Services,
    authenticate,
    node_of,
    running_sandbox,
)
from space.controlplane.e2b.access import envd_access_token, token_matches
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.store.records import ApiKeyRecord, SandboxRecord
from space.core import errors
from space.core.ids import parse_sandbox_id
from space.core.lifecycle import State
from space.node.rpc_client import NodeClient

SANDBOX_HEADER = "e2b-sandbox-id"
#: The most live sandboxes a signed URL is matched against (a scan of the store's live sandboxes).
SIGNED_SCAN = 10_000
_LIVE = (State.RUNNING, State.PAUSED, State.PAUSING, State.RESUMING, State.SUSPENDED, State.RESTORING)
#: Longest `Authorization: Basic` value read for the user name (anything longer is junk).
_BASIC_MAX = 512


@dataclass(frozen=True)
class Target:
    """The caller, its running sandbox and the node client that reaches it."""

    who: Principal
    sandbox: SandboxRecord
    node: NodeClient
    user: str | None

    @property
    def sandbox_id(self) -> str:
        return self.sandbox.id


def sandbox_id_of(headers: Mapping[str, str]) -> str:
    value = headers.get(SANDBOX_HEADER)
    if not value:
        raise errors.InvalidArgument("missing E2b-Sandbox-Id header", field="E2b-Sandbox-Id")
    return parse_sandbox_id(value.strip(), field="E2b-Sandbox-Id")


def user_of(headers: Mapping[str, str], query_user: str | None = None) -> str | None:
    """The in-sandbox user: `username` query parameter, else `Authorization: Basic base64(user:)`."""
    if query_user:
        return _valid_user(query_user)
    value = headers.get("authorization", "")
    if not value.lower().startswith("basic ") or len(value) > _BASIC_MAX:
        return None
    try:
        decoded = base64.b64decode(value[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument("malformed Basic authorization", field="Authorization") from exc
    name = decoded.split(":", 1)[0]
    return _valid_user(name) if name else None


def _valid_user(name: str) -> str:
    if len(name) > 64 or not all(c.isalnum() or c in "._-" for c in name):
        raise errors.InvalidArgument(f"invalid user name {name[:64]!r}", field="username")
    return name


#: sandbox id -> (the principal of its envd token, until when): saves two reads on every envd request.
_token_principals: dict[str, tuple[Principal, float]] = {}
_TOKEN_CACHE_MAX = 10_000


async def _token_principal(services: Services, sandbox_id: str) -> Principal | None:
    """A member principal in the sandbox's own project (the token has been checked against the id);
    remembered for `auth_cache_s`, like keys (a sandbox deleted meanwhile is still refused by the lookup
    of the sandbox itself)."""
    now = time.monotonic()
    cached = _token_principals.get(sandbox_id)
    if cached is not None and cached[1] > now:
        return cached[0]
    found = await _load_token_principal(services, sandbox_id)
    if found is not None:
        while len(_token_principals) >= _TOKEN_CACHE_MAX:
            del _token_principals[next(iter(_token_principals))]
        _token_principals[sandbox_id] = (found, now + services.settings.auth_cache_s)
    return found


async def _load_token_principal(services: Services, sandbox_id: str) -> Principal | None:
    sb = await asyncio.to_thread(services.store.load_sandbox, sandbox_id)
    if sb is None or sb.state == State.DELETED:
        return None
    project = await asyncio.to_thread(services.store.get_project, sb.project_id)
    if project is None:
        return None
    key = ApiKeyRecord(
        id=f"envd-token:{sandbox_id}", project_id=project.id, org_id=project.org_id, role="member",
        prefix="", created_at=datetime.fromtimestamp(0, UTC), revoked_at=None,
    )  # fmt: skip
    return Principal(key, project.id)


def _bearer(headers: Mapping[str, str]) -> str | None:
    for name in ("x-access-token", "x-api-key"):
        value = headers.get(name, "").strip()
        if value:
            return "Bearer " + value
    value = headers.get("authorization", "")
    return value if value.startswith("Bearer ") else None


async def principal_for(services: Services, headers: Mapping[str, str], sandbox_id: str) -> Principal:
    """The caller of a request for `sandbox_id` (Unauthenticated without a valid credential)."""
    token = headers.get("x-access-token", "").strip()
    if token and token_matches(services.node_token, sandbox_id, token):
        found = await _token_principal(services, sandbox_id)
        if found is None:
            raise errors.NotFound(f"sandbox {sandbox_id} not found")
        return found
    return await authenticate(services, _bearer(headers), headers.get("x-space-project"))


async def target_of(
    services: Services,
    limits: EnvdLimits,
    headers: Mapping[str, str],
    *,
    mutating: bool,
    query_user: str | None = None,
) -> Target:
    """The caller's running sandbox named by the request's headers, and its node."""
    sandbox_id = sandbox_id_of(headers)
    who = await principal_for(services, headers, sandbox_id)
    who.require("member" if mutating else "read-only")
    limits.admit(who)
    user = user_of(headers, query_user)
    sb = await running_sandbox(services, who, sandbox_id)
    await note_activity(services, sb.id)
    return Target(who, sb, services.nodes.client(node_of(sb)), user)


async def note_activity(services: Services, sandbox_id: str) -> None:
    """Like the data plane's relay: the sandbox was used now (written at most once per debounce)."""
    now = time.monotonic()
    if now - services.activity.get(sandbox_id, 0.0) > services.settings.activity_debounce_s:
        services.activity[sandbox_id] = now
        await asyncio.to_thread(services.store.record_activity, sandbox_id)


@dataclass(frozen=True)
class Signed:
    """A signed /files request's query: what the signature covers."""

    path: str
    operation: str  # "read" | "write"
    user: str | None
    signature: str
    expiration: str | None


def _signature(signed: Signed, token: str) -> str:
    parts = [signed.path, signed.operation, signed.user or "", token]
    if signed.expiration is not None:
        parts.append(signed.expiration)
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def _check_expiration(signed: Signed) -> None:
    if signed.expiration is None:
        return
    if not signed.expiration.isdigit() or len(signed.expiration) > 12:
        raise errors.Unauthenticated("invalid signature_expiration")
    if int(signed.expiration) < time.time():
        raise errors.Unauthenticated("the signed URL has expired")


async def signed_target(
    services: Services, limits: EnvdLimits, headers: Mapping[str, str], signed: Signed, *, mutating: bool
) -> Target:
    """The sandbox a signed URL was made for (Unauthenticated if none, expired or altered)."""
    if not signed.signature.startswith("v1_") or len(signed.signature) > 100:
        raise errors.Unauthenticated("invalid signature")
    _check_expiration(signed)
    if headers.get(SANDBOX_HEADER):
        candidates = [sandbox_id_of(headers)]
    else:
        live = await asyncio.to_thread(services.store.list_sandboxes_in_states, _LIVE, SIGNED_SCAN)
        candidates = [sb.id for sb in live]
    match = None
    for sandbox_id in candidates:
        expected = _signature(signed, envd_access_token(services.node_token, sandbox_id))
        if hmac.compare_digest(expected, signed.signature):
            match = sandbox_id
    who = await _token_principal(services, match) if match is not None else None
    if match is None or who is None:
        raise errors.Unauthenticated("the signature matches no sandbox")
    who.require("member" if mutating else "read-only")
    limits.admit(who)
    sb = await running_sandbox(services, who, match)
    await note_activity(services, sb.id)
    user = _valid_user(signed.user) if signed.user else None
    return Target(who, sb, services.nodes.client(node_of(sb)), user)
