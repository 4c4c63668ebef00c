"""Credentials, sealed vault values, the credential audit log, sandbox egress policies, tenant keys (issue 5).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

credentials: metadata only (scope, hosts, injection, expiry, rate, placeholder) and an opaque vault
reference; vault_secrets: AES-GCM sealed values of the default vault; credential_audit: every change and
use; sandbox_egress: each sandbox's allow/deny lists and bound credential names; org_keys: the tenant key
(BYOK) each org's data keys are wrapped by.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from space.controlplane.store.types import UTCDateTime

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "credentials",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=True),
        sa.Column("sandbox_id", sa.String(length=40), nullable=True),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("scope_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("hosts", sa.JSON(), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("header_name", sa.String(length=128), nullable=True),
        sa.Column("header_template", sa.Text(), nullable=True),
        sa.Column("query_param", sa.String(length=128), nullable=True),
        sa.Column("env_var", sa.String(length=128), nullable=False),
        sa.Column("placeholder", sa.String(length=128), nullable=False),
        sa.Column("vault", sa.String(length=32), nullable=False),
        sa.Column("vault_ref", sa.String(length=512), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("rate_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("rotated_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("scope IN ('org', 'project', 'sandbox')", name=op.f("ck_credentials_scope")),
        sa.CheckConstraint(
            "method IN ('header', 'bearer', 'basic', 'query')", name=op.f("ck_credentials_method")
        ),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_credentials_org_id_orgs")),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_credentials_project_id_projects")
        ),
        sa.ForeignKeyConstraint(
            ["sandbox_id"], ["sandboxes.id"], name=op.f("fk_credentials_sandbox_id_sandboxes")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credentials")),
        sa.UniqueConstraint("placeholder", name=op.f("uq_credentials_placeholder")),
        sa.UniqueConstraint("scope_id", "name", name=op.f("uq_credentials_scope_id_name")),
    )
    op.create_index("ix_credentials_org_id_name", "credentials", ["org_id", "name"])

    op.create_table(
        "vault_secrets",
        sa.Column("reference", sa.String(length=256), nullable=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("reference", name=op.f("pk_vault_secrets")),
    )

    op.create_table(
        "credential_audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=True),
        sa.Column("sandbox_id", sa.String(length=40), nullable=True),
        sa.Column("credential_id", sa.String(length=40), nullable=True),
        sa.Column("credential_name", sa.String(length=64), nullable=True),
        sa.Column("scope", sa.String(length=16), nullable=True),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credential_audit")),
    )
    op.create_index(
        "ix_credential_audit_org_id_credential_name_id",
        "credential_audit",
        ["org_id", "credential_name", "id"],
    )
    op.create_index("ix_credential_audit_sandbox_id", "credential_audit", ["sandbox_id"])

    op.create_table(
        "sandbox_egress",
        sa.Column("sandbox_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("allow", sa.JSON(), nullable=False),
        sa.Column("deny", sa.JSON(), nullable=False),
        sa.Column("credentials", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("sandbox_id", name=op.f("pk_sandbox_egress")),
    )
    op.create_index("ix_sandbox_egress_project_id", "sandbox_egress", ["project_id"])

    op.create_table(
        "org_keys",
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("service", sa.String(length=16), nullable=False),
        sa.Column("key_id", sa.String(length=256), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("rotated_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("service IN ('local', 'kms')", name=op.f("ck_org_keys_service")),
        sa.CheckConstraint("state IN ('active', 'revoked')", name=op.f("ck_org_keys_state")),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_org_keys_org_id_orgs")),
        sa.PrimaryKeyConstraint("org_id", name=op.f("pk_org_keys")),
    )


def downgrade() -> None:
    op.drop_table("org_keys")
    op.drop_index("ix_sandbox_egress_project_id", table_name="sandbox_egress")
    op.drop_table("sandbox_egress")
    op.drop_index("ix_credential_audit_sandbox_id", table_name="credential_audit")
    op.drop_index("ix_credential_audit_org_id_credential_name_id", table_name="credential_audit")
    op.drop_table("credential_audit")
    op.drop_table("vault_secrets")
    op.drop_index("ix_credentials_org_id_name", table_name="credentials")
    op.drop_table("credentials")
