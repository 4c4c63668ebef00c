"""What every router of the public API shares: the services, the caller (principal), sandbox lookups,
idempotency and the data-plane relay to a node. Routers depend on this module; it depends on no router.

Invariants:
- A request's principal comes from its headers alone (HTTP and WebSocket alike): an unknown or revoked key
  is a 401; an org key acts in the project named by `X-Space-Project` (default "default").
- A key sees only its project's sandboxes: another project's sandbox is a 404 exactly like a missing one.
- Mutations with an `Idempotency-Key` run once per (key id, project id, Idempotency-Key); replays (also
  concurrent ones) get the first answer; the same key with another body is a 409.
- The data plane is relayed to the sandbox's node as a stream in both directions (no whole-file buffering);
  a paused sandbox is resumed first, and every relayed request counts as activity. The node URL is built
  from the authorized record's id and fixed words or validated ids (one quoted segment each), never from
  the client's path text (ADR 0020).
- The caches here (keys, projects, running sandboxes, activity) only save database round trips: the
  database stays the truth, and each cache entry lives at most its `*_CACHE_S`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel
from starlette.requests import HTTPConnection

from space.controlplane.credentials.service import CredentialService
from space.controlplane.nodes import NodePool
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.snapshots import SnapshotKeeper
from space.controlplane.store.records import ApiKeyRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.ids import parse_sandbox_id
from space.core.lifecycle import State
from space.rest import errors as rest_errors

log = logging.getLogger(__name__)

Role = Literal["read-only", "member", "admin"]
_ROLE_ORDER: dict[str, int] = {"read-only": 0, "member": 1, "admin": 2}


@dataclass(frozen=True)
class Principal:
    """The caller: its API key and the project it acts in."""

    key: ApiKeyRecord
    project_id: str

    @property
    def role(self) -> str:
        return self.key.role

    def require(self, needed: Role) -> None:
        if _ROLE_ORDER[self.role] < _ROLE_ORDER[needed]:
            raise errors.PermissionDenied(f"a {self.role} key may not do this (needs {needed})")


@dataclass
class Services:
    store: Store
    nodes: NodePool
    reconciler: Reconciler
    snapshots: SnapshotKeeper
    node_token: str
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    settings: ControlPlaneSettings = field(default_factory=ControlPlaneSettings)
    # None: no vault master key (no data directory): credential routes answer 503.
    credential_service: CredentialService | None = None
    # Hot-path caches of the data plane: the database is the truth, these only save round trips.
    keys: dict[str, tuple[ApiKeyRecord, float]] = field(default_factory=dict)
    projects: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    running: dict[tuple[str, str], tuple[SandboxRecord, float]] = field(default_factory=dict)
    activity: dict[str, float] = field(default_factory=dict)

    def forget(self, sandbox_id: str) -> None:
        for cache_key in [k for k in self.running if k[1] == sandbox_id]:
            self.running.pop(cache_key, None)


def services_of(connection: HTTPConnection) -> Services:
    services: Services = connection.app.state.services
    return services


async def _services_dependency(connection: HTTPConnection) -> Services:
    """`services_of` as a dependency. A coroutine on purpose: FastAPI runs a plain `def` dependency in its
    thread pool, a thread hop on every request (ADR 0044)."""
    return services_of(connection)


Svc = Annotated[Services, Depends(_services_dependency)]


# -- authentication ------------------------------------------------------------------------------------------
#: A browser cannot set headers on a WebSocket, and a key never goes in a URL: a WebSocket may carry its key
#: as the subprotocol `space-key.<the key in unpadded base64url>` offered beside PTY_PROTOCOL, which the
#: server then picks (never the key's) (docs/adr/0061-web-console.md).
KEY_PROTOCOL_PREFIX = "space-key."
PTY_PROTOCOL = "space-pty"


def authorization_of(headers: Mapping[str, str], *, websocket: bool) -> str | None:
    """The request's `Authorization` value; for a WebSocket without one, `Bearer <key>` from a key
    subprotocol (a malformed one counts as none: 401)."""
    authorization = headers.get("authorization")
    if authorization or not websocket:
        return authorization
    for offered in headers.get("sec-websocket-protocol", "").split(","):
        if offered.strip().startswith(KEY_PROTOCOL_PREFIX):
            encoded = offered.strip().removeprefix(KEY_PROTOCOL_PREFIX)
            try:
                key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (ValueError, UnicodeDecodeError):
                return None
            return f"Bearer {key}"
    return None


async def authenticate_key(services: Services, authorization: str | None) -> ApiKeyRecord:
    """The API key of an `Authorization: Bearer <key>` header (Unauthenticated: none, unknown, revoked)."""
    if not authorization or not authorization.startswith("Bearer "):
        raise errors.Unauthenticated("missing API key (Authorization: Bearer <key>)")
    secret = authorization.removeprefix("Bearer ").strip()
    digest = hashlib.sha256(secret.encode()).hexdigest()
    cached = services.keys.get(digest)
    now = time.monotonic()
    if cached is not None and cached[1] > now:
        return cached[0]
    found = await asyncio.to_thread(services.store.authenticate, secret)
    if found is None:
        services.keys.pop(digest, None)
        raise errors.Unauthenticated("unknown or revoked API key")
    services.keys[digest] = (found, now + services.settings.auth_cache_s)
    return found


async def authenticate(
    services: Services, authorization: str | None, x_space_project: str | None
) -> Principal:
    """The principal of a request's headers (HTTP and WebSocket alike)."""
    key = await authenticate_key(services, authorization)
    if key.project_id is not None:
        return Principal(key, key.project_id)
    # An org-level key acts in the project named by X-Space-Project, else the org's "default" project.
    name = x_space_project or "default"
    now = time.monotonic()
    resolved = services.projects.get((key.org_id, name))
    if resolved is not None and resolved[1] > now:
        return Principal(key, resolved[0])
    project = await asyncio.to_thread(services.store.get_project_by_name, key.org_id, name)
    if project is None and name.startswith("prj-"):
        project = await asyncio.to_thread(services.store.get_project, name)
        if project is not None and project.org_id != key.org_id:
            project = None
    if project is None:
        raise errors.NotFound(f"project {name!r} not found")
    services.projects[(key.org_id, name)] = (project.id, now + services.settings.auth_cache_s)
    return Principal(key, project.id)


