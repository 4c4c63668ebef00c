"""Initial schema: orgs, projects, API keys, nodes, sandboxes, snapshots, idempotency records.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29

Written from the models of that date and checked against them by the autogenerate comparison test.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "idempotency_records",
        sa.Column("scope", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response_body", sa.JSON(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", name=op.f("pk_idempotency_records")),
    )
    op.create_index("ix_idempotency_records_created_at", "idempotency_records", ["created_at"])

    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("capacity", sa.JSON(), nullable=False),
        sa.Column("used", sa.JSON(), nullable=False),
        sa.Column("templates", sa.JSON(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("last_heartbeat_at", UTCDateTime(), nullable=False),
        sa.Column("registered_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("status IN ('ready', 'lost', 'draining')", name=op.f("ck_nodes_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("url", name=op.f("uq_nodes_url")),
    )
    op.create_index("ix_nodes_status_last_heartbeat_at", "nodes", ["status", "last_heartbeat_at"])

    op.create_table(
        "orgs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orgs")),
        sa.UniqueConstraint("name", name=op.f("uq_orgs_name")),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_projects_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("org_id", "name", name=op.f("uq_projects_org_id_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=True),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("role IN ('admin', 'member', 'read-only')", name=op.f("ck_api_keys_role")),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_api_keys_org_id_orgs")),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_api_keys_project_id_projects")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_index("ix_api_keys_project_id", "api_keys", ["project_id"])

    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("template", sa.String(length=64), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("limits", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("desired_state", sa.String(length=32), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("forked_from", sa.String(length=40), nullable=True),
        sa.Column("fork_snapshot_id", sa.String(length=40), nullable=True),
        sa.Column("idle_timeout_s", sa.Integer(), nullable=True),
        sa.Column("ttl_s", sa.Integer(), nullable=True),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("last_activity_at", UTCDateTime(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_permanent", sa.Boolean(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_until", UTCDateTime(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_sandboxes_node_id_nodes")),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_sandboxes_project_id_projects")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sandboxes")),
    )
    op.create_index("ix_sandboxes_expires_at", "sandboxes", ["expires_at"])
    op.create_index("ix_sandboxes_next_attempt_at", "sandboxes", ["next_attempt_at"])
    op.create_index("ix_sandboxes_node_id", "sandboxes", ["node_id"])
    op.create_index("ix_sandboxes_project_id_created_at", "sandboxes", ["project_id", "created_at"])
    op.create_index("ix_sandboxes_state", "sandboxes", ["state"])

    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("sandbox_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("kind IN ('disk', 'full')", name=op.f("ck_snapshots_kind")),
        sa.CheckConstraint("state IN ('creating', 'ready', 'deleting')", name=op.f("ck_snapshots_state")),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_snapshots_node_id_nodes")),
        sa.ForeignKeyConstraint(
            ["sandbox_id"], ["sandboxes.id"], name=op.f("fk_snapshots_sandbox_id_sandboxes")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshots")),
    )
    op.create_index("ix_snapshots_sandbox_id_created_at", "snapshots", ["sandbox_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_snapshots_sandbox_id_created_at", table_name="snapshots")

    op.drop_table("snapshots")
    op.drop_index("ix_sandboxes_state", table_name="sandboxes")
    op.drop_index("ix_sandboxes_project_id_created_at", table_name="sandboxes")
    op.drop_index("ix_sandboxes_node_id", table_name="sandboxes")
    op.drop_index("ix_sandboxes_next_attempt_at", table_name="sandboxes")
    op.drop_index("ix_sandboxes_expires_at", table_name="sandboxes")

    op.drop_table("sandboxes")
    op.drop_index("ix_api_keys_project_id", table_name="api_keys")
    op.drop_index("ix_api_keys_org_id", table_name="api_keys")

    op.drop_table("api_keys")
    op.drop_table("projects")
    op.drop_table("orgs")
    op.drop_index("ix_nodes_status_last_heartbeat_at", table_name="nodes")

    op.drop_table("nodes")
    op.drop_index("ix_idempotency_records_created_at", table_name="idempotency_records")

    op.drop_table("idempotency_records")
