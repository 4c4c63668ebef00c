"""Sandbox records: creation and every read and listing of sandboxes.

Invariants:
- A sandbox is created in state `pending` at generation 0 with its retry clock at "now"; its state then
  changes only through sandbox_state.py (compare-and-swap on (state, generation)).
- A fork names a source in the SAME project (else NotFound, like an absent one); `forked_from` carries
  no foreign key (the source may become a tombstone while the fork lives on).
- Tenant reads (`get_sandbox`) are scoped by project: a sandbox of another project is None, exactly like
  an absent one. `load_sandbox` (by id alone) is for the reconciler and node reports only.
- Rows are never deleted: a deleted sandbox is a tombstone in state `deleted`; listings leave tombstones
  out unless asked.
- Metadata obeys space.core.sandbox_options (checked here, whoever calls); a fork that is given no
  metadata or on_timeout of its own takes its source's, read in the transaction that creates it.
- A sandbox's isolation (space.core.isolation) is fixed at create: a fork (and a sandbox from a snapshot,
  which is one) always has its source's; asking a fork for another one is InvalidArgument.
- A tenant's page of sandboxes (`page_sandboxes`) is filtered, ordered and cut in SQL
  (sandbox_listing.py), never by loading the project's rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import Text, cast, func, select

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import sandbox_record
from space.controlplane.store.models import Sandbox
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandbox_listing import (
    SandboxPage,
    SandboxQuery,
    checked_query,
    encode_token,
    page_statement,
)
from space.core import ids, lifecycle
from space.core.errors import InvalidArgument, NotFound
from space.core.isolation import DEFAULT as DEFAULT_ISOLATION
from space.core.isolation import Isolation, parse_isolation
from space.core.lifecycle import State
from space.core.sandbox_options import OnTimeout, check_metadata, parse_on_timeout, timeout_seconds
from space.core.settings import SandboxLimits

# The states a user may ask for; in-progress states and one-shot operations (checkpoint, rollback) are
# not places to be, they are recorded with transition() instead.
DESIRABLE_STATES: Final = frozenset(
    {State.RUNNING, State.PAUSED, State.STOPPED, State.SUSPENDED, State.DELETED}
)


def desirable(value: State | str) -> State:
    """The state `value` names, if a user may ask for it (else InvalidArgument)."""
    desired = lifecycle.parse_state(value)
    if desired not in DESIRABLE_STATES:
        raise InvalidArgument(f"cannot ask for state '{desired}'", field="desired_state")
    return desired


def _check_env_and_timeouts(env: Mapping[str, str], idle_timeout_s: int | None, ttl_s: int | None) -> None:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidArgument("env must map strings to strings", field="env")
    if idle_timeout_s is not None and (
        isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, int) or idle_timeout_s <= 0
    ):
        raise InvalidArgument("idle_timeout_s must be a positive integer", field="idle_timeout_s")
    if ttl_s is not None:
        timeout_seconds(ttl_s, "ttl_s", allow_zero=False)


class SandboxRepository(Repository):
    """Creating, reading and listing sandboxes."""

    def create_sandbox(
        self,
        project_id: str,
        template: str,
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
        *,
        idle_timeout_s: int | None = None,
        ttl_s: int | None = None,
        forked_from: str | None = None,
        fork_snapshot_id: str | None = None,
        desired_state: State = State.RUNNING,
        sandbox_id: str | None = None,
        snapshot_policy: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        on_timeout: OnTimeout | None = None,
        isolation: Isolation | None = None,
    ) -> SandboxRecord:
        """A new sandbox record in state `pending` (generation 0); the reconciler creates it.

        A fork names its source (`forked_from`, which must be in the same project) and optionally the
        checkpoint to start from; the reconciler then uses the `fork` event instead of `create`. Its
        metadata and on_timeout are its source's unless given (None), its isolation always is; a new
        sandbox's isolation is `isolation` (None: the default, gVisor)."""
        ids.parse_template_name(template)
        env_map = dict(env or {})
        _check_env_and_timeouts(env_map, idle_timeout_s, ttl_s)
        labels = check_metadata(metadata) if metadata is not None else None
        when_expired = parse_on_timeout(on_timeout) if on_timeout is not None else None
        chosen = parse_isolation(isolation) if isolation is not None else None
        desired = desirable(desired_state)
        now = self.now()
        row = Sandbox(
            id=ids.parse_sandbox_id(sandbox_id) if sandbox_id else ids.new_sandbox_id(),
            project_id=project_id,
            template=template,
            env=env_map,
            limits=(limits or SandboxLimits()).model_dump(mode="json"),
            state=lifecycle.INITIAL_STATE.value,
            desired_state=desired.value,
            generation=0,
            node_id=None,
            forked_from=forked_from,
            fork_snapshot_id=fork_snapshot_id,
            idle_timeout_s=idle_timeout_s,
            ttl_s=ttl_s,
            expires_at=now + timedelta(seconds=ttl_s) if ttl_s else None,
            last_activity_at=now,
            error=None,
            error_permanent=False,
            attempts=0,
            next_attempt_at=now,
            lease_owner=None,
            lease_until=None,
            created_at=now,
            updated_at=now,
            deleted_at=None,
            snapshot_policy=dict(snapshot_policy) if snapshot_policy is not None else None,
            crash_count=0,
            metadata_=labels or {},
            on_timeout=when_expired or "delete",
            isolation=chosen or DEFAULT_ISOLATION,
        )
        with self._tx("creating a sandbox") as session:
            if forked_from is not None:
                source = session.get(Sandbox, forked_from)
                if source is None or source.project_id != project_id:
                    raise NotFound(f"sandbox {forked_from} not found")
                if labels is None:
                    row.metadata_ = dict(source.metadata_ or {})
                if when_expired is None:
                    row.on_timeout = source.on_timeout
                if chosen is not None and chosen != source.isolation:
                    raise InvalidArgument(
                        f"a fork has its source's isolation ({source.isolation})", field="isolation"
                    )
                row.isolation = source.isolation
            session.add(row)
        return sandbox_record(row)

    def get_sandbox(self, project_id: str, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox if it exists AND belongs to `project_id`; None otherwise (both mean 404)."""
        with self._tx("reading a sandbox") as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.project_id != project_id:
                return None
            return sandbox_record(row)

    def load_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """A sandbox by id alone: for the reconciler and node reports, never for tenant requests."""
        with self._tx("reading a sandbox") as session:
            row = session.get(Sandbox, sandbox_id)
            return sandbox_record(row) if row else None

    def list_sandboxes(self, project_id: str, include_deleted: bool = False) -> list[SandboxRecord]:
        query = select(Sandbox).where(Sandbox.project_id == project_id)
        if not include_deleted:
            query = query.where(Sandbox.state != State.DELETED.value)
        with self._tx("listing sandboxes") as session:
            rows = session.scalars(query.order_by(Sandbox.created_at, Sandbox.id))
            return [sandbox_record(row) for row in rows]

    def page_sandboxes(self, project_id: str, query: SandboxQuery) -> SandboxPage:
        """One page of `project_id`'s sandboxes that match `query` (sandbox_listing.py): at most
        query.limit, with a token for the next page when there is one. InvalidArgument (naming the
        field) for a bad filter, limit or page token."""
        query = checked_query(query)
        statement = page_statement(project_id, query)
        with self._tx("listing sandboxes") as session:
            rows = [sandbox_record(row) for row in session.scalars(statement)]
        if len(rows) <= query.limit:
            return SandboxPage(sandboxes=rows, next_page_token=None)
        page = rows[: query.limit]
        return SandboxPage(sandboxes=page, next_page_token=encode_token(project_id, query, page[-1]))

    def list_sandboxes_on_node(self, node_id: str) -> list[SandboxRecord]:
        query = select(Sandbox).where(Sandbox.node_id == node_id, Sandbox.state != State.DELETED.value)
        with self._tx("listing a node's sandboxes") as session:
            return [sandbox_record(row) for row in session.scalars(query.order_by(Sandbox.id))]

    def placed_disk_mb(self, node_id: str, *, besides: str | None = None) -> int:
        """The disk_mb of every sandbox recorded on `node_id` (any state but deleted: a stopped or paused
        sandbox keeps its disk), leaving out `besides`. Reads two columns, never whole records: the
        scheduler asks this for every candidate node of every placement."""
        query = select(Sandbox.id, Sandbox.limits).where(
            Sandbox.node_id == node_id, Sandbox.state != State.DELETED.value
        )
        default = SandboxLimits().disk_mb
        with self._tx("summing a node's placed disk") as session:
            rows = session.execute(query).all()
        return sum(int(limits.get("disk_mb", default)) for row_id, limits in rows if row_id != besides)

    def list_idle_sandboxes(self, limit: int = 500) -> list[SandboxRecord]:
        """Running sandboxes with an idle timeout whose last activity is older than it (the reconciler
        then asks for `paused` or `suspended` by policy). The deadline is computed in Python because
        interval arithmetic is not portable SQL; the scan covers running sandboxes with a timeout only."""
        now = self.now()
        query = (
            select(Sandbox)
            .where(Sandbox.state == State.RUNNING.value, Sandbox.idle_timeout_s.is_not(None))
            .where(Sandbox.desired_state == State.RUNNING.value)
            .order_by(Sandbox.last_activity_at)
        )
        idle: list[SandboxRecord] = []
        with self._tx("listing idle sandboxes") as session:
            for row in session.scalars(query):
                timeout = row.idle_timeout_s or 0
                if row.last_activity_at + timedelta(seconds=timeout) > now:
                    continue  # not idle yet (a later row with a shorter timeout may be)
                idle.append(sandbox_record(row))
                if len(idle) >= limit:
                    break
        return idle

    def list_sandboxes_with_policy(self, limit: int = 1000) -> list[SandboxRecord]:
        """Running sandboxes that have a snapshot policy (for the snapshot scheduler)."""
        query = (
            select(Sandbox)
            .where(
                Sandbox.state == State.RUNNING.value,
                Sandbox.snapshot_policy.is_not(None),
                # Rows written before the column stored SQL NULL hold the JSON document `null`.
                cast(Sandbox.snapshot_policy, Text) != "null",
            )
            .order_by(Sandbox.id)
            .limit(limit)
        )
        with self._tx("listing sandboxes with a snapshot policy") as session:
            return [sandbox_record(row) for row in session.scalars(query)]

    def list_sandboxes_in_states(self, states: Sequence[State], limit: int = 1000) -> list[SandboxRecord]:
        query = (
            select(Sandbox)
            .where(Sandbox.state.in_([lifecycle.parse_state(s).value for s in states]))
            .order_by(Sandbox.id)
            .limit(limit)
        )
        with self._tx("listing sandboxes by state") as session:
            return [sandbox_record(row) for row in session.scalars(query)]

    def count_sandboxes(self, project_id: str) -> int:
        """Live (not deleted) sandboxes of a project, for quotas."""
        query = select(func.count()).where(
            Sandbox.project_id == project_id, Sandbox.state != State.DELETED.value
        )
        with self._tx("counting sandboxes") as session:
            return int(session.scalar(query) or 0)
