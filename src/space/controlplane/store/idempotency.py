"""Idempotency records: requests with an `Idempotency-Key` run once and are answered again on retry.

Invariants:
- A record is created by INSERT under the (scope, key) primary key: of concurrent requests with one key
  exactly one gets "new"; the rest see "in_progress" or, once finished, "replay". A key used again with
  another request hash is Conflict.
- An in-progress record older than `stale_after_s` (its request died with its process) is taken over
  under a row lock by exactly one caller; a live request pushes that horizon forward (`touch_idempotent`).
- Finished records are kept (and replayed) until purged by age; an abandoned in-progress record is
  removed so the client's retry runs again.
"""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.orm import Session

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import idempotency_record
from space.controlplane.store.models import IdempotencyRecord
from space.controlplane.store.records import IdempotentBegin
from space.controlplane.store.values import rowcount, seconds, text
from space.core.errors import AlreadyExists, Conflict, NotFound

_BEGIN_ATTEMPTS = 3


def _in_progress(scope: str, key: str) -> list[Any]:
    return [
        IdempotencyRecord.scope == scope,
        IdempotencyRecord.key == key,
        IdempotencyRecord.status_code.is_(None),
    ]


def _answer_existing(
    existing: IdempotencyRecord, request_hash: str, now: datetime, stale_after_s: float | None
) -> IdempotentBegin:
    """What a begin answers when the (scope, key) row exists (and is locked by the caller)."""
    view = idempotency_record(existing)
    if not hmac.compare_digest(existing.request_hash, request_hash):
        raise Conflict("this Idempotency-Key was already used with a different request", key=existing.key)
    if existing.status_code is not None:
        return IdempotentBegin("replay", view, existing.status_code, existing.response_body)
    if stale_after_s is not None and existing.created_at <= now - seconds(stale_after_s, "stale_after_s"):
        # Row lock held (FOR UPDATE / BEGIN IMMEDIATE): only one taker wins the takeover.
        existing.created_at = now
        return IdempotentBegin("new", idempotency_record(existing))
    return IdempotentBegin("in_progress", view)


class IdempotencyRepository(Repository):
    """The idempotency_records table."""

    def begin_idempotent(
        self, scope: str, key: str, request_hash: str, *, stale_after_s: float | None = None
    ) -> IdempotentBegin:
        """Start (or find) the request with Idempotency-Key `key` in `scope` (a project or key id).

        Conflict if the key was used with another request_hash. With stale_after_s, an in-progress
        record older than that (its request died with its process) is taken over and reported "new"."""
        scope = text(scope, "scope", 64)
        key = text(key, "idempotency key", 128)
        request_hash = text(request_hash, "request_hash", 64)
        for _attempt in range(_BEGIN_ATTEMPTS):
            now = self.now()
            row = IdempotencyRecord(
                scope=scope,
                key=key,
                request_hash=request_hash,
                status_code=None,
                response_body=None,
                created_at=now,
            )
            try:
                # The primary key (scope, key) lets exactly one concurrent INSERT commit.
                with self._tx("recording an idempotency key") as session:
                    session.add(row)
                return IdempotentBegin("new", idempotency_record(row))
            except AlreadyExists:
                pass
            with self._tx("reading an idempotency key") as session:
                existing = session.get(IdempotencyRecord, (scope, key), with_for_update=True)
                if existing is not None:
                    return _answer_existing(existing, request_hash, now, stale_after_s)
            # Purged or abandoned in between: try to insert again.
        raise Conflict("this Idempotency-Key is changing concurrently; retry", key=key)

    def touch_idempotent(self, scope: str, key: str) -> bool:
        """The request holding an in-progress key is still alive: push its staleness horizon forward."""
        statement = (
            update(IdempotencyRecord)
            .where(*_in_progress(scope, key))
            .values(created_at=self.now())
            .execution_options(synchronize_session=False)
        )
        with self._tx("refreshing an idempotent request") as session:
            return rowcount(session.execute(statement)) == 1

    def finish_idempotent(self, scope: str, key: str, status_code: int, body: Any) -> None:
        """Store the answer of the request begun with "new"; later begins replay it."""
        statement = (
            update(IdempotencyRecord)
            .where(*_in_progress(scope, key))
            .values(status_code=status_code, response_body=body)
            .execution_options(synchronize_session=False)
        )
        with self._tx("finishing an idempotent request") as session:
            if rowcount(session.execute(statement)) == 1:
                return
            raise _unfinishable(session, scope, key)

    def abandon_idempotent(self, scope: str, key: str) -> bool:
        """Forget an in-progress key whose request failed in a way not worth replaying (e.g. a 5xx), so
        the client's retry runs again. Finished records are kept."""
        statement = delete(IdempotencyRecord).where(*_in_progress(scope, key))
        with self._tx("abandoning an idempotent request") as session:
            return rowcount(session.execute(statement)) == 1

    def purge_idempotency(self, older_than_s: float, *, limit: int = 1000) -> int:
        """Delete at most `limit` idempotency records older than `older_than_s` (keys are replayable that
        long), oldest first; the number deleted (== limit: there may be more). One short transaction: a
        large backlog is worked off in batches without holding locks for long."""
        cutoff = self.now() - seconds(older_than_s, "older_than_s")
        oldest = (
            select(IdempotencyRecord.scope, IdempotencyRecord.key)
            .where(IdempotencyRecord.created_at < cutoff)
            .order_by(IdempotencyRecord.created_at)
            .limit(max(1, limit))
        )
        with self._tx("purging idempotency records") as session:
            keys = [tuple(row) for row in session.execute(oldest)]
            if not keys:
                return 0
            statement = delete(IdempotencyRecord).where(
                tuple_(IdempotencyRecord.scope, IdempotencyRecord.key).in_(keys),
                IdempotencyRecord.created_at < cutoff,  # refreshed meanwhile (a live request): kept
            )
            return rowcount(session.execute(statement))


def _unfinishable(session: Session, scope: str, key: str) -> NotFound | Conflict:
    """Why finishing (scope, key) changed nothing: it is gone, or it was finished already."""
    if session.get(IdempotencyRecord, (scope, key)) is None:
        return NotFound(f"idempotency key {key!r} not found")
    return Conflict(f"idempotency key {key!r} already finished", key=key)
