"""The node's credential manager: fetches a sandbox's credentials from the control plane for the egress
gateway (never for the guest), caches them until they expire, and forwards the gateway's audit events.

Invariants:
- Values are fetched over the control plane's node-facing route with the node's identity (ADR 0019); the
  control plane answers only for sandboxes it has assigned to this node (service-level authorization lives
  there).
- A cached bundle is used until the earliest credential expiry or `max_age_s`, whichever comes first, and is
  dropped at once by `forget()` (policy change, sandbox gone), so a rotated or revoked credential reaches the
  gateway within `max_age_s` even if the push of the change was lost.
- Nothing here is ever written to disk or to a sandbox; an unreachable control plane means "no credentials"
  (the gateway then forwards placeholders unchanged), never a stale value past its expiry.
- Audit forwarding is best effort and bounded: events queue in memory up to `max_queue` (the oldest are
  dropped and counted) and are posted in batches; a failing sink never blocks the data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
from pydantic import ValidationError

from space.core import errors
from space.node.egress.credentials import Credential

log = logging.getLogger(__name__)

NodeIdProvider = Callable[[], str | None]
MAX_AUDIT_BATCH = 500  # the control plane's limit per POST


@dataclass
class _Cached:
    credentials: list[Credential]
    policy: dict[str, Any]
    valid_until: float


class ControlPlaneCredentials:
    """A CredentialSource (space.node.egress.credentials) backed by the control plane."""

    def __init__(self, http: httpx.AsyncClient, node_id: NodeIdProvider, *, max_age_s: float = 30.0) -> None:
        self._http = http
        self._node_id = node_id
        self._max_age_s = max_age_s
        self._cache: dict[str, _Cached] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def credentials(self, sandbox_id: str) -> list[Credential]:
        try:
            return (await self._bundle(sandbox_id)).credentials
        except errors.SpaceError as exc:
            log.warning("credentials of %s unavailable: %s", sandbox_id, exc.message)
            return []

    async def policy(self, sandbox_id: str) -> dict[str, Any]:
        """The sandbox's egress policy as the control plane has it ({"allow", "deny", "version"})."""
        return (await self._bundle(sandbox_id)).policy

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)  # else one lock per sandbox ever seen stays for the node's life

    async def _bundle(self, sandbox_id: str) -> _Cached:
        cached = self._cache.get(sandbox_id)
        if cached is not None and cached.valid_until > time.monotonic():
            return cached
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:  # one fetch per sandbox at a time, however many connections ask
            cached = self._cache.get(sandbox_id)
            if cached is not None and cached.valid_until > time.monotonic():
                return cached
            fetched = await self._fetch(sandbox_id)
            self._cache[sandbox_id] = fetched
            return fetched

    async def _fetch(self, sandbox_id: str) -> _Cached:
        node_id = self._node_id()
        if node_id is None:
            raise errors.Unavailable("the node is not registered with a control plane yet")
        try:
            response = await self._http.get(f"/v1/nodes/{node_id}/sandboxes/{sandbox_id}/credentials")
        except httpx.HTTPError as exc:
            raise errors.Unavailable(f"control plane unreachable: {exc}") from exc
        if response.status_code != 200:
            raise errors.error_from_dict(_error_body(response))
        body = response.json()
        now_wall, now = time.time(), time.monotonic()
        valid_until = now + self._max_age_s
        credentials = []
        for item in body.get("credentials", []):
            try:
                credential = Credential(
                    id=f"{item.get('scope', '')}:{item['name']}",
                    **{k: item[k] for k in _CREDENTIAL_FIELDS if item.get(k) is not None},
                )
            except KeyError as exc:
                log.warning("control plane sent a credential for %s without %s", sandbox_id, exc)
                continue
            except ValidationError as exc:
                # Never str(exc): pydantic quotes the input, and the input holds the value.
                problems = [
                    f"{'.'.join(map(str, e['loc'])) or '(credential)'}: {e['msg']}"
                    for e in exc.errors(include_url=False, include_context=False, include_input=False)
                ]
                log.warning("control plane sent an unusable credential for %s: %s", sandbox_id, problems)
                continue
            if credential.expires_at is not None:
                remaining = credential.expires_at.timestamp() - now_wall
                if remaining <= 0:
                    continue
                valid_until = min(valid_until, now + remaining)
            credentials.append(credential)
        return _Cached(credentials, dict(body.get("policy") or {}), valid_until)


_CREDENTIAL_FIELDS = (
    "name", "value", "hosts", "method", "header_name", "header_template", "query_param", "placeholder",
    "rate_per_minute", "expires_at", "username", "origin", "username_field", "password_field", "form_action",
)  # fmt: skip


def _error_body(response: httpx.Response) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return dict(body["error"])
    return {"code": "unavailable", "message": f"control plane answered {response.status_code}"}


def audit_action(record: dict[str, Any]) -> str | None:
    """The control plane's audit action for one gateway record, or None when it is not worth auditing
    there (allowed plain egress and DNS answers stay in the node's log)."""
    event, decision = record.get("event"), str(record.get("decision") or "")
    if event == "credential":
        if decision in {"injected", "rate_limited", "expired"}:
            return decision
        return "placeholder_blocked" if decision.startswith("not_replaced") else "denied"
    if event == "egress" and decision not in {"allowed", ""}:
        return "egress_denied"
    return None


class AuditForwarder:
    """The gateway's audit callback: queue, then post batches to the control plane every `interval_s`."""

    def __init__(
        self, http: httpx.AsyncClient, node_id: NodeIdProvider, *, interval_s: float = 1.0,
        max_queue: int = 10_000,
    ) -> None:  # fmt: skip
        self._http = http
        self._node_id = node_id
        self._interval_s = interval_s
        self._queue: deque[dict[str, Any]] = deque(maxlen=max_queue)
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        action = audit_action(record)
        if action is None:
            return
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        detail = {k: v for k, v in record.items() if k not in _RECORD_FIELDS}
        self._queue.append({
            "sandbox_id": record.get("sandbox_id"), "action": action, "credential": record.get("credential"),
            "host": (record.get("host") or None), "at": record.get("ts"), "detail": _jsonable(detail),
        })  # fmt: skip

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(errors.SpaceError):
            await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.flush()
            except errors.SpaceError as exc:
                log.warning("audit events not delivered yet (%d queued): %s", len(self._queue), exc.message)

    async def flush(self) -> None:
        node_id = self._node_id()
        while self._queue and node_id is not None:
            batch = [self._queue[i] for i in range(min(MAX_AUDIT_BATCH, len(self._queue)))]
            try:
                response = await self._http.post(f"/v1/nodes/{node_id}/audit", json={"events": batch})
            except httpx.HTTPError as exc:
                raise errors.Unavailable(f"control plane unreachable: {exc}") from exc
            if response.status_code >= 500:
                raise errors.Unavailable(f"control plane answered {response.status_code}")
            # Delivered (or refused for good: a 4xx will not get better by retrying). Only what is still at
            # the head is removed: a full queue may have dropped sent events during the post, and popping
            # blindly would then discard newer ones that were never sent.
            for sent in batch:
                if self._queue and self._queue[0] is sent:
                    self._queue.popleft()


_RECORD_FIELDS = frozenset({"event", "sandbox_id", "credential", "host", "ts"})  # sent as fields, not detail


def _jsonable(detail: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in detail.items()
            if isinstance(v, (str, int, float, bool, type(None), datetime))}  # fmt: skip
