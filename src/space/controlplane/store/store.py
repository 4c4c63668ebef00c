"""The control plane's state store: every read and write of control-plane state goes through `Store`.

Invariants:
- Each public method is one short transaction (the API calls them from a thread pool; the reconciler
  from its loop) and returns frozen records (records.py), never ORM objects.
- A sandbox's `state` changes only in `transition()`, as a compare-and-swap
  `UPDATE ... WHERE id = :id AND state = :expected AND generation = :gen` that bumps `generation`, after
  space.core.lifecycle.transition() has allowed (expected state, event). A lost race is `Conflict` (the
  caller re-reads and decides again); a refused event is `InvalidState` naming the state. So two writers
  (API replicas, reconcilers, a restarted process replaying a step) can never both move one sandbox.
- `desired_state` is what users asked for; `set_desired` never touches `state` or `generation`.
  Deletion is irrevocable: once desired is `deleted` it cannot be changed back.
- Work is handed out by leases: `claim_work` atomically sets (lease_owner, lease_until) on rows whose lease
  is free or expired, selecting them with `FOR UPDATE SKIP LOCKED` on PostgreSQL and inside a
  BEGIN IMMEDIATE transaction on SQLite, so two claimers never hold the same sandbox at the same time.
  A lease is an optimisation, not a correctness fence: the CAS on (state, generation) still decides.
- Secrets (API keys, node identities, enrolment tokens) are stored only as SHA-256 hex digests; a node's
  RPC token, which the control plane must present, only sealed by the caller (ADR 0021).
- An idempotency record is created by INSERT under the (scope, key) primary key: of concurrent requests
  with one key exactly one gets "new"; the rest see "in_progress" or, once finished, "replay".
- Time comes from the injected clock (aware UTC), so several replicas compare leases and deadlines with
  their own clocks: keep replica clocks in sync (NTP) to well under the lease length.
- Only this package (via errors.py) sees SQLAlchemy exceptions; callers get space.core.errors.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Final, cast, get_args

from sqlalchemy import ColumnElement, Engine, and_, case, delete, func, or_, select, text, tuple_, update
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from space.controlplane.store.database import Clock, Database, utcnow
from space.controlplane.store.digests import (
    API_KEY_DISPLAY_CHARS,
    API_KEY_PREFIX,
    MAX_SECRET_LENGTH,
    hash_secret,
    new_api_key_secret,
)
from space.controlplane.store.digests import new_node_identity as new_node_identity  # noqa: PLC0414  # issue-10-shim
from space.controlplane.store.engine import make_engine
from space.controlplane.store.migrate import migrate
from space.controlplane.store.models import (
    ApiKey,
    EnrolmentToken,
    IdempotencyRecord,
    Node,
    Org,
    Project,
    Sandbox,
    Snapshot,
)
from space.controlplane.store.records import (
    ApiKeyRecord,
    IdempotencyRecordView,
    IdempotentBegin,
    NodeRecord,
    NodeStatus,
    OrgRecord,
    ProjectRecord,
    Role,
    SandboxRecord,
    SnapshotKind,
    SnapshotRecord,
    SnapshotState,
)
from space.controlplane.store.values import aware, seconds
from space.controlplane.store.values import text as text_
from space.core import ids, lifecycle
from space.core.errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    InvalidState,
    NotFound,
    Unauthenticated,
)
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits

# The states a user may ask for; in-progress states and one-shot operations (checkpoint, rollback) are
# not places to be, they are recorded with transition() instead.
DESIRABLE_STATES: Final = frozenset(
    {State.RUNNING, State.PAUSED, State.STOPPED, State.SUSPENDED, State.DELETED}
)

# Columns a caller may set alongside a state change / as an observation. Everything else (ids, project,
# state, generation, lease, timestamps) is owned by the store.
TRANSITION_FIELDS: Final = frozenset(
    {
        "node_id",
        "error",
        "error_permanent",
        "attempts",
        "next_attempt_at",
        "last_activity_at",
        "fork_snapshot_id",
        "expires_at",
        "desired_state",
        *[
            "suspended_snapshot_id",
            "suspended_prefix",
            "recovered_at",
            "recovered_from",
            "crash_count",
            "notice",
            "data_key_id",
        ],
    }
)
OBSERVED_FIELDS: Final = frozenset(
    {
        "node_id",
        "error",
        "error_permanent",
        "attempts",
        "next_attempt_at",
        "last_activity_at",
        "fork_snapshot_id",
        *[
            "suspended_snapshot_id",
            "suspended_prefix",
            "recovered_from",
            "notice",
            "data_key_id",
            "snapshot_policy",
        ],
    }
)
# Snapshot columns Store.update_snapshot may set (kind, sandbox, created_at and state are fixed or owned by
# the state methods).
SNAPSHOT_FIELDS: Final = frozenset(
    {
        "node_id",
        "size_bytes",
        "prefix",
        "uploaded_at",
        "exclusive_bytes",
        "restorable",
        "data_key_id",
        "wrapped_key",
        "error",
        "origin",
    }
)

_IN_PROGRESS_VALUES: Final = tuple(sorted(s.value for s in lifecycle.IN_PROGRESS_STATES))
_ROLES: Final = frozenset(get_args(Role))
_NODE_STATUSES: Final = frozenset(get_args(NodeStatus))
_SNAPSHOT_KINDS: Final = frozenset(get_args(SnapshotKind))


def _org(row: Org) -> OrgRecord:
    return OrgRecord(id=row.id, name=row.name, created_at=row.created_at)


def _project(row: Project) -> ProjectRecord:
    return ProjectRecord(id=row.id, org_id=row.org_id, name=row.name, created_at=row.created_at)


def _api_key(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        project_id=row.project_id,
        org_id=row.org_id,
        role=cast(Role, row.role),
        prefix=row.prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


def _node(row: Node) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        url=row.url,
        capacity=dict(row.capacity),
        used=dict(row.used),
        templates=list(row.templates),
        labels=dict(row.labels),
        status=cast(NodeStatus, row.status),
        last_heartbeat_at=row.last_heartbeat_at,
        registered_at=row.registered_at,
    )


def _sandbox(row: Sandbox) -> SandboxRecord:
    return SandboxRecord(
        id=row.id,
        project_id=row.project_id,
        template=row.template,
        env=dict(row.env),
        limits=SandboxLimits.model_validate(row.limits),
        state=lifecycle.parse_state(row.state),
        desired_state=lifecycle.parse_state(row.desired_state),
        generation=row.generation,
        node_id=row.node_id,
        forked_from=row.forked_from,
        fork_snapshot_id=row.fork_snapshot_id,
        idle_timeout_s=row.idle_timeout_s,
        ttl_s=row.ttl_s,
        expires_at=row.expires_at,
        last_activity_at=row.last_activity_at,
        error=row.error,
        error_permanent=row.error_permanent,
        attempts=row.attempts,
        next_attempt_at=row.next_attempt_at,
        lease_owner=row.lease_owner,
        lease_until=row.lease_until,
        created_at=row.created_at,
        updated_at=row.updated_at,
        deleted_at=row.deleted_at,
        snapshot_policy=dict(row.snapshot_policy) if row.snapshot_policy is not None else None,
        suspended_snapshot_id=row.suspended_snapshot_id,
        suspended_prefix=row.suspended_prefix,
        recovered_at=row.recovered_at,
        recovered_from=row.recovered_from,
        crash_count=row.crash_count or 0,
        notice=row.notice,
        data_key_id=row.data_key_id,
    )


def _snapshot(row: Snapshot) -> SnapshotRecord:
    return SnapshotRecord(
        id=row.id,
        sandbox_id=row.sandbox_id,
        kind=cast(SnapshotKind, row.kind),
        state=cast(SnapshotState, row.state),
        node_id=row.node_id,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        prefix=row.prefix,
        uploaded_at=row.uploaded_at,
        exclusive_bytes=row.exclusive_bytes,
        restorable=bool(row.restorable),
        data_key_id=row.data_key_id,
        wrapped_key=row.wrapped_key,
        error=row.error,
        origin=row.origin,
    )


def _idempotency(row: IdempotencyRecord) -> IdempotencyRecordView:
    return IdempotencyRecordView(
        scope=row.scope,
        key=row.key,
        request_hash=row.request_hash,
        status_code=row.status_code,
        response_body=row.response_body,
        created_at=row.created_at,
    )


def open_store(url_or_engine: str | URL | Engine, *, clock: Clock = utcnow) -> Store:
    """Migrate the database to head (safe with concurrent starters), then return a Store on it."""
    store = Store(url_or_engine, clock=clock)
    try:
        migrate(store.engine)
    except BaseException:
        store.close()
        raise
    return store


class Store:
    """Typed operations on the control plane database; see the module invariants."""

    def __init__(self, url_or_engine: str | URL | Engine, *, clock: Clock = utcnow) -> None:
        owns_engine = not isinstance(url_or_engine, Engine)
        engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
        self.database = Database(engine, clock=clock, owns_engine=owns_engine)
        self.engine: Engine = engine

    def close(self) -> None:
        self.database.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def now(self) -> datetime:
        return self.database.now()

    def _tx(self, what: str) -> AbstractContextManager[Session]:
        """One transaction of the shared Database (database.py)."""
        return self.database.transaction(what)

    def ping(self) -> None:
        """Raise Unavailable unless the database answers (for /healthz)."""
        with self._tx("checking the database") as session:
            session.execute(text("SELECT 1"))

    # ---- orgs, projects -------------------------------------------------------------------------------

    def create_org(self, name: str) -> OrgRecord:
        name = text_(name, "name", 128)
        row = Org(id=ids.new_org_id(), name=name, created_at=self.now())
        with self._tx(f"creating org {name!r}") as session:
            session.add(row)
        return _org(row)

    def get_org(self, org_id: str) -> OrgRecord | None:
        with self._tx("reading an org") as session:
            row = session.get(Org, org_id)
            return _org(row) if row else None

    def get_org_by_name(self, name: str) -> OrgRecord | None:
        with self._tx("reading an org") as session:
            row = session.scalars(select(Org).where(Org.name == name)).one_or_none()
            return _org(row) if row else None

    def create_project(self, org_id: str, name: str) -> ProjectRecord:
        name = text_(name, "name", 128)
        row = Project(id=ids.new_project_id(), org_id=org_id, name=name, created_at=self.now())
        with self._tx(f"creating project {name!r}") as session:
            session.add(row)
        return _project(row)

    def get_project(self, project_id: str) -> ProjectRecord | None:
        with self._tx("reading a project") as session:
            row = session.get(Project, project_id)
            return _project(row) if row else None

    def get_project_by_name(self, org_id: str, name: str) -> ProjectRecord | None:
        with self._tx("reading a project") as session:
            query = select(Project).where(Project.org_id == org_id, Project.name == name)
            row = session.scalars(query).one_or_none()
            return _project(row) if row else None

    def list_projects(self, org_id: str) -> list[ProjectRecord]:
        with self._tx("listing projects") as session:
            query = select(Project).where(Project.org_id == org_id).order_by(Project.created_at, Project.id)
            return [_project(row) for row in session.scalars(query)]

    # ---- API keys -------------------------------------------------------------------------------------

    def create_api_key(self, project_id: str | None, org_id: str, role: Role) -> tuple[ApiKeyRecord, str]:
        """A new key and its secret. The secret is returned here once and never stored."""
        if role not in _ROLES:
            raise InvalidArgument(f"invalid role {role!r}: expected one of {sorted(_ROLES)}", field="role")
        secret = new_api_key_secret()
        row = ApiKey(
            id=ids.new_api_key_id(),
            project_id=project_id,
            org_id=org_id,
            role=role,
            key_hash=hash_secret(secret),
            prefix=secret[:API_KEY_DISPLAY_CHARS],
            created_at=self.now(),
            revoked_at=None,
        )
        with self._tx("creating an API key") as session:
            if project_id is not None:
                project = session.get(Project, project_id)
                if project is None or project.org_id != org_id:
                    raise NotFound(f"project {project_id} not found in org {org_id}")
            session.add(row)
        return _api_key(row), secret

    def authenticate(self, secret: str) -> ApiKeyRecord | None:
        """The live key whose secret this is, or None (unknown, malformed or revoked)."""
        if (
            not isinstance(secret, str)
            or not secret.startswith(API_KEY_PREFIX)
            or len(secret) > MAX_SECRET_LENGTH
        ):
            return None
        digest = hash_secret(secret)
        with self._tx("authenticating an API key") as session:
            row = session.scalars(select(ApiKey).where(ApiKey.key_hash == digest)).one_or_none()
            # The lookup is by a digest of a 240-bit secret, which leaks nothing useful through timing;
            # the final comparison is constant-time anyway so the rule "compare secrets with
            # compare_digest" holds without exceptions.
            if row is None or not hmac.compare_digest(row.key_hash, digest) or row.revoked_at is not None:
                return None
            return _api_key(row)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._tx("reading an API key") as session:
            row = session.get(ApiKey, key_id)
            return _api_key(row) if row else None

    def list_api_keys(self, org_id: str, project_id: str | None = None) -> list[ApiKeyRecord]:
        with self._tx("listing API keys") as session:
            query = select(ApiKey).where(ApiKey.org_id == org_id)
            if project_id is not None:
                query = query.where(ApiKey.project_id == project_id)
            return [_api_key(row) for row in session.scalars(query.order_by(ApiKey.created_at, ApiKey.id))]

    def revoke_key(
        self, key_id: str, *, org_id: str | None = None, project_id: str | None = None
    ) -> ApiKeyRecord:
        """Revoke a key (idempotent: the first revocation time is kept). With org_id/project_id, a key
        outside that scope is NotFound, like an absent one."""
        with self._tx("revoking an API key") as session:
            row = session.get(ApiKey, key_id, with_for_update=True)
            if (
                row is None
                or (org_id is not None and row.org_id != org_id)
                or (project_id is not None and row.project_id != project_id)
            ):
                raise NotFound(f"API key {key_id} not found")
            if row.revoked_at is None:
                row.revoked_at = self.now()
            return _api_key(row)

    # ---- sandboxes: records ---------------------------------------------------------------------------

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
    ) -> SandboxRecord:
        """A new sandbox record in state `pending` (generation 0); the reconciler creates it.

        A fork names its source (`forked_from`, which must be in the same project) and optionally the
        checkpoint to start from; the reconciler then uses the `fork` event instead of `create`."""
        ids.parse_template_name(template)
        env_map = dict(env or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env_map.items()):
            raise InvalidArgument("env must map strings to strings", field="env")
        for value, field in ((idle_timeout_s, "idle_timeout_s"), (ttl_s, "ttl_s")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise InvalidArgument(f"{field} must be a positive integer", field=field)
        desired = lifecycle.parse_state(desired_state)
        if desired not in DESIRABLE_STATES:
            raise InvalidArgument(f"cannot ask for state '{desired}'", field="desired_state")
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
        )
        with self._tx("creating a sandbox") as session:
            if forked_from is not None:
                source = session.get(Sandbox, forked_from)
                if source is None or source.project_id != project_id:
                    raise NotFound(f"sandbox {forked_from} not found")
            session.add(row)
        return _sandbox(row)

    def get_sandbox(self, project_id: str, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox if it exists AND belongs to `project_id`; None otherwise (both mean 404)."""
        with self._tx("reading a sandbox") as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.project_id != project_id:
                return None
            return _sandbox(row)

    def load_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """A sandbox by id alone: for the reconciler and node reports, never for tenant requests."""
        with self._tx("reading a sandbox") as session:
            row = session.get(Sandbox, sandbox_id)
            return _sandbox(row) if row else None

    def list_sandboxes(self, project_id: str, include_deleted: bool = False) -> list[SandboxRecord]:
        query = select(Sandbox).where(Sandbox.project_id == project_id)
        if not include_deleted:
            query = query.where(Sandbox.state != State.DELETED.value)
        with self._tx("listing sandboxes") as session:
            return [_sandbox(row) for row in session.scalars(query.order_by(Sandbox.created_at, Sandbox.id))]

    def list_sandboxes_on_node(self, node_id: str) -> list[SandboxRecord]:
        query = select(Sandbox).where(Sandbox.node_id == node_id, Sandbox.state != State.DELETED.value)
        with self._tx("listing a node's sandboxes") as session:
            return [_sandbox(row) for row in session.scalars(query.order_by(Sandbox.id))]

    # ---- sandboxes: compare-and-swap ------------------------------------------------------------------

    def _conflict(self, session: Session, sandbox_id: str, what: str) -> Conflict | NotFound:
        current = session.get(Sandbox, sandbox_id)
        if current is None:
            return NotFound(f"sandbox {sandbox_id} not found")
        return Conflict(
            f"{what}: sandbox {sandbox_id} changed concurrently (now '{current.state}', "
            f"generation {current.generation})",
            state=current.state,
            generation=current.generation,
        )

    def _update_sandbox(
        self,
        sandbox_id: str,
        conditions: list[ColumnElement[bool]],
        values: dict[str, Any],
        what: str,
    ) -> SandboxRecord:
        """UPDATE one sandbox where `conditions` still hold (the compare of compare-and-swap) and return
        it; Conflict (or NotFound) naming what the row is now if someone else changed it first."""
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, *conditions)
            .values(values)
            .returning(Sandbox)
            .execution_options(synchronize_session=False)
        )
        with self._tx(what) as session:
            row = session.scalars(statement).one_or_none()
            if row is None:
                raise self._conflict(session, sandbox_id, what)
            return _sandbox(row)

    @staticmethod
    def _fields(fields: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
        unknown = set(fields) - allowed
        if unknown:
            # A programming error in the caller, not a user error.
            raise TypeError(f"fields not settable here: {sorted(unknown)}")
        values = dict(fields)
        for name in ("next_attempt_at", "last_activity_at", "expires_at", "recovered_at"):
            if values.get(name) is not None:
                values[name] = aware(values[name], name)
        if "desired_state" in values:
            desired = lifecycle.parse_state(values["desired_state"])
            if desired not in DESIRABLE_STATES:
                raise InvalidArgument(f"cannot ask for state '{desired}'", field="desired_state")
            values["desired_state"] = desired.value
        return values

    def transition(
        self,
        sandbox_id: str,
        expected_state: State | str,
        expected_generation: int,
        event: Event | str,
        **fields: Any,
    ) -> SandboxRecord:
        """Apply `event` to a sandbox believed to be in (expected_state, expected_generation).

        InvalidState if the lifecycle table refuses the event in expected_state (naming that state);
        Conflict if the row is no longer at that (state, generation); NotFound if it does not exist.
        A state change starts a fresh step: attempts, error and error_permanent reset and
        next_attempt_at becomes now, unless given in `fields` (see TRANSITION_FIELDS). Reaching
        `deleted` stamps deleted_at. The lease is left as it is (the holder releases it)."""
        target = lifecycle.transition(expected_state, event)
        current = lifecycle.parse_state(expected_state)
        now = self.now()
        values: dict[str, Any] = {
            "attempts": 0,
            "error": None,
            "error_permanent": False,
            "next_attempt_at": now,
        }
        values.update(self._fields(fields, TRANSITION_FIELDS))
        values.update(state=target.value, generation=Sandbox.generation + 1, updated_at=now)
        if target is State.DELETED:
            values["deleted_at"] = now
        conditions = [Sandbox.state == current.value, Sandbox.generation == expected_generation]
        return self._update_sandbox(
            sandbox_id, conditions, values, f"{lifecycle.parse_event(event)} on sandbox {sandbox_id}"
        )

    def set_desired(
        self, sandbox_id: str, desired_state: State | str, expected_generation: int | None = None
    ) -> SandboxRecord:
        """Record what the user wants; the reconciler makes it so. Does not change state or generation.

        With expected_generation, Conflict unless the sandbox is still at that generation (the API
        passes the generation it validated the request against). Resets the retry bookkeeping (a new
        wish deserves a fresh attempt now). InvalidState if the sandbox is deleted or being deleted
        for good (desired 'deleted' is final)."""
        desired = lifecycle.parse_state(desired_state)
        if desired not in DESIRABLE_STATES:
            raise InvalidArgument(f"cannot ask for state '{desired}'", field="desired_state")
        now = self.now()
        conditions: list[ColumnElement[bool]] = [Sandbox.id == sandbox_id]
        if expected_generation is not None:
            conditions.append(Sandbox.generation == expected_generation)
        if desired is not State.DELETED:
            conditions.append(Sandbox.desired_state != State.DELETED.value)
        conditions.append(Sandbox.state != State.DELETED.value)
        statement = (
            update(Sandbox)
            .where(*conditions)
            .values(
                desired_state=desired.value,
                attempts=0,
                error_permanent=False,
                next_attempt_at=now,
                updated_at=now,
            )
            .returning(Sandbox)
            .execution_options(synchronize_session=False)
        )
        what = f"asking sandbox {sandbox_id} to be {desired}"
        with self._tx(what) as session:
            row = session.scalars(statement).one_or_none()
            if row is not None:
                return _sandbox(row)
            current = session.get(Sandbox, sandbox_id)
            if current is not None and (
                current.state == State.DELETED.value
                or (current.desired_state == State.DELETED.value and desired is not State.DELETED)
            ):
                gone = "deleted" if current.state == State.DELETED.value else "being deleted"
                raise InvalidState(
                    f"cannot ask for '{desired}': sandbox is {gone} (state '{current.state}')",
                    state=current.state,
                    desired_state=current.desired_state,
                )
            raise self._conflict(session, sandbox_id, what)

    def update_observed(
        self, sandbox_id: str, expected_generation: int | None = None, **fields: Any
    ) -> SandboxRecord:
        """Set observation/bookkeeping columns (OBSERVED_FIELDS) without changing state or generation.

        With expected_generation, only if the sandbox is still at that generation (else Conflict): use
        it whenever the value is only true for that step (e.g. node_id chosen for a create)."""
        values = self._fields(fields, OBSERVED_FIELDS)
        values["updated_at"] = self.now()
        conditions = [] if expected_generation is None else [Sandbox.generation == expected_generation]
        return self._update_sandbox(sandbox_id, conditions, values, f"updating sandbox {sandbox_id}")

    def record_failure(
        self,
        sandbox_id: str,
        error: str,
        *,
        retry_in_s: float,
        permanent: bool = False,
        expected_generation: int | None = None,
    ) -> SandboxRecord:
        """A step attempt failed: attempts += 1 (atomically), error recorded, next try after retry_in_s.
        With permanent=True the reconciler stops retrying until the next state change or set_desired."""
        now = self.now()
        conditions = [] if expected_generation is None else [Sandbox.generation == expected_generation]
        values = {
            "attempts": Sandbox.attempts + 1,
            "error": error,
            "error_permanent": permanent,
            "next_attempt_at": now + seconds(retry_in_s, "retry_in_s"),
            "updated_at": now,
        }
        return self._update_sandbox(
            sandbox_id, conditions, values, f"recording a failure of sandbox {sandbox_id}"
        )

    def record_activity(self, sandbox_id: str, at: datetime | None = None) -> None:
        """Move last_activity_at forward to `at` (default now); never backwards, so late reports are
        harmless."""
        when = aware(at, "at") if at is not None else self.now()
        statement = update(Sandbox).where(Sandbox.id == sandbox_id, Sandbox.last_activity_at < when)
        with self._tx("recording sandbox activity") as session:
            session.execute(
                statement.values(last_activity_at=when).execution_options(synchronize_session=False)
            )

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
                idle.append(_sandbox(row))
                if len(idle) >= limit:
                    break
        return idle

    # ---- sandboxes: work leases for the reconciler ----------------------------------------------------

    def _needs_work(self, now: datetime) -> ColumnElement[bool]:
        deleted = State.DELETED.value
        return and_(
            Sandbox.state != deleted,
            Sandbox.next_attempt_at <= now,
            or_(Sandbox.lease_until.is_(None), Sandbox.lease_until <= now),
            or_(
                # A step is in flight (maybe its process died): finish it or fail it.
                Sandbox.state.in_(_IN_PROGRESS_VALUES),
                # Users want something else; unless a step gave up for good on this wish.
                and_(Sandbox.state != Sandbox.desired_state, Sandbox.error_permanent.is_(False)),
                # Time to live is over and nobody has asked for deletion yet.
                and_(
                    Sandbox.expires_at.is_not(None),
                    Sandbox.expires_at <= now,
                    Sandbox.desired_state != deleted,
                ),
            ),
        )

    def claim_work(self, owner: str, limit: int, lease_s: float) -> list[SandboxRecord]:
        """Lease up to `limit` sandboxes that need work to `owner` for `lease_s` seconds.

        A sandbox needs work when a step is in progress, when state != desired_state (and no step gave
        up permanently), or when its TTL expired; and its next_attempt_at has come and its lease is free
        or expired. Oldest next_attempt_at first. Concurrent claimers get disjoint sets."""
        owner = text_(owner, "owner", 128)
        if limit <= 0:
            return []
        now = self.now()
        until = now + seconds(lease_s, "lease_s")
        lease_free = or_(Sandbox.lease_until.is_(None), Sandbox.lease_until <= now)
        candidates = (
            select(Sandbox.id)
            .where(self._needs_work(now))
            .order_by(Sandbox.next_attempt_at, Sandbox.id)
            .limit(limit)
            # PostgreSQL: lock the candidates and skip rows another claimer holds, so claimers never
            # wait on each other. SQLite ignores this; its BEGIN IMMEDIATE already serializes claimers.
            .with_for_update(skip_locked=True)
        )
        with self._tx("claiming work") as session:
            chosen = list(session.scalars(candidates))
            if not chosen:
                return []
            # The lease condition again: the rows are locked now, so this re-check is what makes the
            # claim atomic even if a candidate was claimed between snapshot and lock (READ COMMITTED).
            statement = (
                update(Sandbox)
                .where(Sandbox.id.in_(chosen), lease_free)
                .values(lease_owner=owner, lease_until=until)
                .returning(Sandbox)
                .execution_options(synchronize_session=False)
            )
            rows = list(session.scalars(statement))
            rows.sort(key=lambda r: (r.next_attempt_at, r.id))
            return [_sandbox(row) for row in rows]

    def lease_owners(self) -> list[str]:
        """Owners currently holding unexpired leases."""
        now = self.now()
        query = select(Sandbox.lease_owner).where(Sandbox.lease_owner.is_not(None), Sandbox.lease_until > now)
        with self._tx("listing lease owners") as session:
            return sorted({owner for owner in session.scalars(query.distinct()) if owner})

    def clear_leases(self, owner: str) -> int:
        """Free every lease of `owner` (a process known to be dead), so its work is taken over at once."""
        statement = (
            update(Sandbox)
            .where(Sandbox.lease_owner == owner)
            .values(lease_owner=None, lease_until=None)
            .execution_options(synchronize_session=False)
        )
        with self._tx("clearing a dead owner's leases") as session:
            return _rowcount(session.execute(statement))

    def renew(self, sandbox_id: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease; False if the lease now belongs to someone else (stop working on it)."""
        until = self.now() + seconds(lease_s, "lease_s")
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, Sandbox.lease_owner == owner)
            .values(lease_until=until)
            .execution_options(synchronize_session=False)
        )
        with self._tx("renewing a lease") as session:
            return _rowcount(session.execute(statement)) == 1

    def release(self, sandbox_id: str, owner: str) -> bool:
        """Give the lease back (False if `owner` no longer held it)."""
        statement = (
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, Sandbox.lease_owner == owner)
            .values(lease_owner=None, lease_until=None)
            .execution_options(synchronize_session=False)
        )
        with self._tx("releasing a lease") as session:
            return _rowcount(session.execute(statement)) == 1

    # ---- nodes ----------------------------------------------------------------------------------------

    def register_node(
        self,
        url: str,
        token: str,
        *,
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        identity: str | None = None,
        rpc_token_sealed: bytes | None = None,
    ) -> NodeRecord:
        """Register a node, idempotent by url: a node that registers again (after a restart) keeps its
        id and becomes ready; its token, capacity, templates and labels are replaced. `identity` is the
        per-node secret the caller issued for this registration (only its hash is kept); it replaces the
        previous one, so an identity from an earlier registration stops working (None: none works).

        Trusted and unchecked (operators' tools, tests): the node-facing API enrols with `enrol_node` and
        re-registers with `reregister_node`, which never let one node take another's url (ADR 0021)."""
        url = text_(url, "url", 512)
        token = text_(token, "token", MAX_SECRET_LENGTH)
        if identity is not None:
            identity = text_(identity, "identity", MAX_SECRET_LENGTH)
        for _attempt in range(2):
            now = self.now()
            try:
                with self._tx(f"registering node {url}") as session:
                    row = session.scalars(select(Node).where(Node.url == url).with_for_update()).one_or_none()
                    if row is None:
                        row = Node(id=ids.new_node_id(), url=url, registered_at=now, used={})
                        session.add(row)
                    row.token_hash = hash_secret(token)
                    row.identity_hash = hash_secret(identity) if identity is not None else None
                    row.rpc_token_sealed = rpc_token_sealed
                    row.capacity = dict(capacity or {})
                    row.templates = list(templates)
                    row.labels = dict(labels or {})
                    row.status = "ready"
                    row.last_heartbeat_at = now
                    session.flush()
                    return _node(row)
            except AlreadyExists:
                continue  # a concurrent first registration of the same url won; take its row
        raise Conflict(f"node {url} is being registered concurrently; retry")

    def authenticate_node(self, node_id: str, identity: str) -> NodeRecord | None:
        """The node `node_id` if `identity` is the secret issued at its latest registration, else None
        (hashes compared in constant time; the cluster's bootstrap token is never an identity)."""
        if not isinstance(identity, str) or not identity or len(identity) > MAX_SECRET_LENGTH:
            return None
        digest = hash_secret(identity)
        with self._tx("authenticating a node") as session:
            row = session.get(Node, node_id)
            if row is None or row.identity_hash is None or not hmac.compare_digest(row.identity_hash, digest):
                return None
            return _node(row)

    def node_endpoint(self, node_id: str) -> tuple[str, bytes | None] | None:
        """(url, sealed RPC token) of a node, for the node pool only (ADR 0021); None if not registered."""
        with self._tx("reading a node's endpoint") as session:
            row = session.get(Node, node_id)
            return (row.url, row.rpc_token_sealed) if row is not None else None

    def _url_holder(self, session: Session, url: str) -> Node | None:
        return session.scalars(select(Node).where(Node.url == url).with_for_update()).one_or_none()

    def enrol_node(
        self,
        node_id: str,
        url: str,
        *,
        identity: str,
        seal_rpc_token: Callable[[str], bytes],
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        enrolment_token: str | None = None,
    ) -> NodeRecord:
        """A NEW node (ADR 0021) with id `node_id`: `url` must not be held by any node (AlreadyExists: the
        node that holds it re-registers with its identity, `reregister_node`; nobody takes it over with a
        bootstrap token). The one exception is a record from before per-node RPC tokens (no sealed token,
        its identity was never persisted by its node): the upgraded node at that url adopts it, keeping
        its id. `seal_rpc_token(final node id)` gives the sealed RPC token to store. With
        `enrolment_token`, one use of it is consumed in the same transaction (Unauthenticated if it is
        unknown, expired or used up), so a refused enrolment uses nothing. The identity is kept hashed."""
        ids.parse_node_id(node_id)
        url = text_(url, "url", 512)
        identity = text_(identity, "identity", MAX_SECRET_LENGTH)
        now = self.now()
        with self._tx(f"enrolling node {url}") as session:
            if enrolment_token is not None:
                used = session.execute(
                    update(EnrolmentToken)
                    .where(*self._usable_enrolment(enrolment_token, now))
                    .values(uses=EnrolmentToken.uses + 1, last_used_at=now)
                    .execution_options(synchronize_session=False)
                )
                if _rowcount(used) != 1:
                    raise Unauthenticated("bad node token")
            row = self._url_holder(session, url)
            if row is not None and row.rpc_token_sealed is not None:
                raise AlreadyExists(
                    f"{url} is registered to node {row.id}: that node re-registers with its identity",
                    field="url",
                )
            if row is None:
                # token_hash (ADR 0009) is superseded by rpc_token_sealed: nothing checks it any more.
                row = Node(id=node_id, url=url, registered_at=now, used={}, token_hash="")
                session.add(row)
            row.identity_hash = hash_secret(identity)
            row.rpc_token_sealed = bytes(seal_rpc_token(row.id))
            row.capacity = dict(capacity or {})
            row.templates = list(templates)
            row.labels = dict(labels or {})
            row.status = "ready"
            row.last_heartbeat_at = now
            session.flush()
            return _node(row)

    def reregister_node(
        self,
        node_id: str,
        identity: str,
        url: str,
        *,
        rpc_token_sealed: bytes,
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
    ) -> NodeRecord | None:
        """An EXISTING node registers again (a restart, a new address): it must present the identity of
        its enrolment (None if it does not: the caller answers 401). It keeps its id and identity and
        becomes ready; its url, RPC token, capacity and templates are replaced. A url held by another node
        is AlreadyExists."""
        url = text_(url, "url", 512)
        if not isinstance(identity, str) or not identity or len(identity) > MAX_SECRET_LENGTH:
            return None
        digest = hash_secret(identity)
        now = self.now()
        with self._tx(f"re-registering node {node_id}") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None or row.identity_hash is None or not hmac.compare_digest(row.identity_hash, digest):
                return None
            if row.url != url:
                holder = self._url_holder(session, url)
                if holder is not None:
                    raise AlreadyExists(f"{url} is registered to node {holder.id}", field="url")
                row.url = url
            row.rpc_token_sealed = bytes(rpc_token_sealed)
            row.capacity = dict(capacity or {})
            row.templates = list(templates)
            row.status = "ready" if row.status == "lost" else row.status
            row.last_heartbeat_at = now
            session.flush()
            return _node(row)

    @staticmethod
    def _usable_enrolment(secret: str, now: datetime) -> list[ColumnElement[bool]]:
        return [
            EnrolmentToken.token_hash == hash_secret(secret),
            EnrolmentToken.uses < EnrolmentToken.max_uses,
            or_(EnrolmentToken.expires_at.is_(None), EnrolmentToken.expires_at > now),
        ]

    def create_enrolment_token(self, *, uses: int = 1, ttl_s: float | None = None) -> tuple[str, str]:
        """(id, secret) of a new enrolment token good for `uses` enrolments (within `ttl_s` seconds if
        given). The secret is answered once; only its SHA-256 is kept."""
        if not isinstance(uses, int) or not 1 <= uses <= 10_000:
            raise InvalidArgument("uses must be 1 to 10000", field="uses")
        now = self.now()
        expires = now + seconds(ttl_s, "ttl_s") if ttl_s is not None else None
        secret = "enrol_" + secrets.token_urlsafe(30)
        token_id = "enrol-" + secrets.token_hex(10)
        with self._tx("creating an enrolment token") as session:
            session.add(
                EnrolmentToken(
                    id=token_id, token_hash=hash_secret(secret), max_uses=uses, uses=0, expires_at=expires,
                    created_at=now, last_used_at=None,
                )
            )  # fmt: skip
        return token_id, secret

    def enrolment_token_usable(self, secret: str) -> bool:
        """Whether `secret` is an enrolment token with a use left (a check before a request body is read;
        the use itself is taken by enrol_node)."""
        if not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_LENGTH:
            return False
        with self._tx("checking an enrolment token") as session:
            found = session.scalars(
                select(EnrolmentToken.id).where(*self._usable_enrolment(secret, self.now()))
            ).first()
            return found is not None

    def get_node(self, node_id: str) -> NodeRecord | None:
        with self._tx("reading a node") as session:
            row = session.get(Node, node_id)
            return _node(row) if row else None

    def heartbeat(
        self,
        node_id: str,
        *,
        used: Mapping[str, Any],
        templates: Sequence[str] | None = None,
        activity: Mapping[str, datetime] | None = None,
        capacity: Mapping[str, Any] | None = None,
    ) -> NodeRecord:
        """A node's periodic report: resource use, templates present, and per-sandbox last activity
        (applied only to sandboxes assigned to this node, never moving backwards). A lost node that
        reports again is ready; a draining one stays draining. NotFound: register again."""
        now = self.now()
        with self._tx(f"heartbeat of node {node_id}") as session:
            statement = (
                update(Node)
                .where(Node.id == node_id)
                .values(
                    used=dict(used),
                    last_heartbeat_at=now,
                    status=case((Node.status == "lost", "ready"), else_=Node.status),
                    **({"templates": list(templates)} if templates is not None else {}),
                    **({"capacity": dict(capacity)} if capacity is not None else {}),
                )
                .returning(Node)
                .execution_options(synchronize_session=False)
            )
            row = session.scalars(statement).one_or_none()
            if row is None:
                raise NotFound(f"node {node_id} not registered")
            for sandbox_id, at in sorted((activity or {}).items()):
                when = aware(at, "activity")
                session.execute(
                    update(Sandbox)
                    .where(
                        Sandbox.id == sandbox_id,
                        Sandbox.node_id == node_id,
                        Sandbox.last_activity_at < when,
                    )
                    .values(last_activity_at=when)
                    .execution_options(synchronize_session=False)
                )
            return _node(row)

    def set_node_status(self, node_id: str, status: NodeStatus) -> NodeRecord:
        if status not in _NODE_STATUSES:
            raise InvalidArgument(f"invalid node status {status!r}", field="status")
        with self._tx(f"setting node {node_id} {status}") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None:
                raise NotFound(f"node {node_id} not registered")
            row.status = status
            return _node(row)

    def mark_lost(self, older_than_s: float) -> list[str]:
        """Mark nodes whose last heartbeat is older than `older_than_s` lost; return their ids (only
        the ones this call changed, so exactly one caller acts on each loss)."""
        cutoff = self.now() - seconds(older_than_s, "older_than_s")
        statement = (
            update(Node)
            .where(Node.status.in_(("ready", "draining")), Node.last_heartbeat_at < cutoff)
            .values(status="lost")
            .returning(Node.id)
            .execution_options(synchronize_session=False)
        )
        with self._tx("marking lost nodes") as session:
            return sorted(session.scalars(statement))

    def list_nodes(self, status: NodeStatus | None = "ready") -> list[NodeRecord]:
        """Nodes with `status` (default: ready ones, for the scheduler); None lists all."""
        query = select(Node)
        if status is not None:
            query = query.where(Node.status == status)
        with self._tx("listing nodes") as session:
            return [_node(row) for row in session.scalars(query.order_by(Node.registered_at, Node.id))]

    # ---- snapshots ------------------------------------------------------------------------------------

    def create_snapshot(
        self,
        sandbox_id: str,
        kind: SnapshotKind,
        node_id: str | None = None,
        *,
        snapshot_id: str | None = None,
        **fields: Any,
    ) -> SnapshotRecord:
        """A snapshot record in state `creating` (written before the side effect starts); `fields` are
        SNAPSHOT_FIELDS (prefix, data key, origin ...)."""
        if kind not in _SNAPSHOT_KINDS:
            raise InvalidArgument(f"invalid snapshot kind {kind!r}", field="kind")
        row = Snapshot(
            id=ids.parse_snapshot_id(snapshot_id) if snapshot_id else ids.new_snapshot_id(),
            sandbox_id=sandbox_id,
            kind=kind,
            state="creating",
            node_id=node_id,
            size_bytes=None,
            created_at=self.now(),
            restorable=False,
        )
        for name, value in self._fields(fields, SNAPSHOT_FIELDS).items():
            setattr(row, name, value)
        with self._tx(f"creating a snapshot of sandbox {sandbox_id}") as session:
            session.add(row)
        return _snapshot(row)

    def get_snapshot(self, snapshot_id: str, *, project_id: str | None = None) -> SnapshotRecord | None:
        """The snapshot; with project_id, None unless its sandbox belongs to that project."""
        with self._tx("reading a snapshot") as session:
            query = select(Snapshot).where(Snapshot.id == snapshot_id)
            if project_id is not None:
                query = query.join(Sandbox, Sandbox.id == Snapshot.sandbox_id).where(
                    Sandbox.project_id == project_id
                )
            row = session.scalars(query).one_or_none()
            return _snapshot(row) if row else None

    def list_snapshots(self, sandbox_id: str, *, include_deleting: bool = False) -> list[SnapshotRecord]:
        query = select(Snapshot).where(Snapshot.sandbox_id == sandbox_id)
        if not include_deleting:
            query = query.where(Snapshot.state != "deleting")
        with self._tx("listing snapshots") as session:
            rows = session.scalars(query.order_by(Snapshot.created_at, Snapshot.id))
            return [_snapshot(row) for row in rows]

    def mark_snapshot_ready(
        self, snapshot_id: str, size_bytes: int | None = None, *, node_id: str | None = None
    ) -> SnapshotRecord:
        """creating -> ready (idempotent when already ready); Conflict if it is being deleted."""
        with self._tx(f"marking snapshot {snapshot_id} ready") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            if row.state == "deleting":
                raise Conflict(f"snapshot {snapshot_id} is being deleted", state=row.state)
            if row.state == "creating":
                row.state = "ready"
                row.size_bytes = size_bytes
                if node_id is not None:
                    row.node_id = node_id
            return _snapshot(row)

    def update_snapshot(self, snapshot_id: str, **fields: Any) -> SnapshotRecord:
        """Set SNAPSHOT_FIELDS of a snapshot (where its copies are, sizes, errors); NotFound if absent."""
        values = self._fields(fields, SNAPSHOT_FIELDS)
        if values.get("uploaded_at") is not None:
            values["uploaded_at"] = aware(values["uploaded_at"], "uploaded_at")
        with self._tx(f"updating snapshot {snapshot_id}") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            for name, value in values.items():
                setattr(row, name, value)
            return _snapshot(row)

    def delete_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """Mark the snapshot `deleting` (idempotent); the reconciler removes its data, then purges it."""
        with self._tx(f"deleting snapshot {snapshot_id}") as session:
            row = session.get(Snapshot, snapshot_id, with_for_update=True)
            if row is None:
                raise NotFound(f"snapshot {snapshot_id} not found")
            row.state = "deleting"
            return _snapshot(row)

    def delete_snapshots_of(self, sandbox_id: str) -> int:
        """Mark every snapshot of a sandbox `deleting` (the sandbox is being deleted)."""
        statement = (
            update(Snapshot)
            .where(Snapshot.sandbox_id == sandbox_id, Snapshot.state != "deleting")
            .values(state="deleting")
            .execution_options(synchronize_session=False)
        )
        with self._tx(f"deleting the snapshots of sandbox {sandbox_id}") as session:
            return _rowcount(session.execute(statement))

    def forget_node_snapshots(self, sandbox_id: str, node_id: str) -> int:
        """The sandbox left `node_id` (suspended, or recovered elsewhere) and its copies there go with it:
        snapshots with a verified object-storage copy now live there only (node_id cleared); the others
        are marked `deleting`. Returns how many rows changed."""
        uploaded = and_(Snapshot.restorable.is_(True), Snapshot.prefix.is_not(None))
        base = [Snapshot.sandbox_id == sandbox_id, Snapshot.node_id == node_id]
        with self._tx(f"forgetting the snapshots of sandbox {sandbox_id} on node {node_id}") as session:
            moved = session.execute(
                update(Snapshot)
                .where(*base, uploaded)
                .values(node_id=None)
                .execution_options(synchronize_session=False)
            )
            dropped = session.execute(
                update(Snapshot)
                .where(*base, ~uploaded, Snapshot.state != "deleting")
                .values(state="deleting")
                .execution_options(synchronize_session=False)
            )
            return _rowcount(moved) + _rowcount(dropped)

    def list_deleting_snapshots(self, limit: int = 100) -> list[SnapshotRecord]:
        query = (
            select(Snapshot).where(Snapshot.state == "deleting").order_by(Snapshot.created_at).limit(limit)
        )
        with self._tx("listing snapshots to delete") as session:
            return [_snapshot(row) for row in session.scalars(query)]

    def purge_snapshot(self, snapshot_id: str) -> bool:
        """Remove the record of a `deleting` snapshot whose data is gone (False if nothing to remove)."""
        statement = delete(Snapshot).where(Snapshot.id == snapshot_id, Snapshot.state == "deleting")
        with self._tx(f"purging snapshot {snapshot_id}") as session:
            return _rowcount(session.execute(statement)) == 1

    # ---- idempotency ----------------------------------------------------------------------------------

    def begin_idempotent(
        self, scope: str, key: str, request_hash: str, *, stale_after_s: float | None = None
    ) -> IdempotentBegin:
        """Start (or find) the request with Idempotency-Key `key` in `scope` (a project or key id).

        Conflict if the key was used with another request_hash. With stale_after_s, an in-progress
        record older than that (its request died with its process) is taken over and reported "new"."""
        scope = text_(scope, "scope", 64)
        key = text_(key, "idempotency key", 128)
        request_hash = text_(request_hash, "request_hash", 64)
        for _attempt in range(3):
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
                return IdempotentBegin("new", _idempotency(row))
            except AlreadyExists:
                pass
            with self._tx("reading an idempotency key") as session:
                existing = session.get(IdempotencyRecord, (scope, key), with_for_update=True)
                if existing is None:
                    continue  # purged or abandoned in between: try to insert again
                view = _idempotency(existing)
                if not hmac.compare_digest(existing.request_hash, request_hash):
                    raise Conflict("this Idempotency-Key was already used with a different request", key=key)
                if existing.status_code is not None:
                    return IdempotentBegin("replay", view, existing.status_code, existing.response_body)
                if stale_after_s is not None and existing.created_at <= now - seconds(
                    stale_after_s, "stale_after_s"
                ):
                    # Row lock held (FOR UPDATE / BEGIN IMMEDIATE): only one taker wins the takeover.
                    existing.created_at = now
                    return IdempotentBegin("new", _idempotency(existing))
                return IdempotentBegin("in_progress", view)
        raise Conflict("this Idempotency-Key is changing concurrently; retry", key=key)

    def touch_idempotent(self, scope: str, key: str) -> bool:
        """The request holding an in-progress key is still alive: push its staleness horizon forward."""
        statement = (
            update(IdempotencyRecord)
            .where(
                IdempotencyRecord.scope == scope,
                IdempotencyRecord.key == key,
                IdempotencyRecord.status_code.is_(None),
            )
            .values(created_at=self.now())
            .execution_options(synchronize_session=False)
        )
        with self._tx("refreshing an idempotent request") as session:
            return _rowcount(session.execute(statement)) == 1

    def finish_idempotent(self, scope: str, key: str, status_code: int, body: Any) -> None:
        """Store the answer of the request begun with "new"; later begins replay it."""
        statement = (
            update(IdempotencyRecord)
            .where(
                IdempotencyRecord.scope == scope,
                IdempotencyRecord.key == key,
                IdempotencyRecord.status_code.is_(None),
            )
            .values(status_code=status_code, response_body=body)
            .execution_options(synchronize_session=False)
        )
        with self._tx("finishing an idempotent request") as session:
            if _rowcount(session.execute(statement)) == 1:
                return
            if session.get(IdempotencyRecord, (scope, key)) is None:
                raise NotFound(f"idempotency key {key!r} not found")
            raise Conflict(f"idempotency key {key!r} already finished", key=key)

    def abandon_idempotent(self, scope: str, key: str) -> bool:
        """Forget an in-progress key whose request failed in a way not worth replaying (e.g. a 5xx), so
        the client's retry runs again. Finished records are kept."""
        statement = delete(IdempotencyRecord).where(
            IdempotencyRecord.scope == scope,
            IdempotencyRecord.key == key,
            IdempotencyRecord.status_code.is_(None),
        )
        with self._tx("abandoning an idempotent request") as session:
            return _rowcount(session.execute(statement)) == 1

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
            return _rowcount(session.execute(statement))

    # ---- crash reports, snapshot policy ---------------------------------------------------------------

    def report_crash(
        self, sandbox_id: str, node_id: str | None, *, notice: str, observed_at: datetime | None = None
    ) -> SandboxRecord | None:
        """A runtime died (or its node was lost): live -> crashed by compare-and-swap, crash_count + 1.

        Applies only while the sandbox is in a live state on `node_id` (None: any node) and, with
        `observed_at`, only if the record did not change after that observation (a late heartbeat must
        not undo a recovery that finished after it was assembled). None when nothing changed."""
        live = tuple(sorted(s.value for s in lifecycle.LIVE_STATES))
        with self._tx(f"reporting a crash of sandbox {sandbox_id}") as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.state not in live or (node_id is not None and row.node_id != node_id):
                return None
            if observed_at is not None and row.updated_at > aware(observed_at, "observed_at"):
                return None
            state, generation, crashes = row.state, row.generation, row.crash_count or 0
        try:
            return self.transition(
                sandbox_id, state, generation, Event.CRASH, crash_count=crashes + 1, notice=notice
            )
        except (Conflict, InvalidState, NotFound):
            return None  # moved meanwhile: whoever moved it decides

    def list_sandboxes_with_policy(self, limit: int = 1000) -> list[SandboxRecord]:
        """Running sandboxes that have a snapshot policy (for the snapshot scheduler)."""
        query = (
            select(Sandbox)
            .where(Sandbox.state == State.RUNNING.value, Sandbox.snapshot_policy.is_not(None))
            .order_by(Sandbox.id)
            .limit(limit)
        )
        with self._tx("listing sandboxes with a snapshot policy") as session:
            return [_sandbox(row) for row in session.scalars(query)]

    def list_sandboxes_in_states(self, states: Sequence[State], limit: int = 1000) -> list[SandboxRecord]:
        query = (
            select(Sandbox)
            .where(Sandbox.state.in_([lifecycle.parse_state(s).value for s in states]))
            .order_by(Sandbox.id)
            .limit(limit)
        )
        with self._tx("listing sandboxes by state") as session:
            return [_sandbox(row) for row in session.scalars(query)]

    # ---- maintenance ----------------------------------------------------------------------------------

    def count_sandboxes(self, project_id: str) -> int:
        """Live (not deleted) sandboxes of a project, for quotas."""
        query = select(func.count()).where(
            Sandbox.project_id == project_id, Sandbox.state != State.DELETED.value
        )
        with self._tx("counting sandboxes") as session:
            return int(session.scalar(query) or 0)


def _rowcount(result: Any) -> int:
    # CursorResult.rowcount; Session.execute is typed as returning Result, which lacks it.
    return int(result.rowcount)
