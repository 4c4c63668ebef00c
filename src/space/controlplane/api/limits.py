"""Request limits of the public API, applied before any route runs (a pure ASGI middleware, ADR 0025).

Invariants:
- A public request (/v1/... except the node-facing /v1/nodes/..., and /mcp) is authenticated from its
  headers before one byte of its body is read: no key, an unknown or revoked key is a 401 at once, with
  `Connection: close` (the body is never parsed; a declared one of at most REFUSAL_DRAIN_BYTES is read and
  dropped first, for at most REFUSAL_DRAIN_S, so the client reads the answer instead of a reset). Node-facing
  routes authenticate nodes themselves and get only the size limit.
- Every body is bounded before it is parsed: a Content-Length over the route's limit is a 413 at once; a
  chunked body is counted while it streams in and cut at the limit (413 if nothing was answered yet).
  JSON routes get a small limit, file uploads and process stdin the large one.
- Per API key, ONE token bucket of requests for /v1 and /mcp together (429 `resource_exhausted` with
  `Retry-After` when empty; the /v1 calls an MCP tool makes in process take tokens too) and a cap
  on concurrent long-lived operations (exec, process output and stdin, file downloads and uploads, watch,
  PTY). A slot is held until the response has been sent whole (or the client went away).
- A long-lived response whose client does not take a chunk for `send_stall_s` is cut: a reader that stopped
  reading does not hold a node connection for ever.
- Data-plane requests run with `node_pools.traffic_owner` set to their key id, so every node call they make
  goes through that node's tenant-fair data pool (controlplane/node_pools.py), never the control pool.
- The limits live in this process: N replicas behind a balancer let a key do up to N times as much.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from space.controlplane.api.deps import Services, authenticate, authorization_of
from space.controlplane.node_pools import traffic_owner
from space.controlplane.settings import ControlPlaneSettings, default_of
from space.core import errors
from space.rest import errors as rest_errors

log = logging.getLogger(__name__)

#: A refused request's declared body up to this size is read and dropped before the answer, for at most
#: REFUSAL_DRAIN_S (see _drain_declared_body).
REFUSAL_DRAIN_BYTES = 8 * 1024 * 1024
REFUSAL_DRAIN_S = 2.0


@dataclass(frozen=True)
class LimitSettings:
    """The limits of this module: ControlPlaneSettings' `api_<field>` fields (SPACE_API_<FIELD>)."""

    json_body_bytes: int = default_of("api_json_body_bytes")
    upload_body_bytes: int = default_of("api_upload_body_bytes")
    node_body_bytes: int = default_of("api_node_body_bytes")
    requests_per_s: float = default_of("api_requests_per_s")
    request_burst: int = default_of("api_request_burst")
    streams_per_key: int = default_of("api_streams_per_key")
    send_stall_s: float = default_of("api_send_stall_s")
    max_tracked_keys: int = default_of("api_max_tracked_keys")

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> LimitSettings:
        return cls(**{spec.name: getattr(settings, "api_" + spec.name) for spec in fields(cls)})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LimitSettings:
        return cls.of(ControlPlaneSettings.from_env(environ))


# -- route classes -------------------------------------------------------------------------------------------
_SANDBOX = r"/v1/sandboxes/[^/]+"
# (method, path) of the operations that hold a connection open for as long as the client (or the command)
# likes: these count against a key's concurrent-stream cap.
_LONG_LIVED = [
    ("POST", re.compile(rf"{_SANDBOX}/exec")),
    ("POST", re.compile(rf"{_SANDBOX}/code")),  # run_code (ADR 0058)
    ("GET", re.compile(rf"{_SANDBOX}/processes/[^/]+/output")),
    ("POST", re.compile(rf"{_SANDBOX}/processes/[^/]+/stdin")),
    ("GET", re.compile(rf"{_SANDBOX}/files")),
    ("PUT", re.compile(rf"{_SANDBOX}/files")),
    ("GET", re.compile(rf"{_SANDBOX}/files/watch")),
    ("GET", re.compile(r"/v1/sandbox-updates")),  # the console's live list (ADR 0061)
    ("WEBSOCKET", re.compile(rf"{_SANDBOX}/pty")),
    ("GET", re.compile(r"/v1/templates/[^/]+/logs")),  # a build log followed to its end (ADR 0055)
    ("PUT", re.compile(r"/v1/templates/[^/]+/source")),
]
_UPLOADS = [
    ("PUT", re.compile(rf"{_SANDBOX}/files")),
    ("POST", re.compile(rf"{_SANDBOX}/processes/[^/]+/stdin")),
    ("PUT", re.compile(r"/v1/templates/[^/]+/source")),  # an OCI archive (ADR 0055; the route caps it lower)
]
_DATA_PLANE = re.compile(rf"{_SANDBOX}/(exec|code|pty|files|processes)(/.*)?")


