"""Request ids: one short token that follows a request through every process it touches (pure: no I/O).

The control plane's API takes a caller's `X-Request-Id` when it is a short token of a safe charset, and
makes one otherwise; the id is answered in the same header, carried in a context variable for the time of
the request (so every log line written for it names it), and sent on every node RPC the request causes, where
the node agent sets it again for its own log lines. One grep of the id follows the request from the API to
the node. It is a correlation id, never a secret and never a trace id (tracing is separate).

Invariants:
- A request id is 1 to MAX_LENGTH characters of `[A-Za-z0-9._-]`, starting with a letter or digit: a hostile
  header (newlines, quotes, JSON, 10 KB) is never logged, answered or forwarded; it is REPLACED by a fresh id
  (the caller's value is dropped, not truncated or escaped, so nothing of it reaches a log).
- The context variables are only set through `bound()`, which restores the previous values on exit, or in a
  copied context (`step_context`, for a task of its own): an id never leaks from one request into the next
  one served by the same task or thread.
- A reconciler step carries the id of the request that drives it, or a step id of its own (`step_…`), so
  its node calls are found by either.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import secrets
from collections.abc import Iterator

HEADER = "X-Request-Id"
MAX_LENGTH = 64
_TOKEN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LENGTH - 1}}}")
#: The id of the request this code runs for (None: not serving a request, e.g. a background job).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
#: The sandbox the request or step acts on, where known (None otherwise).
current_sandbox_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("sandbox_id", default=None)


def new_request_id() -> str:
    """A fresh id: `req_` and 16 hex digits (64 random bits: unique enough to grep, short to read)."""
    return "req_" + secrets.token_hex(8)


def new_step_id() -> str:
    """The id of a reconciler step no request drives (`step_` and 16 hex digits)."""
    return "step_" + secrets.token_hex(8)


def is_valid(value: str | None) -> bool:
    return value is not None and _TOKEN.fullmatch(value) is not None


def accept(value: str | None) -> str:
    """The caller's id if it is a valid token, else a fresh one (never any part of an invalid value)."""
    return value if value is not None and is_valid(value) else new_request_id()


def accept_known(value: str | None) -> str | None:
    """For a hop that does not make ids (the node agent): the id if valid, else None (no id)."""
    return value if is_valid(value) else None


@contextlib.contextmanager
def bound(request_id: str | None, sandbox_id: str | None = None) -> Iterator[None]:
    """Set the request id (and sandbox id) for the code inside; the previous values come back on exit."""
    request_token = current_request_id.set(request_id)
    sandbox_token = current_sandbox_id.set(sandbox_id)
    try:
        yield
    finally:
        current_sandbox_id.reset(sandbox_token)
        current_request_id.reset(request_token)


def step_context(sandbox_id: str) -> contextvars.Context:
    """A copy of the current context for a reconciler step on `sandbox_id`: the request's id when a request
    drives the step (the direct path), else a new step id; and the sandbox id (for `asyncio.create_task`'s
    `context`, so the step's log lines and node calls name both)."""
    context = contextvars.copy_context()
    request_id = context.get(current_request_id) or new_step_id()
    context.run(current_request_id.set, request_id)
    context.run(current_sandbox_id.set, sandbox_id)
    return context


def outgoing_headers() -> dict[str, str]:
    """The header to send on a call made for the current request ({} outside of one)."""
    request_id = current_request_id.get()
    return {HEADER: request_id} if request_id is not None else {}
