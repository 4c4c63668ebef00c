"""Schema migrations, run programmatically at control-plane start.

Invariants:
- `migrate(url)` brings the database to the newest revision and is idempotent: at head it changes nothing.
- The whole upgrade runs in ONE transaction. On PostgreSQL (transactional DDL) that transaction first takes
  a transaction-scoped advisory lock, so when several control-plane replicas start at once exactly one
  upgrades and the others wait, then find the database at head. On SQLite the transaction begins
  IMMEDIATE (see engine.py), which serializes concurrent starters the same way.
- Migration scripts import column types from store.types, never the models: a migration must keep
  describing the schema of its own revision after the models move on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import pathlib
from collections.abc import Callable, Iterator
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import URL

from space.controlplane.store.engine import make_engine
from space.controlplane.store.errors import translate_db_errors

log = logging.getLogger(__name__)
MIGRATIONS_DIR: Final = pathlib.Path(__file__).resolve().parent / "migrations"
# An arbitrary constant that names "the SPACE schema migration" among PostgreSQL advisory locks.
ADVISORY_LOCK_KEY: Final = 0x5350414345_01  # "SPACE", 1


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001
        raise RuntimeError("no migrations found")
    return head


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


@contextlib.contextmanager
def _sqlite_file_lock(engine: Engine) -> Iterator[None]:
    """SQLite: migrations of one database file run one at a time (a lock file beside it), so a second
    process waits for the first instead of timing out on the database lock during a long upgrade."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    with open(f"{database}.migrate.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_locked(url_or_engine: str | URL | Engine, what: str, step: Callable[[Config], None]) -> None:
    owned = not isinstance(url_or_engine, Engine)
    engine = make_engine(url_or_engine) if not isinstance(url_or_engine, Engine) else url_or_engine
    try:
        with translate_db_errors(what), _sqlite_file_lock(engine), engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
            step(alembic_config(connection))
    finally:
        if owned:
            engine.dispose()


def migrate(url_or_engine: str | URL | Engine, revision: str = "head") -> bool:
    """Upgrade the database at `url_or_engine` to `revision` (default: head). Safe to run concurrently.
    True when this call changed the schema; it logs which (the one replica of several started together
    that migrated says so, the others find the schema there: an upgrade's logs show it ran once)."""
    seen: list[str | None] = []

    def upgrade(config: Config) -> None:
        connection: Connection = config.attributes["connection"]
        seen.append(current_revision(connection))
        command.upgrade(config, revision)
        seen.append(current_revision(connection))

    _run_locked(url_or_engine, "migrating the control plane database", upgrade)
    before, after = seen
    if before != after:
        log.info("database schema migrated from %s to %s", before or "empty", after)
    else:
        log.info("database schema already at %s: nothing to migrate", after)
    return before != after


def downgrade(url_or_engine: str | URL | Engine, revision: str) -> None:
    """Downgrade to `revision` ("base" drops everything): for operators and tests, never automatic."""
    _run_locked(
        url_or_engine,
        "downgrading the control plane database",
        lambda config: command.downgrade(config, revision),
    )
