"""Sandbox events route: what happened to a sandbox beyond its current state (crashes, recoveries and their
reasons, lost nodes, re-planned steps), oldest first, read with a cursor.

Invariants:
- A key sees only its project's sandboxes: another project's sandbox id answers exactly like a missing one
  (404), before any event is read.
- Query parameters are typed and bounded here (`after` a non-negative id, `limit` 1..LIST_LIMIT, `kind` a
  dotted lower-case word of at most EVENT_KIND_LENGTH characters), so a malformed one is a 422 naming it.
- Events never carry secrets (store/events.py), so they are shown as stored.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from space.controlplane.api.deps import Auth, Svc, find_sandbox
from space.controlplane.store.events import LIST_LIMIT, SandboxEventRecord
from space.controlplane.store.models import EVENT_KIND_LENGTH

router = APIRouter()

#: The largest event id a cursor may name (the id column is a signed 64-bit integer).
MAX_EVENT_ID = (1 << 63) - 1
KIND_PATTERN = r"^[a-z][a-z_]*(\.[a-z][a-z_]*)*$"


class SandboxEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int
    sandbox_id: str
    at: str
    kind: str
    message: str
    detail: dict[str, Any]


class SandboxEvents(BaseModel):
    model_config = ConfigDict(extra="forbid")

    events: list[SandboxEvent]
    next_after: int | None  # the cursor for the next page (None: this page was not full)


def event_view(event: SandboxEventRecord) -> dict[str, Any]:
    return {
        "id": event.id,
        "sandbox_id": event.sandbox_id,
        "at": event.at.isoformat(),
        "kind": event.kind,
        "message": event.message,
        "detail": event.detail,
    }


@router.get("/sandboxes/{sandbox_id}/events", response_model=SandboxEvents)
async def list_sandbox_events(
    sandbox_id: str,
    *,
    who: Auth,
    services: Svc,
    after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID)] = 0,
    limit: Annotated[int, Query(ge=1, le=LIST_LIMIT)] = 100,
    kind: Annotated[
        str | None, Query(min_length=1, max_length=EVENT_KIND_LENGTH, pattern=KIND_PATTERN)
    ] = None,
) -> dict[str, Any]:
    sb = await find_sandbox(services, who, sandbox_id)
    rows = await asyncio.to_thread(services.store.list_events, sb.id, after=after, limit=limit, kind=kind)
    return {
        "events": [event_view(event) for event in rows],
        "next_after": rows[-1].id if len(rows) == limit else None,
    }
