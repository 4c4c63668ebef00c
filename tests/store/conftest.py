"""The store's fixtures: each test runs on SQLite and on PostgreSQL (the PostgreSQL case carries the
`root` mark), on a migrated empty database, with a clock the test moves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from space.controlplane.store import Store, make_engine, migrate, sqlite_url
from tests.support import postgres as pg_support
from tests.support.clock import FakeClock

postgres_url = pg_support.postgres_url  # the session fixture, bound here so pytest finds it


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.root)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A migrated, empty database."""
    if backend == "sqlite":
        url = sqlite_url(tmp_path)
        migrate(url)
        return url
    url = str(request.getfixturevalue("postgres_url"))
    migrate(url)  # idempotent: the first test migrates, later ones find head
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"TRUNCATE {', '.join(pg_support.STORE_TABLES)}"))
    finally:
        engine.dispose()
    return url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db_url: str, clock: FakeClock) -> Iterator[Store]:
    with Store(db_url, clock=clock) as s:
        yield s
