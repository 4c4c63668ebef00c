"""Sandboxes keep the typed code of their failure (issue 10: failures stored as codes, not text).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

sandboxes.error_code: the space.core.errors code of the failure in sandboxes.error. Rows written before
this revision carried the code only as the prefix of `error` ("code: message"); the upgrade moves that
prefix into the column once, for codes SPACE defines, so nothing reads codes out of text afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.core import errors

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _known_codes() -> set[str]:
    found: set[str] = set()
    pending: list[type[errors.SpaceError]] = [errors.SpaceError]
    while pending:
        cls = pending.pop()
        found.add(cls.code)
        pending.extend(cls.__subclasses__())
    return found


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("error_code", sa.String(length=64), nullable=True))
    sandboxes = sa.table("sandboxes", sa.column("id", sa.String), sa.column("error", sa.Text),
                         sa.column("error_code", sa.String))  # fmt: skip
    connection = op.get_bind()
    known = _known_codes()
    failed = connection.execute(
        sa.select(sandboxes.c.id, sandboxes.c.error).where(sandboxes.c.error.is_not(None))
    )
    for sandbox_id, error in failed.all():
        code, sep, _ = str(error).partition(":")
        if sep and code in known:
            connection.execute(sandboxes.update().where(sandboxes.c.id == sandbox_id).values(error_code=code))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("error_code")
