"""Per-node RPC credentials and enrolment tokens (ADR 0021).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

nodes.rpc_token_sealed: the node's own RPC token, sealed by the control plane (NULL for nodes registered
before this revision: the control plane cannot call them until they register again, which a restarted
node does). enrolment_tokens: tokens that enrol new nodes, stored as SHA-256 digests with a use count.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("rpc_token_sealed", sa.LargeBinary(), nullable=True))
    op.create_table(
        "enrolment_tokens",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("max_uses", sa.Integer(), nullable=False),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("last_used_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_enrolment_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_enrolment_tokens_token_hash")),
    )


def downgrade() -> None:
    op.drop_table("enrolment_tokens")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("rpc_token_sealed")
