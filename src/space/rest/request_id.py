"""The request id of every HTTP surface (space.core.request_ids): a pure ASGI middleware that binds the id
(and the sandbox id a path names) for the time of a request and answers it in `X-Request-Id`.

Each request finished is one access line (this module's logger, INFO: method, path, status, milliseconds)
written under its ids (and its trace's: the ids of the request's span, taken when it answers, since the span
has ended by the time the line is written; ADR 0079), except the paths `quiet` matches (health checks,
heartbeats: one every 2 s per node would drown the rest). Two modes: the control plane's API *makes* ids
(`issue=True`: a missing or invalid caller's id is replaced by a fresh one); the node agent only *takes* the
one its caller (the control plane) sent (`issue=False`: an invalid one is dropped, no id is made), so a node's
lines carry exactly the ids the API made.

Invariants:
- Pure ASGI (no BaseHTTPMiddleware): a streamed answer is not buffered or re-tasked (ADR 0044).
- A response carries the header once, with the bound (valid) id; a header the app set is replaced.
- The sandbox id comes from the path only when it is a well-formed sandbox id after `/sandboxes/`; it names
  the sandbox in log lines, it authorizes nothing (the routes check access as before).
"""

from __future__ import annotations

import logging
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.core import request_ids, tracing
from space.core.ids import SANDBOX_ID_PATTERN
from space.rest.log_records import TRACE_IDS_ATTR

access_log = logging.getLogger(__name__)
_HEADER_BYTES = request_ids.HEADER.lower().encode()
_SANDBOX_IN_PATH = re.compile(rf"/sandboxes/({SANDBOX_ID_PATTERN})(?:/|$)")


def _header(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == _HEADER_BYTES:
            return bytes(value).decode("latin-1")
    return None


def sandbox_of_path(path: str) -> str | None:
    found = _SANDBOX_IN_PATH.search(path)
    return found.group(1) if found else None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, *, issue: bool, quiet: str = "^$") -> None:
        self.app = app
        self.issue = issue
        self.quiet = re.compile(quiet)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        presented = _header(scope)
        request_id = request_ids.accept(presented) if self.issue else request_ids.accept_known(presented)
        path = str(scope.get("path") or "")
        started, status = time.perf_counter(), [0]
        traced: list[tuple[str, str] | None] = [None]  # the request's span, seen while it answers
        encoded = request_id.encode() if request_id is not None else None

        async def answered(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                traced[0] = tracing.current_ids()  # the span ends before the access line is written
                if encoded is not None:
                    headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != _HEADER_BYTES]
                    message = {**message, "headers": [*headers, (_HEADER_BYTES, encoded)]}
            await send(message)

        with request_ids.bound(request_id, sandbox_of_path(path)):
            try:
                await self.app(scope, receive, answered if scope["type"] == "http" else send)
            finally:
                if not self.quiet.search(path):
                    method = scope.get("method", "WEBSOCKET")
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    access_log.info(
                        "%s %s %s %.1fms", method, path[:300], status[0] or "-", elapsed_ms,
                        extra={TRACE_IDS_ATTR: traced[0]} if traced[0] is not None else None,
                    )  # fmt: skip