def _matches(table: list[tuple[str, re.Pattern[str]]], method: str, path: str) -> bool:
    return any(m == method and pattern.fullmatch(path) for m, pattern in table)


def is_node_facing(path: str) -> bool:
    return path == "/v1/nodes" or path.startswith("/v1/nodes/")


#: The MCP endpoint (api/mcp_endpoint.py): a public surface of the same keys, in the same request bucket.
MCP_PATH = "/mcp"


def is_public(path: str) -> bool:
    """A request of an API key: `/v1/...` (but the node-facing routes) and `/mcp`. Each takes a token of
    its key's one bucket: a key has one request rate across both surfaces, never one per surface."""
    if path in (MCP_PATH, MCP_PATH + "/"):
        return True
    return (path == "/v1" or path.startswith("/v1/")) and not is_node_facing(path)


def is_long_lived(method: str, path: str) -> bool:
    return _matches(_LONG_LIVED, method, path)


def is_data_plane(path: str) -> bool:
    return _DATA_PLANE.fullmatch(path) is not None


def body_limit(settings: LimitSettings, method: str, path: str) -> int:
    if is_node_facing(path):
        return settings.node_body_bytes
    if _matches(_UPLOADS, method, path):
        return settings.upload_body_bytes
    return settings.json_body_bytes


# -- per-key state -------------------------------------------------------------------------------------------
class TokenBuckets:
    """A token bucket per key: `rate` tokens a second up to `burst`; each request takes one."""

    def __init__(self, rate: float, burst: int, max_keys: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float | None = None) -> float:
        """0.0 if the request may go now, else the seconds until a token will be there."""
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)  # re-inserted: the dict's order is least recently used first
        while len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]  # a dropped bucket starts full again: harmless
        return wait


class StreamSlots:
    """Concurrent long-lived operations per key (single event loop: no lock needed)."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._open: dict[str, int] = {}

    def acquire(self, key: str) -> bool:
        count = self._open.get(key, 0)
        if count >= self.per_key:
            return False
        self._open[key] = count + 1
        return True

    def release(self, key: str) -> None:
        count = self._open.get(key, 0) - 1
        if count <= 0:
            self._open.pop(key, None)
        else:
            self._open[key] = count

    def open(self, key: str) -> int:
        return self._open.get(key, 0)


class _BodyTooLarge(Exception):
    """Raised by the counting `receive` when a streamed body passes its limit."""


class _ClientStalled(Exception):
    """A client took no chunk of a long-lived response for `send_stall_s`."""


class _Exchange:
    """One request's body counted (cut at `limit`) and its response sends watched (timed for streams)."""

    def __init__(self, receive: Receive, send: Send, limit: int, stall_s: float | None) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.stall_s = stall_s
        self.received = 0
        self.tripped = False  # the body passed the limit
        self.started = False  # the app's own response has begun
        self.replaced = False  # a 413 went out instead of the app's response
        self.stalled = False  # the client took no chunk for stall_s

    async def receive(self) -> Message:
        if self.tripped:
            raise _BodyTooLarge()
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.tripped = True
                raise _BodyTooLarge()
        return message

    async def send(self, message: Message) -> None:
        if self.replaced or self.stalled:
            return
        if message["type"] == "http.response.start":
            if self.tripped:
                # Whatever the app made of a body cut short (a parse error, a 500), the answer is 413.
                await self._replace()
                return
            self.started = True
        if self.stall_s is not None and message["type"] == "http.response.body":
            try:
                async with asyncio.timeout(self.stall_s):
                    await self._send(message)
            except TimeoutError:
                self.stalled = True
                raise _ClientStalled() from None
            return
        await self._send(message)

    async def _replace(self) -> None:
        self.replaced = True
        await _send_error(self._send, _too_large(self.limit, None), close=True)

    async def ended_by(self, exc: Exception, path: str) -> bool:
        """Whether what the app raised is dealt with here (else the caller re-raises it)."""
        if self.stalled:
            # The server closes the connection when the app returns without finishing the response.
            log.warning("cut off a client that took no data for %.0f s: %s", self.stall_s, path)
            return True
        if self.started and self.stall_s is not None and isinstance(exc, errors.SpaceError):
            # A stream that broke off upstream (e.g. the node was quiet past the idle timeout): the
            # client sees an unfinished response; nothing else to tell it.
            log.info("stream %s ended: %s", path, exc.message)
            return True
        if not self.tripped or self.started or self.replaced:
            return False
        await self._replace()
        return True


