"""Login credentials (issue 14, docs/adr/0063-login-credentials.md).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

- credentials.method may be 'login'; credentials.login holds its form (origin, username_field,
  password_field, form_action) as JSON, NULL for the other methods. The value (username and password) stays
  in the vault like every other credential's.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_METHODS = "method IN ('header', 'bearer', 'basic', 'query')"
_NEW_METHODS = "method IN ('header', 'bearer', 'basic', 'query', 'login')"


def upgrade() -> None:
    with op.batch_alter_table("credentials") as batch:
        batch.drop_constraint(op.f("ck_credentials_method"), type_="check")
        batch.create_check_constraint(op.f("ck_credentials_method"), _NEW_METHODS)
        batch.add_column(sa.Column("login", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM credentials WHERE method = 'login'")
    with op.batch_alter_table("credentials") as batch:
        batch.drop_column("login")
        batch.drop_constraint(op.f("ck_credentials_method"), type_="check")
        batch.create_check_constraint(op.f("ck_credentials_method"), _OLD_METHODS)
