"""Speed (issue 12): where a sandbox came from, and each node's warm pools.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

- sandboxes.created_from: how the node made the sandbox: 'pool' (a pre-started sandbox of its template
  was bound to it), 'warm' (restored from the template's warm checkpoint on request) or 'cold' (booted);
  NULL until created, and for fork children, restores and rows from before this revision.
- nodes.pools: what each node last reported of its warm pools, {template: ready count}; the scheduler
  prefers a node with a ready sandbox of the template. NULL: not reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("created_from", sa.String(length=8), nullable=True))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("pools", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("pools")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("created_from")
