"""One page of a project's sandboxes: filters, order and page tokens, all in SQL.

Invariants (docs/adr/0048-metadata-lists-and-deadlines.md):
- Every query is scoped to ONE project first (the index on (project_id, created_at) narrows it), so no
  filter and no token can reach another project's rows.
- Filters are SQL predicates with bound parameters: states (`IN`), template (`=`), a creation time
  (`created_at >= t`, inclusive to the microsecond), and each metadata pair
  as `metadata ->> key = value` (PostgreSQL) / `JSON_EXTRACT(metadata, '$."key"') = value` (SQLite); a
  key is bound, never spliced, and space.core.sandbox_options allows no quote, backslash or `$` in it.
- The order is (created_at, id), ascending or descending, so it is total: pages never repeat or skip a
  row, even when sandboxes share a creation time. A page is fetched with LIMIT n+1: the extra row only
  says that there is a next page; no listing loads every row.
- A page token is opaque to clients: base64url of {version, position (created_at, id), fingerprint}. The
  fingerprint is a digest of the project and the filters and order, so a token is refused (400, field
  `page_token`) under another project or other filters; it carries no SQL and every part is parsed
  strictly (an aware time, a sandbox id), so a forged token can at most move the cursor within the
  caller's own listing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from sqlalchemy import ColumnElement, Select, and_, or_, select

from space.controlplane.store.models import Sandbox
from space.controlplane.store.records import SandboxRecord
from space.core import ids, lifecycle
from space.core.errors import InvalidArgument
from space.core.lifecycle import State
from space.core.sandbox_options import check_metadata

MAX_PAGE: Final = 1000
DEFAULT_PAGE: Final = 100
MAX_TOKEN_LENGTH: Final = 512
_TOKEN_VERSION: Final = 1

Order = Literal["asc", "desc"]


@dataclass(frozen=True, slots=True)
class SandboxQuery:
    """What to list: no states means every state but `deleted`; metadata pairs must all match."""

    states: tuple[State, ...] = ()
    template: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    order: Order = "desc"
    limit: int = DEFAULT_PAGE
    page_token: str | None = None
    created_after: datetime | None = None  # inclusive, to the microsecond (an aware time)


@dataclass(frozen=True, slots=True)
class SandboxPage:
    sandboxes: list[SandboxRecord]
    next_page_token: str | None  # None: this is the last page


def checked_query(query: SandboxQuery) -> SandboxQuery:
    """`query` with its states parsed and its bounds checked (InvalidArgument naming the field)."""
    if query.order not in ("asc", "desc"):
        raise InvalidArgument("order must be asc or desc", field="order")
    if isinstance(query.limit, bool) or not isinstance(query.limit, int) or not 1 <= query.limit <= MAX_PAGE:
        raise InvalidArgument(f"limit must be an integer from 1 to {MAX_PAGE}", field="limit")
    if query.template is not None and (not isinstance(query.template, str) or len(query.template) > 64):
        # Bounded like the column; a value that is no template name simply matches nothing (an unknown
        # template is an empty list, not an error: E2B's filter takes ids and aliases SPACE never has).
        raise InvalidArgument("template is at most 64 characters", field="template")
    after = query.created_after
    if after is not None and (not isinstance(after, datetime) or after.utcoffset() is None):
        raise InvalidArgument("created_after must be a time with its UTC offset", field="created_after")
    states = tuple(sorted({lifecycle.parse_state(s) for s in query.states}))
    return SandboxQuery(
        states=states, template=query.template, metadata=check_metadata(query.metadata),
        order=query.order, limit=query.limit, page_token=query.page_token,
        created_after=after.astimezone(UTC) if after is not None else None,
    )  # fmt: skip


def fingerprint(project_id: str, query: SandboxQuery) -> str:
    """What a token is bound to: the project, the filters and the order (not the page size)."""
    canonical = json.dumps(
        [
            project_id,
            [s.value for s in query.states],
            query.template,
            sorted(query.metadata.items()),
            query.order,
            query.created_after.isoformat() if query.created_after is not None else None,
        ],
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def encode_token(project_id: str, query: SandboxQuery, last: SandboxRecord) -> str:
    payload = {
        "v": _TOKEN_VERSION,
        "at": last.created_at.isoformat(),
        "id": last.id,
        "f": fingerprint(project_id, query),
    }
    raw = json.dumps(payload, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _refused(why: str) -> InvalidArgument:
    return InvalidArgument(f"invalid page_token: {why}", field="page_token")


def decode_token(project_id: str, query: SandboxQuery, token: str) -> tuple[datetime, str]:
    """The position (created_at, id) `token` continues after; InvalidArgument unless it is a token of
    this project, these filters and this order."""
    if not token or len(token) > MAX_TOKEN_LENGTH:
        raise _refused("empty or too long")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        payload: Any = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise _refused("not a page token of this API") from exc
    if (
        not isinstance(payload, dict)
        or set(payload) != {"v", "at", "id", "f"}
        or payload["v"] != _TOKEN_VERSION
    ):
        raise _refused("not a page token of this API")
    if payload["f"] != fingerprint(project_id, query):
        raise _refused("it belongs to another listing (other filters, order or project)")
    try:
        at = datetime.fromisoformat(payload["at"]) if isinstance(payload["at"], str) else None
    except ValueError as exc:
        raise _refused("not a page token of this API") from exc
    if at is None or at.tzinfo is None:
        raise _refused("not a page token of this API")
    try:
        last_id = ids.parse_sandbox_id(payload["id"], field="page_token")
    except InvalidArgument as exc:
        raise _refused("not a page token of this API") from exc
    return at, last_id


def _after(position: tuple[datetime, str], order: Order) -> ColumnElement[bool]:
    at, last_id = position
    if order == "desc":
        return or_(Sandbox.created_at < at, and_(Sandbox.created_at == at, Sandbox.id < last_id))
    return or_(Sandbox.created_at > at, and_(Sandbox.created_at == at, Sandbox.id > last_id))


def page_statement(project_id: str, query: SandboxQuery) -> Select[Sandbox]:
    """The SELECT of one page of `query` (already checked), one row more than the page to tell whether
    another follows."""
    statement = select(Sandbox).where(Sandbox.project_id == project_id)
    if query.states:
        statement = statement.where(Sandbox.state.in_([s.value for s in query.states]))
    else:
        statement = statement.where(Sandbox.state != State.DELETED.value)
    if query.template is not None:
        statement = statement.where(Sandbox.template == query.template)
    if query.created_after is not None:
        statement = statement.where(Sandbox.created_at >= query.created_after)
    for key, value in sorted(query.metadata.items()):
        statement = statement.where(Sandbox.metadata_[key].as_string() == value)
    if query.page_token is not None:
        statement = statement.where(_after(decode_token(project_id, query, query.page_token), query.order))
    if query.order == "desc":
        statement = statement.order_by(Sandbox.created_at.desc(), Sandbox.id.desc())
    else:
        statement = statement.order_by(Sandbox.created_at.asc(), Sandbox.id.asc())
    return statement.limit(query.limit + 1)
