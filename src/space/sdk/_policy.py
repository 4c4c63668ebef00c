"""What every SDK request and answer goes through, with no I/O: headers, timeouts, retry decisions, errors.

The HTTP layers of both clients (space.sdk._async.http, and its generated twin space.sdk._sync.http) send
and sleep; this module decides.

Invariants:
- GETs are retried with exponential back-off (with jitter) on transport errors and 503.
- Every other method carries an `Idempotency-Key` (the caller's, or one generated per logical call and
  reused by its retries), and is retried on transport errors only when its body can be sent again (bytes or
  JSON, never a one-shot stream).
- A 429 with `Retry-After` (a rate or stream limit, refused before anything happened) is retried for any
  method whose body can be sent again, after the time the server named (at most 30 s a wait).
- Nothing above the HTTP layer sees an httpx exception: status >= 400 becomes a typed SpaceError, a
  transport failure a TransportError (also while iterating a streamed answer).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from space.core.errors import SpaceError
from space.sdk.errors import TransportError
from space.sdk.models import stream_error

__version__ = "0.1.0"

RETRY_STATUSES = frozenset({503})
MAX_RETRY_AFTER_S = 30.0
MAX_BACKOFF_S = 8.0
#: A list value is a repeated parameter (`state=running&state=paused`).
Params = Mapping[str, str | int | float | bool | list[str] | None]

_W3C = TraceContextTextMapPropagator()


class RequestPolicy:
    """The settings of one client and the decisions they imply (shared by the async and sync HTTP layers)."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        *,
        timeout: float,
        connect_timeout: float,
        max_retries: int,
        retry_backoff: float,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_retries = max(0, max_retries)
        self.retry_backoff = max(0.0, retry_backoff)
        self.connect_timeout = connect_timeout
        self.default_timeout = self.timeout(timeout)
        self.headers: dict[str, str] = {"User-Agent": f"space-sdk-python/{__version__}"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.headers.update(headers or {})

    def timeout(self, read: float | None) -> httpx.Timeout:
        """A timeout whose read/write part is `read` seconds (None: wait as long as the server works)."""
        return httpx.Timeout(read, connect=self.connect_timeout, pool=self.connect_timeout)

    @staticmethod
    def request_headers(method: str, idempotency_key: str | None) -> dict[str, str]:
        headers = (
            {} if method in {"GET", "HEAD"} else {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        )
        # The caller's OpenTelemetry trace, if it has one: SPACE's spans join it (ADR 0072). Only the W3C
        # traceparent (never baggage); nothing when no span is current.
        _W3C.inject(headers)
        return headers

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        if response is not None:
            raw = response.headers.get("retry-after")
            if raw is not None:
                try:
                    return min(MAX_RETRY_AFTER_S, max(0.0, float(raw)))
                except ValueError:
                    pass
        base = min(MAX_BACKOFF_S, self.retry_backoff * (2.0**attempt))
        return base * (0.5 + random.random() / 2)

    def retry_transport(self, method: str, replayable: bool, attempt: int) -> bool:
        return attempt < self.max_retries and (method == "GET" or replayable)

    def retry_status(
        self, method: str, status: int, attempt: int, response: httpx.Response, replayable: bool
    ) -> bool:
        if attempt >= self.max_retries:
            return False
        if status == 429 and "retry-after" in response.headers:
            # Refused by a limit before the request did anything: any method may be sent again, if its
            # body can be (mutations carry an Idempotency-Key anyway). A 429 without Retry-After (a
            # quota, a full disk) does not pass by waiting.
            return replayable
        return method == "GET" and status in RETRY_STATUSES

    def transport_error(self, exc: httpx.HTTPError, method: str, path: str) -> TransportError:
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        reason = str(exc) or type(exc).__name__
        return TransportError(
            f"{method} {self.url}{path} {what}: {reason}", url=self.url, exception=type(exc).__name__
        )

    def streaming_failure(self, exc: httpx.HTTPError, response: httpx.Response) -> TransportError:
        """A transport failure while a streamed answer was being read."""
        return self.transport_error(exc, response.request.method, response.request.url.path)


def query(params: Params | None) -> dict[str, str | int | float | list[str]]:
    """Query parameters as sent: None left out, booleans spelled "true"/"false", a list repeated."""
    return {key: _query_value(value) for key, value in (params or {}).items() if value is not None}


def _query_value(value: str | int | float | bool | list[str]) -> str | int | float | list[str]:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return [str(item) for item in value]
    return value


def decode_line(line: str) -> dict[str, Any] | None:
    """One line of an NDJSON answer: an event, None for a blank line; an error event is raised."""
    line = line.strip()
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise SpaceError(f"malformed line in a streamed answer: {line[:200]!r}") from exc
    if not isinstance(event, dict):
        raise SpaceError(f"malformed line in a streamed answer: {line[:200]!r}")
    error = stream_error(event)
    if error is not None:
        raise error
    return event


def json_answer(response: httpx.Response, method: str, path: str) -> Any:
    """The JSON of a (read) answer; {} for an empty body."""
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError as exc:
        raise SpaceError(f"{method} {path}: the answer is not JSON") from exc
