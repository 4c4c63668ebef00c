"""Alembic environment of the control plane store.

Normally run through space.controlplane.store.migrate.migrate(), which passes an open connection already
inside a transaction (and, on PostgreSQL, holding the migration advisory lock) in
`config.attributes["connection"]`; Alembic then runs inside that transaction and commits nothing itself.
Run from the `alembic` command line (with sqlalchemy.url set), it opens its own engine instead.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from space.controlplane.store.engine import make_engine
from space.controlplane.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds tables, so future migrations stay portable.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set sqlalchemy.url or pass a connection in config.attributes['connection']")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
