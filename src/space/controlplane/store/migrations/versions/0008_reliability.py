"""Reliability (issue 11): node runtimes, sandbox incarnations, checkpoint runtimes, leader leases, events.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

- nodes.status may be 'offline' (the node deregistered on purpose: `space down`); nodes.runtime says
  what checkpoints the node can restore.
- sandboxes.incarnation: the generation at which the copy on its node was made; node deletes and orphan
  collection name it.
- snapshots.runtime: what restoring a full checkpoint needs.
- leader_leases: one holder per name across control-plane replicas (the snapshot scheduler).
- sandbox_events: what happened to a sandbox that its owner should see.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_STATUSES = "status IN ('ready', 'lost', 'draining')"
_NEW_STATUSES = "status IN ('ready', 'lost', 'draining', 'offline')"


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_constraint(op.f("ck_nodes_status"), type_="check")
        batch.create_check_constraint(op.f("ck_nodes_status"), _NEW_STATUSES)
        batch.add_column(sa.Column("runtime", sa.JSON(), nullable=True))
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("incarnation", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("runtime", sa.JSON(), nullable=True))
    op.create_table(
        "leader_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("acquired_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leader_leases")),
    )
    op.create_table(
        "sandbox_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("sandbox_id", sa.String(length=40), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["sandbox_id"], ["sandboxes.id"], name=op.f("fk_sandbox_events_sandbox_id_sandboxes")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sandbox_events")),
    )
    op.create_index("ix_sandbox_events_sandbox_id_id", "sandbox_events", ["sandbox_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_sandbox_events_sandbox_id_id", table_name="sandbox_events")
    op.drop_table("sandbox_events")
    op.drop_table("leader_leases")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("runtime")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("incarnation")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("runtime")
        batch.drop_constraint(op.f("ck_nodes_status"), type_="check")
        batch.create_check_constraint(op.f("ck_nodes_status"), _OLD_STATUSES)