# -- the middleware ------------------------------------------------------------------------------------------
class RequestLimits:
    def __init__(self, app: ASGIApp, services: Services, settings: LimitSettings | None = None) -> None:
        self.app = app
        self.services = services
        self.settings = settings or LimitSettings.of(services.settings)
        self.buckets = TokenBuckets(
            self.settings.requests_per_s, self.settings.request_burst, self.settings.max_tracked_keys
        )
        self.streams = StreamSlots(self.settings.streams_per_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        method = "WEBSOCKET" if scope["type"] == "websocket" else str(scope["method"]).upper()
        limit = body_limit(self.settings, method, path)
        headers = _headers(scope)
        key_id: str | None = None
        if is_public(path):
            try:
                who = await authenticate(
                    self.services,
                    authorization_of(headers, websocket=method == "WEBSOCKET"),
                    headers.get("x-space-project"),
                )
            except errors.SpaceError as exc:
                await self._refuse(scope, receive, send, exc)
                return
            key_id = who.key.id
            wait = self.buckets.take(key_id)
            if wait > 0:
                await self._refuse(scope, receive, send, _rate_limited(wait, self.settings))
                return
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await self._refuse(scope, receive, send, _too_large(limit, int(length)))
            return
        long_lived = key_id is not None and is_long_lived(method, path)
        if long_lived:
            assert key_id is not None
            if not self.streams.acquire(key_id):
                await self._refuse(scope, receive, send, _too_many_streams(self.settings.streams_per_key))
                return
        owner = traffic_owner.set(key_id) if key_id is not None and is_data_plane(path) else None
        try:
            if scope["type"] == "http":
                await self._bounded(
                    scope, receive, send, limit, stall_s=self.settings.send_stall_s if long_lived else None
                )
            else:
                await self.app(scope, receive, send)
        finally:
            if owner is not None:
                traffic_owner.reset(owner)
            if long_lived:
                assert key_id is not None
                self.streams.release(key_id)

    async def _bounded(
        self, scope: Scope, receive: Receive, send: Send, limit: int, *, stall_s: float | None
    ) -> None:
        """Run the app with its body counted and cut at `limit`, and (for streams) its sends timed."""
        exchange = _Exchange(receive, send, limit, stall_s)
        # The flags, not the exception types, decide: frameworks may wrap what the app raised (a body
        # parse error becomes a 400, a task group makes an exception group).
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception as exc:
            if not await exchange.ended_by(exc, scope["path"]):
                raise
        if exchange.tripped and not exchange.started and not exchange.replaced:
            await _send_error(send, _too_large(limit, None), close=True)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: errors.SpaceError) -> None:
        if scope["type"] == "websocket":
            # Refused before the handshake completes: the client sees the real status and error body.
            await WebSocket(scope, receive, send).send_denial_response(rest_errors.error_response(exc))
            return
        await _drain_declared_body(receive, _headers(scope).get("content-length"))
        await _send_error(send, exc, close=True)


async def _drain_declared_body(receive: Receive, length: str | None) -> None:
    """Read and drop a refused request's body when its declared size is small enough: a connection closed
    with unread data is reset by the kernel, and the reset can destroy the answer before the client reads
    it (an upload refused with 413 was seen as a connection reset). Bounded in bytes and in time; a larger
    or undeclared body is not read, and its sender may see the reset."""
    if length is None or not length.strip().isdigit() or int(length) > REFUSAL_DRAIN_BYTES:
        return
    try:
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            while (message := await receive())["type"] == "http.request" and message.get("more_body"):
                pass
    except TimeoutError:
        return


def _headers(scope: Scope) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return found


async def _send_error(send: Send, exc: errors.SpaceError, *, close: bool) -> None:
    """The standard error answer; `close`: the connection is closed after it, so an unread body never is."""
    response = rest_errors.error_response(exc, {"Connection": "close"} if close else None)
    await send(
        {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


def _rate_limited(wait_s: float, settings: LimitSettings) -> errors.ResourceExhausted:
    return errors.ResourceExhausted(
        f"too many requests for this API key (limit {settings.requests_per_s:g}/s, burst"
        f" {settings.request_burst}): retry after {math.ceil(wait_s)} s",
        limit="requests_per_s",
        retry_after_s=math.ceil(wait_s),
    )


def _too_many_streams(per_key: int) -> errors.ResourceExhausted:
    return errors.ResourceExhausted(
        f"this API key already has {per_key} streams open (exec, output, watch, downloads, uploads, PTY);"
        " close one first",
        limit="streams_per_key",
        retry_after_s=1,
    )


def _too_large(limit: int, length: int | None) -> errors.TooLarge:
    what = f"a body of {length} bytes" if length is not None else "the body"
    return errors.TooLarge(f"{what} exceeds this route's limit of {limit} bytes", limit_bytes=limit)
