"""Unit tests of the store's plumbing: URLs, SQLite connection settings, timestamps, error translation."""

from __future__ import annotations

import ast
import hashlib
import pathlib
import sqlite3
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError

from space.controlplane.store import Store, hash_request, hash_secret, make_engine, migrate, sqlite_url
from space.controlplane.store.credentials.store import CredentialStore
from space.controlplane.store.database import Repository
from space.controlplane.store.engine import normalize_url
from space.controlplane.store.errors import translate
from space.controlplane.store.types import UTCDateTime
from space.core.errors import (
    AlreadyExists,
    Conflict,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "space"


def test_sqlite_url_and_postgres_driver(tmp_path: pathlib.Path) -> None:
    assert sqlite_url(tmp_path) == f"sqlite:///{tmp_path.resolve()}/controlplane.db"
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"


def test_sqlite_connections_use_wal_foreign_keys_and_busy_timeout(tmp_path: pathlib.Path) -> None:
    engine = make_engine(sqlite_url(tmp_path / "nested"))  # the directory is created
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
    finally:
        engine.dispose()


def test_timestamps_are_aware_utc_and_naive_ones_are_refused(tmp_path: pathlib.Path) -> None:
    engine = make_engine(sqlite_url(tmp_path))
    table = sa.Table("t", sa.MetaData(), sa.Column("at", UTCDateTime()))
    try:
        table.create(engine)
        plus_two = datetime(2030, 5, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"at": plus_two}])
            value = conn.execute(sa.select(table.c.at)).scalar_one()
            assert value == plus_two and value.tzinfo is UTC and value.hour == 12
            # Comparison in SQL is chronological (naive UTC text of one format on SQLite).
            later = conn.execute(sa.select(table.c.at).where(table.c.at < plus_two + timedelta(seconds=1)))
            assert later.scalar_one() == plus_two
        with pytest.raises(sa.exc.StatementError), engine.begin() as conn:
            conn.execute(table.insert(), [{"at": datetime(2030, 1, 1)}])
    finally:
        engine.dispose()


def test_store_refuses_a_naive_clock(tmp_path: pathlib.Path) -> None:
    url = sqlite_url(tmp_path)
    migrate(url)
    with Store(url, clock=lambda: datetime(2030, 1, 1)) as store, pytest.raises(InvalidArgument):
        store.create_org("acme")


def test_hashes() -> None:
    assert hash_secret("space_x") == hashlib.sha256(b"space_x").hexdigest()
    assert hash_request("ab", "c") != hash_request("a", "bc")
    assert hash_request("POST", b"/v1/sandboxes", b"{}") == hash_request("POST", "/v1/sandboxes", "{}")


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint failed: orgs.name")),
            AlreadyExists,
        ),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError("FOREIGN KEY constraint failed")), NotFound),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError("NOT NULL constraint failed")), InvalidArgument),
        (IntegrityError("INSERT", {}, _PgError("23505")), AlreadyExists),
        (IntegrityError("INSERT", {}, _PgError("23503")), NotFound),
        (OperationalError("UPDATE", {}, _PgError("40P01")), Conflict),
        (OperationalError("UPDATE", {}, _PgError("40001")), Conflict),
        (OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked")), Unavailable),
        (sa.exc.TimeoutError("pool exhausted"), Unavailable),
        (sa.exc.ArgumentError("bad"), Internal),
    ],
)
def test_error_translation(exc: sa.exc.SQLAlchemyError, expected: type[Exception]) -> None:
    translated = translate(exc, "doing something")
    assert type(translated) is expected
    assert translated.message.startswith("doing something")
    assert "INSERT" not in translated.message  # no SQL in user-facing messages


def test_unreachable_database_is_unavailable(tmp_path: pathlib.Path) -> None:
    url = f"postgresql+psycopg://postgres@/nowhere?host={tmp_path}&port=5999"
    with Store(url) as store, pytest.raises(Unavailable) as info:
        store.ping()
    assert isinstance(info.value.__cause__, sa.exc.OperationalError)


def test_only_the_store_package_handles_sqlalchemy_errors() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.is_relative_to(SRC / "controlplane" / "store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.startswith("sqlalchemy.exc") for name in names):
                offenders.append(f"{path}:{getattr(node, 'lineno', '?')}")
    assert offenders == []


@pytest.mark.parametrize("composed", [Store, CredentialStore], ids=lambda cls: cls.__name__)
def test_no_two_repositories_of_a_store_define_the_same_name(composed: type) -> None:
    # The stores are composed of repositories as mixins: a name defined by two of them would silently
    # hide one behind the other (the method resolution order picks the first).
    owners: dict[str, list[str]] = {}
    for repository in composed.__mro__[1:]:
        if repository.__module__.startswith("space.controlplane.store") and repository is not Repository:
            for name in vars(repository):
                if not name.startswith("__"):
                    owners.setdefault(name, []).append(repository.__name__)
    assert {name: who for name, who in owners.items() if len(who) > 1} == {}
    assert len({cls for cls in composed.__mro__ if cls.__name__.endswith("Repository")}) >= 5