async def principal(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_space_project: Annotated[str | None, Header()] = None,
) -> Principal:
    return await authenticate(services_of(request), authorization, x_space_project)


Auth = Annotated[Principal, Depends(principal)]


def require_org_admin(who: Principal, to: str) -> None:
    """An org-wide key (no project) with the admin role, else PermissionDenied naming what it may not do."""
    if who.key.project_id is not None or who.role != "admin":
        raise errors.PermissionDenied(f"only an organization admin key may {to}")


def actor(who: Principal) -> str:
    """How the audit log names the caller."""
    return f"key:{who.key.id}"


async def resolve_project(services: Services, who: Principal, ref: str | None) -> str:
    """The project a request acts in: `ref` (name or id, within the key's org and reach) or the key's."""
    if ref is None:
        return who.project_id
    store = services.store
    project = await asyncio.to_thread(store.get_project_by_name, who.key.org_id, ref)
    if project is None and ref.startswith("prj-"):
        project = await asyncio.to_thread(store.get_project, ref)
    if project is None or project.org_id != who.key.org_id or who.key.project_id not in (None, project.id):
        raise errors.NotFound(f"project {ref!r} not found")
    return project.id


# -- credential store access ---------------------------------------------------------------------------------
_purges: set[asyncio.Task[dict[str, int]]] = set()


def credential_service(services: Services) -> CredentialService:
    service = services.credential_service
    if service is None:
        raise errors.Unavailable("the credential store is not configured on this control plane")
    _maybe_purge(service, services.settings.credential_purge_interval_s)
    return service


def _maybe_purge(service: CredentialService, interval_s: float) -> None:
    """Start CredentialService.purge() in the background at most every `interval_s` per process (the first
    credential request after start-up runs one); replicas may overlap, purge is idempotent."""
    now = time.monotonic()
    if now - service.last_purge < interval_s:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    service.last_purge = now
    task = loop.create_task(asyncio.to_thread(service.purge))
    _purges.add(task)

    def done(finished: asyncio.Task[dict[str, int]]) -> None:
        _purges.discard(finished)
        if not finished.cancelled() and finished.exception() is not None:
            log.warning("credential purge failed: %s", finished.exception())

    task.add_done_callback(done)


# -- sandboxes -----------------------------------------------------------------------------------------------
async def sandbox_of(services: Services, project_id: str, sandbox_id: str, field: str) -> SandboxRecord:
    """The project's sandbox (NotFound naming `field` if missing, deleted or another project's)."""
    parse_sandbox_id(sandbox_id, field=field)
    sb = await asyncio.to_thread(services.store.get_sandbox, project_id, sandbox_id)
    if sb is None or sb.state == State.DELETED:
        raise errors.NotFound(f"sandbox {sandbox_id} not found", field=field)
    return sb


