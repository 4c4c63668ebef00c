"""Per-node identity: the SHA-256 of the secret the control plane issued to a node at its registration.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

nodes.identity_hash: NULL until the node registers (again) with a control plane of this revision; a node
without one cannot heartbeat or fetch credentials, gets 401 and registers again, which issues one
(ADR 0019).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("identity_hash", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("identity_hash")
