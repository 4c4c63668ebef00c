"""Translation of database errors into space.core.errors: the only place SQLAlchemy errors are handled.

Invariants:
- No sqlalchemy or DBAPI exception leaves the store package: every one is re-raised as a SpaceError
  subclass with `raise ... from exc`, so the cause stays in tracebacks and logs but callers need to know
  only the typed hierarchy.
- Mapping: unique violation -> AlreadyExists; foreign-key violation -> NotFound (the referenced row is
  absent); other integrity errors -> InvalidArgument; serialization failure or deadlock -> Conflict
  (retrying may succeed); connection loss, lock timeout, database unreachable -> Unavailable; anything
  else -> Internal.
- Messages never include SQL parameters (they may carry hashes or user data); only the operation's name
  and the driver's error class.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from space.core.errors import (
    AlreadyExists,
    Conflict,
    Internal,
    InvalidArgument,
    NotFound,
    SpaceError,
    Unavailable,
)

# PostgreSQL SQLSTATE codes (https://www.postgresql.org/docs/current/errcodes-appendix.html).
_PG_UNIQUE: Final = "23505"
_PG_FOREIGN_KEY: Final = "23503"
_PG_RETRYABLE: Final = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected


def _sqlstate(exc: DBAPIError) -> str | None:
    state = getattr(exc.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _driver_text(exc: DBAPIError) -> str:
    return str(exc.orig).splitlines()[0] if exc.orig is not None else ""


def _integrity(exc: IntegrityError, what: str) -> SpaceError:
    state, text = _sqlstate(exc), _driver_text(exc)
    if state == _PG_UNIQUE or "UNIQUE constraint failed" in text:
        return AlreadyExists(f"{what}: already exists")
    if state == _PG_FOREIGN_KEY or "FOREIGN KEY constraint failed" in text:
        return NotFound(f"{what}: a referenced resource does not exist")
    return InvalidArgument(f"{what}: violates a constraint ({type(exc.orig).__name__})")


def _driver(exc: DBAPIError, what: str) -> SpaceError | None:
    """Conflict or Unavailable when the driver's error says so; None for anything else."""
    if _sqlstate(exc) in _PG_RETRYABLE:
        return Conflict(f"{what}: a concurrent transaction won; retry")
    if exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError):
        return Unavailable(f"{what}: database unavailable ({type(exc.orig).__name__})")
    return None


def translate(exc: SQLAlchemyError, what: str) -> SpaceError:
    """The SpaceError for `exc`, raised while doing `what` (the caller raises it `from exc`)."""
    if isinstance(exc, IntegrityError):
        return _integrity(exc, what)
    translated = _driver(exc, what) if isinstance(exc, DBAPIError) else None
    if translated is not None:
        return translated
    if isinstance(exc, PoolTimeoutError):
        return Unavailable(f"{what}: no database connection available")
    return Internal(f"{what}: database error ({type(exc).__name__})")


@contextmanager
def translate_db_errors(what: str) -> Iterator[None]:
    try:
        yield
    except SQLAlchemyError as exc:
        raise translate(exc, what) from exc
