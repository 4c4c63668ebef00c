"""The private networks an org admin opened for a project's egress allow lists (issue 9, ADR 0026).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

project_private_networks: one row per project that has any (CIDRs inside the gateway's private ranges);
no row means a tenant's allow list can name no private range.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project_private_networks",
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("networks", sa.JSON(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_project_private_networks_project_id_projects")
        ),
        sa.PrimaryKeyConstraint("project_id", name=op.f("pk_project_private_networks")),
    )


def downgrade() -> None:
    op.drop_table("project_private_networks")
