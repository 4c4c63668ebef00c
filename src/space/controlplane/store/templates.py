"""Template records (migration 0011, docs/adr/0055-templates-in-the-control-plane.md): a project's templates,
their status (space.core.template_states) and their bounded build logs.

Invariants:
- Every status change is ONE compare-and-swap UPDATE guarded by the status the table allows the event
  from (and, for a build's end, by the driving control plane's lease owner), so two replicas never both
  finish or fail one build, and a build a sweep failed is never made ready afterwards.
- A row is `building` before the node is asked to build, with a lease (owner, until) its driver renews;
  a `building` row whose lease passed has no driver left (its control plane died): `expired_builds`
  finds it and `fail_template` settles it.
- Names are unique per project (the unique constraint decides, so two concurrent builds of one name
  cannot both be recorded: AlreadyExists); the node-level name `tpl-<hex>` is unique over all projects.
- Every read by a project is filtered by that project: another project's template is None (the API's 404).
- A template's log keeps its newest TEMPLATE_LOG_BYTES (line text, UTF-8 counted as characters): older
  lines are deleted in the transaction that appends, `log_truncated` says some were; a line is at most
  TEMPLATE_LOG_LINE characters (longer ones are cut and marked).
- A row is removed (with its log) only from `deleting` (`purge_template`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import and_, delete, func, select, update

from space.controlplane.store.database import Repository
from space.controlplane.store.mapping import template_log_line, template_record
from space.controlplane.store.models import Sandbox, Template, TemplateLog
from space.controlplane.store.records import TemplateLogLine, TemplateRecord
from space.controlplane.store.values import rowcount
from space.core import ids
from space.core.errors import InvalidState, NotFound
from space.core.lifecycle import State
from space.core.template_states import TemplateEvent, TemplateStatus, transition

TEMPLATE_LOG_BYTES: Final = 256 * 1024
TEMPLATE_LOG_LINE: Final = 8 * 1024
_CUT: Final = " [cut]"


def _sources(event: TemplateEvent) -> list[str]:
    """The statuses the table allows `event` from (the guard of its compare-and-swap)."""
    allowed = []
    for status in TemplateStatus:
        try:
            transition(status, event)
        except InvalidState:
            continue
        allowed.append(status.value)
    return allowed


class TemplateRepository(Repository):
    """The templates and template_logs tables."""

    def create_template(
        self,
        project_id: str,
        name: str,
        *,
        spec: dict[str, Any],
        source: str,
        node_id: str | None,
        lease_owner: str,
        lease_s: float,
        template_id: str | None = None,
    ) -> TemplateRecord:
        """A template in status `building`, leased to `lease_owner` for `lease_s` (AlreadyExists: the name is
        taken in the project)."""
        template_id = ids.parse_template_id(template_id) if template_id else ids.new_template_id()
        now = self.now()
        row = Template(
            id=template_id, project_id=project_id, name=ids.parse_template_name(name, field="name"),
            node_name=ids.template_node_name(template_id), status=TemplateStatus.BUILDING.value, spec=spec,
            source=source, node_id=node_id, lease_owner=lease_owner,
            lease_until=now + timedelta(seconds=lease_s), log_bytes=0, log_truncated=False,
            created_at=now, updated_at=now,
        )  # fmt: skip
        with self._tx(f"recording template {name!r}") as session:
            session.add(row)
        return template_record(row)

    def get_template(self, project_id: str, template_id: str) -> TemplateRecord | None:
        with self._tx("reading a template") as session:
            row = session.scalars(
                select(Template).where(Template.id == template_id, Template.project_id == project_id)
            ).one_or_none()
            return template_record(row) if row else None

    def find_template(self, project_id: str, name: str) -> TemplateRecord | None:
        """The project's template of that name (None: no such template in this project)."""
        with self._tx("reading a template") as session:
            row = session.scalars(
                select(Template).where(Template.project_id == project_id, Template.name == name)
            ).one_or_none()
            return template_record(row) if row else None

    def template_by_node_name(self, node_name: str) -> TemplateRecord | None:
        with self._tx("reading a template") as session:
            row = session.scalars(select(Template).where(Template.node_name == node_name)).one_or_none()
            return template_record(row) if row else None

    def list_templates(self, project_id: str) -> list[TemplateRecord]:
        with self._tx("listing templates") as session:
            rows = session.scalars(
                select(Template)
                .where(Template.project_id == project_id)
                .order_by(Template.created_at, Template.id)
            )
            return [template_record(row) for row in rows]

    def renew_template_lease(self, template_id: str, owner: str, lease_s: float) -> bool:
        """Extend a building template's lease; False: it is no longer building under `owner`."""
        now = self.now()
        with self._tx("renewing a template build's lease") as session:
            result = session.execute(
                update(Template)
                .where(Template.id == template_id, Template.status == TemplateStatus.BUILDING.value)
                .where(Template.lease_owner == owner)
                .values(lease_until=now + timedelta(seconds=lease_s), updated_at=now)
            )
            return rowcount(result) == 1

    def move_template_source(
        self, template_id: str, *, expected: str, to: str, owner: str | None = None, lease_s: float = 0.0
    ) -> TemplateRecord | None:
        """A building template's `source` from `expected` to `to` in one swap (the OCI upload's steps:
        awaiting -> uploading -> uploaded); with `owner`, the lease is taken for `lease_s`. None: it was not
        building with that source (another upload won, or it was deleted)."""
        now = self.now()
        values: dict[str, Any] = {"source": to, "updated_at": now}
        if owner is not None:
            values.update(lease_owner=owner, lease_until=now + timedelta(seconds=lease_s))
        with self._tx(f"template {template_id}: source {expected} -> {to}") as session:
            result = session.execute(
                update(Template)
                .where(Template.id == template_id, Template.status == TemplateStatus.BUILDING.value)
                .where(Template.source == expected)
                .values(**values)
            )
            if rowcount(result) != 1:
                return None
            row = session.get(Template, template_id, populate_existing=True)
            return template_record(row) if row else None

    def assign_template_node(self, template_id: str, owner: str, node_id: str) -> TemplateRecord | None:
        """Record the node a building template's build runs on, under `owner`'s lease (None: not so)."""
        with self._tx(f"template {template_id}: build node") as session:
            result = session.execute(
                update(Template)
                .where(Template.id == template_id, Template.status == TemplateStatus.BUILDING.value)
                .where(Template.lease_owner == owner)
                .values(node_id=node_id, updated_at=self.now())
            )
            if rowcount(result) != 1:
                return None
            row = session.get(Template, template_id, populate_existing=True)
            return template_record(row) if row else None

    def finish_template(
        self,
        template_id: str,
        owner: str,
        *,
        node_id: str | None,
        size_bytes: int | None,
        default_user: str | None,
        workdir: str | None,
    ) -> TemplateRecord | None:
        """building -> ready, only under `owner`'s lease (None: someone else settled it first)."""
        return self._swap(
            template_id, TemplateEvent.BUILT, Template.lease_owner == owner,
            node_id=node_id, size_bytes=size_bytes, default_user=default_user, workdir=workdir, error=None,
            lease_owner=None, lease_until=None,
        )  # fmt: skip

    def fail_template(
        self,
        template_id: str,
        error: str,
        *,
        owner: str | None = None,
        expired_before: datetime | None = None,
    ) -> TemplateRecord | None:
        """building -> failed, by its driver (`owner`) or by a sweep (`expired_before`: only if the lease
        passed before then). None: it was not building (or not so)."""
        guard: Any = Template.lease_owner == owner if owner is not None else None
        if expired_before is not None:
            guard = Template.lease_until < expired_before
        return self._swap(
            template_id, TemplateEvent.FAIL, guard, error=error[:4096], lease_owner=None, lease_until=None
        )

    def mark_template_deleting(self, project_id: str, template_id: str) -> TemplateRecord | None:
        """Any status -> deleting (a retry finds it deleting); None: no such template in the project."""
        return self._swap(template_id, TemplateEvent.DELETE, Template.project_id == project_id)

    def _swap(
        self, template_id: str, event: TemplateEvent, guard: Any, **values: Any
    ) -> TemplateRecord | None:
        sources = _sources(event)
        target = transition(sources[0], event)
        assert target is not None  # `deleted` removes the row: purge_template
        now = self.now()
        with self._tx(f"template {template_id}: {event.value}") as session:
            query = update(Template).where(Template.id == template_id, Template.status.in_(sources))
            if guard is not None:
                query = query.where(guard)
            result = session.execute(query.values(status=target.value, updated_at=now, **values))
            if rowcount(result) != 1:
                return None
            row = session.get(Template, template_id, populate_existing=True)
            return template_record(row) if row else None

    def purge_template(self, template_id: str) -> bool:
        """Remove a deleting template and its log (the `deleted` event); False: not deleting (or gone)."""
        with self._tx(f"purging template {template_id}") as session:
            row = session.get(Template, template_id)
            if row is None or row.status != TemplateStatus.DELETING.value:
                return False
            session.execute(delete(TemplateLog).where(TemplateLog.template_id == template_id))
            session.delete(row)
            return True

    def expired_builds(self, now: datetime) -> list[TemplateRecord]:
        """Building templates whose driver's lease passed before `now`: their control plane is gone."""
        with self._tx("finding abandoned template builds") as session:
            rows = session.scalars(
                select(Template).where(
                    and_(Template.status == TemplateStatus.BUILDING.value, Template.lease_until < now)
                )
            )
            return [template_record(row) for row in rows]

    def templates_in_status(self, status: TemplateStatus) -> list[TemplateRecord]:
        """Every project's templates in `status` (the sweep's building and deleting rows)."""
        with self._tx(f"listing {status.value} templates") as session:
            rows = session.scalars(select(Template).where(Template.status == status.value))
            return [template_record(row) for row in rows]

    def sandboxes_of_template(self, project_id: str, node_name: str) -> int:
        """How many of the project's sandboxes (not deleted) were made from the template."""
        with self._tx("counting a template's sandboxes") as session:
            count = session.scalar(
                select(func.count())
                .select_from(Sandbox)
                .where(
                    Sandbox.project_id == project_id,
                    Sandbox.template == node_name,
                    Sandbox.state != State.DELETED.value,
                )
            )
            return int(count or 0)

    # -- the build log -------------------------------------------------------------------------------------
    def append_template_log(self, template_id: str, lines: Sequence[str]) -> None:
        """Append lines (each cut to TEMPLATE_LOG_LINE), then drop the oldest beyond TEMPLATE_LOG_BYTES."""
        if not lines:
            return
        now = self.now()
        cut = [line if len(line) <= TEMPLATE_LOG_LINE else line[:TEMPLATE_LOG_LINE] + _CUT for line in lines]
        added = sum(len(line) for line in cut)
        with self._tx(f"appending to template {template_id}'s log") as session:
            row = session.get(Template, template_id, with_for_update=True)
            if row is None:
                raise NotFound(f"template {template_id} not found")
            session.add_all(TemplateLog(template_id=template_id, at=now, line=line) for line in cut)
            row.log_bytes += added
            if row.log_bytes > TEMPLATE_LOG_BYTES:
                session.flush()
                row.log_bytes -= self._drop_oldest(session, template_id, row.log_bytes - TEMPLATE_LOG_BYTES)
                row.log_truncated = True

    @staticmethod
    def _drop_oldest(session: Any, template_id: str, excess: int) -> int:
        """Delete the oldest lines holding at least `excess` characters; returns how many they held."""
        dropped, last = 0, None
        query = (
            select(TemplateLog.id, func.length(TemplateLog.line))
            .where(TemplateLog.template_id == template_id)
            .order_by(TemplateLog.id)
        )
        for line_id, length in session.execute(query):
            if dropped >= excess:
                break
            dropped, last = dropped + int(length), line_id
        if last is not None:
            session.execute(
                delete(TemplateLog).where(TemplateLog.template_id == template_id, TemplateLog.id <= last)
            )
        return dropped

    def template_log(self, template_id: str, *, after: int = 0, limit: int = 1000) -> list[TemplateLogLine]:
        """Up to `limit` lines of the template's log after line id `after`, oldest first."""
        with self._tx("reading a template's log") as session:
            rows = session.scalars(
                select(TemplateLog)
                .where(TemplateLog.template_id == template_id, TemplateLog.id > after)
                .order_by(TemplateLog.id)
                .limit(limit)
            )
            return [template_log_line(row) for row in rows]
