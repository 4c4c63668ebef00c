"""Metadata and deadlines (issue 13, docs/adr/0048-metadata-lists-and-deadlines.md).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

- sandboxes.metadata: the user's labels, a JSON object of strings ({} for every existing row); list
  filters match them in SQL (JSON_EXTRACT on SQLite, ->> on PostgreSQL).
- sandboxes.on_timeout: what the deadline (expires_at) does, 'delete' (every existing row: what it did
  before) or 'pause'.
- the listing index gains `id` ((project_id, created_at, id)): pages are ordered by creation with ties
  broken by id, and read in that order straight from the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("metadata", sa.JSON(), server_default=sa.text("'{}'"), nullable=False))
        batch.add_column(
            sa.Column("on_timeout", sa.String(length=8), server_default=sa.text("'delete'"), nullable=False)
        )
        batch.create_check_constraint(op.f("ck_sandboxes_on_timeout"), "on_timeout IN ('delete', 'pause')")
    op.drop_index("ix_sandboxes_project_id_created_at", table_name="sandboxes")
    op.create_index("ix_sandboxes_project_id_created_at_id", "sandboxes", ["project_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_project_id_created_at_id", table_name="sandboxes")
    op.create_index("ix_sandboxes_project_id_created_at", "sandboxes", ["project_id", "created_at"])
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_constraint(op.f("ck_sandboxes_on_timeout"), type_="check")
        batch.drop_column("on_timeout")
        batch.drop_column("metadata")
