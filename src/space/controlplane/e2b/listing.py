"""E2B's sandbox lists: `GET /v2/sandboxes` (filters, order, pages) and the older `GET /sandboxes`, over
SPACE's own paged query (`Store.page_sandboxes`, ADR 0048: filtered, ordered and cut in SQL).

Invariants:
- Only the caller's project's sandboxes are ever listed or matched, whatever the filters say.
- Filters are E2B's: `state` is a comma-separated subset of running,paused (default both); `metadata` is
  one parameter holding `k=v&k2=v2`, each key and value URL-encoded once more (E2B's SDK encodes twice),
  and every pair must match exactly; `template` is a template name (`base` is SPACE's default template),
  an unknown one matches nothing (200 `[]`); `startedAfter` is an inclusive RFC 3339 lower bound on the
  start time, at microsecond precision.
- Order is by start time then id, newest first unless `order=asc`. A page holds at most `limit` (1 to
  100) sandboxes; `X-Next-Token` (SPACE's page token: bound to the project, the filters and the order, 400
  under any other) is sent only when another page exists.
- A sandbox E2B's view does not show (wished deleted) or shows in the other state (a pause or resume just
  asked for, not yet begun) is left out of its page, which may then hold fewer than `limit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from space.controlplane import template_catalog
from space.controlplane.api.deps import Principal, Services, Svc
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.views import SPACE_STATES_OF, e2b_state, listed_answer, space_template, visible
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandbox_listing import MAX_PAGE as SPACE_MAX_PAGE
from space.controlplane.store.sandbox_listing import MAX_TOKEN_LENGTH, SandboxQuery
from space.core import errors

router = APIRouter()

MAX_PAGE = 100  # E2B's bound
V1_LIMIT = SPACE_MAX_PAGE
MAX_TEMPLATE = 64  # SPACE's template names are shorter; a longer one matches nothing
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


async def _page(
    services: Services, who: Principal, states: frozenset[str], query: SandboxQuery
) -> tuple[list[SandboxRecord], str | None]:
    """One page of the caller's sandboxes as E2B's view shows them in `states`."""
    if query.template is not None and len(query.template) > MAX_TEMPLATE:
        return [], None  # no template has such a name: it matches nothing
    space_states = tuple(state for name in sorted(states) for state in SPACE_STATES_OF[name])
    query = dataclasses.replace(query, states=space_states)
    page = await asyncio.to_thread(services.store.page_sandboxes, who.project_id, query)
    shown = [sb for sb in page.sandboxes if visible(sb) and e2b_state(sb) in states]
    return shown, page.next_page_token


@router.get("/v2/sandboxes")
async def list_v2(
    *,
    who: E2bAuth,
    services: Svc,
    metadata: Annotated[str | None, Query(max_length=32 << 10)] = None,
    state: Annotated[str | None, Query(max_length=64)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    started_after: Annotated[str | None, Query(alias="startedAfter", max_length=64)] = None,
    template: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=MAX_TOKEN_LENGTH)] = None,
) -> JSONResponse:
    named = space_template(template) if template is not None else None
    if (
        named is not None and len(named) <= MAX_TEMPLATE
    ):  # a project template's name or id: its node-level name
        with contextlib.suppress(errors.SpaceError):
            named = (
                await asyncio.to_thread(template_catalog.find, services.store, who.project_id, named)
            ).node_name
    query = SandboxQuery(
        template=named, metadata=parse_metadata(metadata), order=order, limit=limit, page_token=next_token,
        created_after=_started_after(started_after),
    )  # fmt: skip
    rows, token = await _page(services, who, parse_states(state), query)
    headers = {"X-Next-Token": token} if token else {}
    return JSONResponse([listed_answer(sb) for sb in rows], headers=headers)


@router.get("/sandboxes")
async def list_v1(
    who: E2bAuth, services: Svc, metadata: Annotated[str | None, Query(max_length=32 << 10)] = None
) -> list[dict[str, Any]]:
    """E2B's first list: the running sandboxes, newest first (one page of at most 1000: no tokens)."""
    query = SandboxQuery(metadata=parse_metadata(metadata), limit=V1_LIMIT)
    rows, _token = await _page(services, who, frozenset({"running"}), query)
    return [listed_answer(sb) for sb in rows]
