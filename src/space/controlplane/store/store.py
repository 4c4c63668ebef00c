"""The control plane's state store: every read and write of control-plane state goes through `Store`.

`Store` is composed of one repository per record kind (docs/adr/0028-store-repositories.md), all over
ONE `Database` (database.py: one engine, one session factory, one transaction helper, one clock):

    projects.py          ProjectRepository, ApiKeyRepository   orgs, projects, API keys
    sandboxes.py         SandboxRepository                     creating, reading, listing sandboxes
    sandbox_state.py     SandboxStateRepository                compare-and-swap, wishes, failures, crashes
    leases.py            WorkLeaseRepository                   the reconcilers' work leases
    nodes.py             NodeRepository                        register, enrol, re-register, heartbeat
    enrolment_tokens.py  EnrolmentTokenRepository              node enrolment tokens
    snapshots.py         SnapshotRepository                    snapshot records
    idempotency.py       IdempotencyRepository                 Idempotency-Key records
    events.py            SandboxEventRepository                what happened to a sandbox (issue 11)
    leader.py            LeaderLeaseRepository                 once-per-cluster jobs' leader (ADR 0034)
    templates.py         TemplateRepository                    user templates and build logs (ADR 0055)
    credentials/         CredentialStore                       credentials, audit, egress, BYOK keys

Invariants:
- Each public method is one short transaction (the API calls them from a thread pool; the reconciler
  from its loop) and returns frozen records (records.py, built in mapping.py), never ORM objects.
- Repositories share nothing but the Database and call no other repository; what two of them need
  (value checks, digests, the enrolment-token use taken inside an enrolment) lives in a module both
  import, so the package has no import cycles.
- Time comes from the injected clock (aware UTC), so several replicas compare leases and deadlines with
  their own clocks: keep replica clocks in sync (NTP) to well under the lease length.
- Only this package (via errors.py) sees SQLAlchemy exceptions; callers get space.core.errors.
"""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from space.controlplane.store.database import Clock, Database, Repository, utcnow
from space.controlplane.store.engine import make_engine
from space.controlplane.store.enrolment_tokens import EnrolmentTokenRepository
from space.controlplane.store.events import SandboxEventRepository
from space.controlplane.store.idempotency import IdempotencyRepository
from space.controlplane.store.leader import LeaderLeaseRepository
from space.controlplane.store.leases import WorkLeaseRepository
from space.controlplane.store.migrate import migrate
from space.controlplane.store.nodes import NodeRepository
from space.controlplane.store.projects import ApiKeyRepository, ProjectRepository
from space.controlplane.store.sandbox_state import SandboxStateRepository
from space.controlplane.store.sandboxes import SandboxRepository
from space.controlplane.store.snapshots import SnapshotRepository
from space.controlplane.store.templates import TemplateRepository


def open_store(url_or_engine: str | URL | Engine, *, clock: Clock = utcnow) -> Store:
    """Migrate the database to head (safe with concurrent starters), then return a Store on it."""
    store = Store(url_or_engine, clock=clock)
    try:
        migrate(store.engine)
    except BaseException:
        store.close()
        raise
    return store


class Store(
    ProjectRepository,
    ApiKeyRepository,
    SandboxRepository,
    SandboxStateRepository,
    WorkLeaseRepository,
    NodeRepository,
    EnrolmentTokenRepository,
    SnapshotRepository,
    IdempotencyRepository,
    SandboxEventRepository,
    LeaderLeaseRepository,
    TemplateRepository,
    Repository,
):
    """Typed operations on the control plane database: every repository over one Database."""

    def __init__(self, url_or_engine: str | URL | Engine, *, clock: Clock = utcnow) -> None:
        owns_engine = not isinstance(url_or_engine, Engine)
        engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
        super().__init__(Database(engine, clock=clock, owns_engine=owns_engine))
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

    def ping(self) -> None:
        """Raise Unavailable unless the database answers (for /healthz)."""
        with self._tx("checking the database") as session:
            session.execute(text("SELECT 1"))
