"""The one session factory and the one transaction helper that every repository of the store shares.

Invariants:
- One `Database` per `Store`: one engine, ONE `sessionmaker` and one clock. Every repository (the
  mixins that make up `Store`, and those behind `CredentialStore`) runs its transactions through
  `Database.transaction`, so all of them begin, commit, roll back and translate errors the same way.
- `transaction(what)` is one transaction: commit when the block ends normally, roll back on any
  exception; a SQLAlchemy error leaves as a space.core.errors exception naming `what` (errors.py).
- Sessions are made with `expire_on_commit=False`: a row read or written inside a transaction can still
  be turned into a record after the commit, without a second round trip (or a detached-instance error).
- `now()` is the injected clock's time, required to be aware and returned in UTC, so every replica
  stamps and compares times the same way.
- A `Repository` holds nothing but the `Database`; it has no state of its own, so any number of
  repositories over one `Database` see one consistent store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from space.controlplane.store.errors import translate_db_errors
from space.controlplane.store.values import aware
from space.core import tracing

Clock = Callable[[], datetime]
LAYER = tracing.Layer("space.controlplane")  # one span per transaction within a trace (ADR 0072)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Database:
    """An engine, the session factory over it and the clock (see the module invariants)."""

    def __init__(self, engine: Engine, *, clock: Clock = utcnow, owns_engine: bool = False) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._clock = clock
        self._owns_engine = owns_engine

    @contextmanager
    def transaction(self, what: str) -> Iterator[Session]:
        """One transaction; commits on success, rolls back on any exception, translates DB errors."""
        with (
            LAYER.span("db.transaction", what=what),
            translate_db_errors(what),
            self._sessions.begin() as session,
        ):
            yield session

    def now(self) -> datetime:
        return aware(self._clock(), "clock")

    def close(self) -> None:
        """Dispose of the engine's connections if this Database made the engine (not if it was given)."""
        if self._owns_engine:
            self.engine.dispose()


class Repository:
    """The base of every repository: its transactions and its time come from the shared `Database`."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def _tx(self, what: str) -> AbstractContextManager[Session]:
        return self.database.transaction(what)

    def now(self) -> datetime:
        return self.database.now()