async def find_sandbox(services: Services, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The caller's sandbox (NotFound if missing, deleted or another project's)."""
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    sb = await asyncio.to_thread(services.store.get_sandbox, who.project_id, sandbox_id)
    if sb is None or sb.state == State.DELETED:
        raise errors.NotFound(f"sandbox {sandbox_id} not found")
    return sb


def node_of(sb: SandboxRecord) -> str:
    if sb.node_id is None:
        raise errors.InvalidState(
            f"sandbox {sb.id} is not on a node (state '{sb.state}')", state=sb.state.value
        )
    return sb.node_id


#: Error codes a settled-for-good failure keeps as its own (not a runtime failure): a tenant's revoked key
#: (issue 5) is 403 key_revoked, a stored snapshot that failed verification (issue 4) is 502 artifact_corrupt.
_FAILURES_KEPT: tuple[type[errors.SpaceError], ...] = (errors.KeyRevoked, errors.ArtifactCorrupt)


def _settle_failure(sb: SandboxRecord) -> errors.SpaceError:
    message = f"sandbox {sb.id} could not reach '{sb.desired_state}': {sb.error}"
    for kind in _FAILURES_KEPT:
        if sb.error_code == kind.code:
            return kind(message, state=sb.state.value)
    return errors.RuntimeFailure(message, state=sb.state.value)


async def wait_settled(services: Services, sandbox_id: str, timeout: float | None = None) -> SandboxRecord:
    """Until the reconciler has made state == desired_state (or gave up)."""
    timeout = services.settings.wait_timeout_s if timeout is None else timeout
    services.reconciler.poke()
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        sb = await asyncio.to_thread(services.store.load_sandbox, sandbox_id)
        if sb is None:
            raise errors.NotFound(f"sandbox {sandbox_id} not found")
        if sb.state == sb.desired_state:
            return sb
        if sb.state == State.FAILED or sb.error_permanent:
            raise _settle_failure(sb)
        if time.monotonic() > deadline:
            raise errors.Timeout(f"sandbox {sandbox_id} did not reach '{sb.desired_state}' in {timeout:.0f}s")
        # Woken at once when this process's reconciler moves a sandbox; the timeout covers the work of other
        # replicas, which only the database tells about.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(services.reconciler.changed.wait(), delay)
        delay = min(delay * 1.5, 0.1)


_WAKES_ON_USE = {State.PAUSED, State.PAUSING, State.RESUMING}
_COMING_UP = {State.PENDING, State.CREATING, State.STARTING}
_COMES_BACK = {State.SUSPENDED, State.RESTORING, State.RECOVERING}


def remember_running(
    services: Services, project_id: str, sb: SandboxRecord, *, created: bool = False
) -> bool:
    """Cache `sb` for the data plane if it is running (True), for at most `running_cache_s`. A sandbox
    just `created` also counts as used now: its row's last activity is its creation, so its first
    data-plane call need not write it again."""
    if sb.state != State.RUNNING or sb.desired_state != State.RUNNING:
        return False
    now = time.monotonic()
    services.running[(project_id, sb.id)] = (sb, now + services.settings.running_cache_s)
    if created:
        services.activity.setdefault(sb.id, now)
    return True


async def running_sandbox(services: Services, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The sandbox, running: a paused one is resumed first (transparently), others are refused by state."""
    cached = services.running.get((who.project_id, sandbox_id))
    if cached is not None and cached[1] > time.monotonic():
        return cached[0]
    sb = await find_sandbox(services, who, sandbox_id)
    if remember_running(services, who.project_id, sb):
        return sb
    paused = sb.state in _WAKES_ON_USE or (sb.state == State.RUNNING and sb.desired_state == State.PAUSED)
    # Like a paused sandbox, a suspended one comes back on first use (on any node).
    suspended = sb.state in _COMES_BACK and not sb.error_permanent
    if paused or suspended:
        if sb.desired_state != State.RUNNING:
            await asyncio.to_thread(services.store.set_desired, sb.id, State.RUNNING)
        return await wait_settled(services, sb.id)
    if sb.state in _COMING_UP and sb.desired_state == State.RUNNING:
        return await wait_settled(services, sb.id)
    raise errors.InvalidState(f"sandbox {sandbox_id} is '{sb.state}', not running", state=sb.state.value)


# -- idempotency ---------------------------------------------------------------------------------------------
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=128)]
Work = Callable[[], Awaitable[tuple[int, Any]]]


def idempotency_scope(who: Principal) -> str:
    """Whose Idempotency-Keys these are: the API key AND the project it acts in. An org key acts in any
    project (X-Space-Project); scoped by key alone, its key "k" in project B would replay (or, for a create,
    derive the id of) what the same key did in project A (ADR 0020)."""
    return f"{who.key.id}/{who.project_id}"


def derived_sandbox_id(scope: str, key: str) -> str:
    digest = hashlib.sha256(f"{scope}\0{key}".encode()).digest()[:16]
    return "sb-" + base64.b32encode(digest).decode().lower().rstrip("=")


