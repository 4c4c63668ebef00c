"""A sandbox's isolation (issue 15, docs/adr/0076-isolation-per-sandbox.md).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03

- sandboxes.isolation: 'gvisor' (every existing row: gVisor is all SPACE ran before) or 'microvm'; the
  scheduler places a sandbox only on nodes whose driver provides its isolation.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(
            sa.Column("isolation", sa.String(length=8), server_default=sa.text("'gvisor'"), nullable=False)
        )
        batch.create_check_constraint(op.f("ck_sandboxes_isolation"), "isolation IN ('gvisor', 'microvm')")


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_constraint(op.f("ck_sandboxes_isolation"), type_="check")
        batch.drop_column("isolation")
