"""Suspend/restore, crash recovery and snapshot policy (issue 4).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

snapshots: where a snapshot lives in object storage (prefix, uploaded_at), whether its artifact is known
complete and verified (restorable), its size on disk (exclusive_bytes), the data key that wraps it
(data_key_id + wrapped_key, so a rotated tenant key still opens old snapshots), the last error, and who
took it (origin: user | policy | suspend; retention prunes only policy snapshots).
sandboxes: the snapshot policy given at create/patch, the snapshot a suspend is writing or wrote
(suspended_snapshot_id + suspended_prefix, recorded BEFORE the node is called so a restarted control plane
resumes the same upload), crash-recovery facts shown to users (recovered_at, recovered_from, crash_count,
notice) and the tenant key id its data is wrapped by (data_key_id).

Non-null columns carry server defaults so existing rows migrate; batch mode keeps SQLite happy.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("prefix", sa.String(length=512), nullable=True))
        batch.add_column(sa.Column("uploaded_at", UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("exclusive_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("restorable", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("data_key_id", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("wrapped_key", sa.Text(), nullable=True))
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("origin", sa.String(length=16), nullable=True))
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("snapshot_policy", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("suspended_snapshot_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("suspended_prefix", sa.String(length=512), nullable=True))
        batch.add_column(sa.Column("recovered_at", UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("recovered_from", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("crash_count", sa.Integer(), nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("notice", sa.Text(), nullable=True))
        batch.add_column(sa.Column("data_key_id", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        for column in (
            "data_key_id",
            "notice",
            "crash_count",
            "recovered_from",
            "recovered_at",
            "suspended_prefix",
            "suspended_snapshot_id",
            "snapshot_policy",
        ):
            batch.drop_column(column)
    with op.batch_alter_table("snapshots") as batch:
        for column in (
            "origin",
            "error",
            "wrapped_key",
            "data_key_id",
            "restorable",
            "exclusive_bytes",
            "uploaded_at",
            "prefix",
        ):
            batch.drop_column(column)