async def idempotent(
    services: Services, who: Principal, key: str | None, request_fingerprint: str, work: Work
) -> JSONResponse:
    """`work`'s (status, body) as a JSON answer, run once per Idempotency-Key (module invariants)."""
    if not key:
        status, body = await work()
        return JSONResponse(body, status_code=status)
    scope = idempotency_scope(who)
    replayed = await _claim(services, scope, key, hashlib.sha256(request_fingerprint.encode()).hexdigest())
    if replayed is not None:
        return replayed
    keeper = asyncio.create_task(_keep_claimed(services, scope, key))
    try:
        status, body = await work()
    except errors.SpaceError as exc:
        status, body = rest_errors.status_for(exc), rest_errors.body_of(exc)
        if status >= 500:
            await asyncio.to_thread(services.store.abandon_idempotent, scope, key)
            raise
    except BaseException:
        await asyncio.to_thread(services.store.abandon_idempotent, scope, key)
        raise
    finally:
        keeper.cancel()
    await asyncio.to_thread(services.store.finish_idempotent, scope, key, status, body)
    return JSONResponse(body, status_code=status)


async def _claim(services: Services, scope: str, key: str, digest: str) -> JSONResponse | None:
    """None once this request owns the key; the first answer if the key's request already finished."""
    stale_after_s = services.settings.idempotency_stale_s
    deadline = time.monotonic() + services.settings.wait_timeout_s
    while True:
        begun = await asyncio.to_thread(
            services.store.begin_idempotent, scope, key, digest, stale_after_s=stale_after_s
        )
        if begun.outcome == "replay":
            return JSONResponse(begun.body, status_code=int(begun.status_code or 200))
        if begun.outcome == "new":
            return None
        if time.monotonic() > deadline:
            raise errors.Conflict("a request with this Idempotency-Key is still in progress", key=key)
        await asyncio.sleep(0.05)  # a concurrent twin is working: wait for its answer


async def _keep_claimed(services: Services, scope: str, key: str) -> None:
    """Refresh an in-progress idempotency record while its request works, so that the record of a request
    whose process died goes stale quickly and a retry takes it over (idempotency_stale_s)."""
    while True:
        await asyncio.sleep(services.settings.idempotency_stale_s / 3)
        with contextlib.suppress(errors.SpaceError):
            await asyncio.to_thread(services.store.touch_idempotent, scope, key)


# -- the data-plane relay ------------------------------------------------------------------------------------
#: Of the client's headers only these reach the node.
RELAYED_HEADERS = ("content-type",)


def json_bytes(body: BaseModel) -> bytes:
    """A validated body as the node receives it: only what the client set (the node fills defaults)."""
    return body.model_dump_json(exclude_unset=True).encode()


async def _note_activity(services: Services, sandbox_id: str) -> None:
    now = time.monotonic()
    if now - services.activity.get(sandbox_id, 0.0) > services.settings.activity_debounce_s:
        services.activity[sandbox_id] = now
        await asyncio.to_thread(services.store.record_activity, sandbox_id)


async def _request_content(request: Request, limit: int, small: int) -> bytes | AsyncIterator[bytes]:
    """The client's body for the node: small bodies whole (streaming them costs more than they weigh),
    anything else streamed and cut at `limit`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) <= small:
        return await request.body()
    return _limited(request.stream(), limit)


async def _limited(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise errors.TooLarge(f"upload exceeds {limit} bytes")
        yield chunk


async def relay(
    request: Request,
    services: Services,
    who: Principal,
    sandbox_id: str,
    *segments: str,
    mutating: bool,
    params: dict[str, Any] | None = None,
    body: BaseModel | None = None,
    stream_body: bool = False,
) -> Response:
    """Forward one data-plane operation to the node route `segments` of the caller's running sandbox:
    `body` (a validated model) as JSON, or with `stream_body` the client's raw body; the node's answer comes
    back whole if it is plain JSON, else streamed."""
    who.require("member" if mutating else "read-only")
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    sb = await running_sandbox(services, who, sandbox_id)
    await _note_activity(services, sb.id)
    limit = services.settings.max_upload_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise errors.TooLarge(f"upload of {length} bytes exceeds {limit}")
    node = services.nodes.client(node_of(sb))
    headers = {k: v for k, v in request.headers.items() if k.lower() in RELAYED_HEADERS}
    content: bytes | AsyncIterator[bytes] | None = None
    if body is not None:
        content = json_bytes(body)
        headers["content-type"] = "application/json"
    elif stream_body:
        content = await _request_content(request, limit, services.settings.small_body_bytes)
    upstream = await node.proxy_stream(
        request.method, sb.id, *segments, params=params, content=content, headers=headers
    )
    if (upstream.media_type or "").startswith("application/json"):
        # A plain JSON answer (not NDJSON or a file): relay it whole, without chunked framing.
        answer = b"".join([chunk async for chunk in upstream.body()])
        return Response(answer, status_code=upstream.status_code, media_type="application/json")
    return StreamingResponse(
        upstream.body(), status_code=upstream.status_code, media_type=upstream.media_type, background=None
    )
