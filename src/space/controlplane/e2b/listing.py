"""E2B's sandbox lists: `GET /v2/sandboxes` (filters, order, pages) and the older `GET /sandboxes`.

Invariants:
- Only the caller's project's sandboxes are ever listed or matched, whatever the filters say.
- Filters are E2B's: `state` is a comma-separated subset of running,paused (default both); `metadata` is
  one parameter holding `k=v&k2=v2`, each key and value URL-encoded once more (E2B's SDK encodes twice),
  and every pair must match exactly; `template` is a template name (`base` is SPACE's default template),
  an unknown one matches nothing (200 `[]`); `startedAfter` is an inclusive RFC 3339 lower bound on the
  start time, at microsecond precision.
- Order is by start time then id, newest first unless `order=asc`. A page holds at most `limit` (1 to
  100) sandboxes; `X-Next-Token` is sent only when another page exists. The token names where the last
  page ended (start time, id, order): it is checked on the way in (400 if it is not one of ours or was
  made for the other order) and grants nothing (the filters and the project apply again).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from space.controlplane.api.deps import Principal, Services, Svc
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.views import e2b_state, listed_answer, metadata_of, space_template, visible
from space.controlplane.store.records import SandboxRecord
from space.core import errors
from space.core.ids import parse_sandbox_id

router = APIRouter()

MAX_PAGE = 100
STATES = ("running", "paused")
MAX_FILTER_PAIRS = 64


def parse_metadata(raw: str | None) -> dict[str, str]:
    """E2B's `metadata` filter: `k=v&k2=v2`, decoded as E2B's server decodes it (module invariants)."""
    if not raw:
        return {}
    parts = [part for part in urllib.parse.unquote_plus(raw).split("&") if part]
    if len(parts) > MAX_FILTER_PAIRS:
        raise errors.InvalidArgument(f"metadata filter: at most {MAX_FILTER_PAIRS} pairs", field="metadata")
    pairs: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise errors.InvalidArgument("metadata filter: expected key=value pairs", field="metadata")
        pairs[urllib.parse.unquote_plus(key)] = urllib.parse.unquote_plus(value)
    return pairs


def parse_states(raw: str | None) -> frozenset[str]:
    if not raw:
        return frozenset(STATES)
    wanted = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = wanted - set(STATES)
    if unknown or not wanted:
        raise errors.InvalidArgument(f"state: expected a subset of {','.join(STATES)}", field="state")
    return wanted


def _started_after(raw: str | None) -> datetime | None:
    if raw is None:
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError as exc:
        raise errors.InvalidArgument("startedAfter: expected an RFC 3339 time", field="startedAfter") from exc
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _token(sb: SandboxRecord, order: str) -> str:
    raw = json.dumps({"t": _utc(sb.created_at).isoformat(), "id": sb.id, "o": order}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _position(token: str | None, order: str) -> tuple[datetime, str] | None:
    if token is None:
        return None
    try:
        decoded = json.loads(base64.urlsafe_b64decode((token + "=" * (-len(token) % 4)).encode()))
        if decoded["o"] != order:
            raise ValueError("made for the other order")
        return _utc(datetime.fromisoformat(decoded["t"])), parse_sandbox_id(decoded["id"], field="nextToken")
    except (ValueError, KeyError, TypeError, binascii.Error, errors.InvalidArgument) as exc:
        raise errors.InvalidArgument("invalid nextToken", field="nextToken") from exc


def _matches(sb: SandboxRecord, states: frozenset[str], metadata: dict[str, str], template: str | None,
             after: datetime | None) -> bool:  # fmt: skip
    if not visible(sb) or e2b_state(sb) not in states:
        return False
    if template is not None and sb.template != space_template(template):
        return False
    if after is not None and _utc(sb.created_at) < after:
        return False
    own = metadata_of(sb)
    return all(own.get(k) == v for k, v in metadata.items())


async def _listed(services: Services, who: Principal) -> list[SandboxRecord]:
    return await asyncio.to_thread(services.store.list_sandboxes, who.project_id)


@router.get("/v2/sandboxes")
async def list_v2(
    *,
    who: E2bAuth,
    services: Svc,
    metadata: Annotated[str | None, Query(max_length=32 << 10)] = None,
    state: Annotated[str | None, Query(max_length=64)] = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    started_after: Annotated[str | None, Query(alias="startedAfter", max_length=64)] = None,
    template: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=512)] = None,
) -> JSONResponse:
    states, pairs, after = parse_states(state), parse_metadata(metadata), _started_after(started_after)
    position = _position(next_token, order)
    rows = [sb for sb in await _listed(services, who) if _matches(sb, states, pairs, template, after)]
    descending = order == "desc"
    rows.sort(key=lambda sb: (_utc(sb.created_at), sb.id), reverse=descending)
    if position is not None:
        rows = [sb for sb in rows if ((_utc(sb.created_at), sb.id) < position) == descending
                and (_utc(sb.created_at), sb.id) != position]  # fmt: skip
    page = rows[:limit]
    headers = {"X-Next-Token": _token(page[-1], order)} if len(rows) > limit else {}
    return JSONResponse([listed_answer(sb) for sb in page], headers=headers)


@router.get("/sandboxes")
async def list_v1(
    who: E2bAuth, services: Svc, metadata: Annotated[str | None, Query(max_length=32 << 10)] = None
) -> list[dict[str, Any]]:
    """E2B's first list: the running sandboxes (no pages)."""
    pairs = parse_metadata(metadata)
    rows = [
        sb for sb in await _listed(services, who) if _matches(sb, frozenset({"running"}), pairs, None, None)
    ]
    rows.sort(key=lambda sb: (_utc(sb.created_at), sb.id), reverse=True)
    return [listed_answer(sb) for sb in rows]
