"""Engines for the control plane's database: SQLite embedded, PostgreSQL shared.

Invariants:
- `sqlite_url(data_dir)` is the embedded default: `sqlite:///<data_dir>/controlplane.db`.
- Every SQLite connection runs with WAL (readers never block the writer), foreign keys ON (SQLite's default
  is OFF) and a busy timeout, and every SQLite transaction starts with BEGIN IMMEDIATE: a transaction
  takes the write lock up front, so two writers queue on busy_timeout instead of failing with "database is
  locked" when a deferred reader tries to upgrade. That also makes each store transaction serializable on
  SQLite, which claim_work and compare-and-swap rely on there.
- PostgreSQL URLs use psycopg 3 (`postgresql+psycopg://`); a bare `postgresql://` is rewritten to it.
  Connections are pre-pinged so a restarted database shows up as one retried checkout, not an error.
"""

from __future__ import annotations

import pathlib
import sqlite3
from typing import Any, Final

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL

SQLITE_FILENAME: Final = "controlplane.db"
SQLITE_BUSY_TIMEOUT_MS: Final = 10_000


def sqlite_url(data_dir: str | pathlib.Path) -> str:
    """The embedded default database URL for a control plane whose data lives in `data_dir`."""
    path = pathlib.Path(data_dir).resolve() / SQLITE_FILENAME
    return f"sqlite:///{path}"


def normalize_url(url: str | URL) -> URL:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    assert isinstance(dbapi_connection, sqlite3.Connection)
    # Hand transaction control to SQLAlchemy's "begin" event below (pysqlite's own implicit BEGIN is
    # deferred and is skipped before SELECTs, which breaks the serialization argument above).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        # WAL + NORMAL is durable against process crashes (the case that matters for a control plane);
        # only an OS crash may lose the last transactions.
        cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for `url` with the settings of the module invariants. `kwargs` go to create_engine."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            pathlib.Path(database).parent.mkdir(parents=True, exist_ok=True)
            _pool_defaults(kwargs)
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    _pool_defaults(kwargs)
    return create_engine(parsed, **kwargs)


def _pool_defaults(kwargs: dict[str, Any]) -> None:
    # The API calls the store from a thread pool; SQLAlchemy's default (5 + 10 overflow) would make
    # busy threads queue for a connection. Callers may still pass their own sizes.
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
