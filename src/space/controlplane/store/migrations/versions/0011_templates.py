"""User templates and named snapshots (issue 13, docs/adr/0055-templates-in-the-control-plane.md).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

- templates: a project's templates (built-ins have no row): name unique per project, the node-level name
  `tpl-<hex>` unique, status building/ready/failed/deleting (space.core.template_states), the build spec,
  what it was built from, where, its size, default user and workdir, the last error, the driving control
  plane's lease, and how much of its build log is kept.
- template_logs: the build log, one row per line; the newest 256 KiB of each template are kept.
- snapshots.name: a user's name for a full snapshot (E2B's named snapshots; not unique), indexed.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "templates",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("node_name", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(length=512), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("default_user", sa.String(length=64), nullable=True),
        sa.Column("workdir", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_until", UTCDateTime(), nullable=True),
        sa.Column("log_bytes", sa.BigInteger(), nullable=False),
        sa.Column("log_truncated", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint(
            "status IN ('building', 'ready', 'failed', 'deleting')", name=op.f("ck_templates_status")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_templates_project_id_projects")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_templates")),
        sa.UniqueConstraint("node_name", name=op.f("uq_templates_node_name")),
        sa.UniqueConstraint("project_id", "name", name=op.f("uq_templates_project_id_name")),
    )
    op.create_index("ix_templates_status", "templates", ["status"])
    op.create_table(
        "template_logs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("template_id", sa.String(length=40), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["template_id"], ["templates.id"], name=op.f("fk_template_logs_template_id_templates")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_template_logs")),
    )
    op.create_index("ix_template_logs_template_id_id", "template_logs", ["template_id", "id"])
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("name", sa.String(length=128), nullable=True))
        batch.create_index("ix_snapshots_name", ["name"])


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_index("ix_snapshots_name")
        batch.drop_column("name")
    op.drop_index("ix_template_logs_template_id_id", table_name="template_logs")
    op.drop_table("template_logs")
    op.drop_index("ix_templates_status", table_name="templates")
    op.drop_table("templates")
