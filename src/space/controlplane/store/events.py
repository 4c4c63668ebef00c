"""Sandbox events: what happened to a sandbox that its owner should see, beyond its current state (a node
lost, a step re-planned, a recovery and its reason, fencing).

Invariants:
- Append-only: an event is never changed once written; a sandbox's events read back in the order they
  were written (their ids increase).
- `kind` is a short dotted lower-case word (`node.lost`, `sandbox.recovered`); `message` is bounded text
  for people; `detail` a small JSON object for programs. Nothing here may carry a secret.
- Events of one sandbox are listed only through that sandbox (the API authorizes the sandbox first).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import select

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import RowMapper
from space.controlplane.store.models import EVENT_KIND_LENGTH, SandboxEvent
from space.core.errors import InvalidArgument

MESSAGE_LENGTH: Final = 2000
LIST_LIMIT: Final = 500
_KIND: Final = re.compile(r"[a-z][a-z_]*(\.[a-z][a-z_]*)*")


@dataclass(frozen=True, slots=True)
class SandboxEventRecord:
    id: int
    sandbox_id: str
    at: datetime
    kind: str
    message: str
    detail: dict[str, Any]


event_record = RowMapper(SandboxEventRecord)


def _kind(kind: str) -> str:
    if len(kind) > EVENT_KIND_LENGTH or not _KIND.fullmatch(kind):
        raise InvalidArgument(f"invalid event kind {kind!r}", field="kind")
    return kind


class SandboxEventRepository(Repository):
    """The sandbox_events table."""

    def record_event(
        self, sandbox_id: str, kind: str, message: str, detail: Mapping[str, Any] | None = None
    ) -> SandboxEventRecord:
        row = SandboxEvent(
            sandbox_id=sandbox_id,
            at=self.now(),
            kind=_kind(kind),
            message=(message or kind)[:MESSAGE_LENGTH],  # bounded: a long reason is cut, never refused
            detail=dict(detail or {}),
        )
        with self._tx(f"recording event {kind} of {sandbox_id}") as session:
            session.add(row)
            session.flush()
            return event_record(row)

    def list_events(
        self, sandbox_id: str, *, after: int = 0, limit: int = 100, kind: str | None = None
    ) -> list[SandboxEventRecord]:
        """The events of `sandbox_id` with an id above `after`, oldest first, at most `limit`."""
        if not 1 <= limit <= LIST_LIMIT:
            raise InvalidArgument(f"limit must be between 1 and {LIST_LIMIT}", field="limit")
        query = select(SandboxEvent).where(SandboxEvent.sandbox_id == sandbox_id, SandboxEvent.id > after)
        if kind is not None:
            query = query.where(SandboxEvent.kind == _kind(kind))
        with self._tx(f"listing events of {sandbox_id}") as session:
            rows = session.scalars(query.order_by(SandboxEvent.id).limit(limit))
            return [event_record(row) for row in rows]
