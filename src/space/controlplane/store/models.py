"""The control plane's tables (SQLAlchemy 2 typed declarative).

Invariants:
- These models and migrations/versions/* describe the same schema; tests/integration/test_store.py runs
  Alembic's autogenerate comparison against a migrated database and requires an empty diff. Change both
  together: a model edit without a new migration fails that test.
- Ids are the prefixed random ids of space.core.ids, stored as text. Every timestamp is aware UTC
  (UTCDateTime). The secret of an API key or node token is never stored, only its SHA-256 hex digest.
- `sandboxes.generation` changes exactly when `state` changes (Store.transition), so (id, state,
  generation) identifies one version of a sandbox's lifecycle for compare-and-swap.
- Rows are never hard-deleted except snapshots and idempotency records: a deleted sandbox stays as a
  tombstone (state 'deleted', deleted_at set) so ids are never reused and late reports can be refused.
- `forked_from` and `fork_snapshot_id` carry no foreign key on purpose: the source sandbox may become a
  tombstone and its snapshot may be purged while the child lives on.
- Objects of these classes never leave the store package; callers get the frozen records of
  space.controlplane.store.records, so nobody mistakes a detached ORM object for a live row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import BigInteger

from space.controlplane.store.types import UTCDateTime

# Deterministic constraint names: Alembic needs them to alter or drop constraints later (and SQLite's
# batch mode rebuilds tables by name).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 40  # the longest prefix ("snap-") + 26 characters, with room to spare
STATE_LENGTH = 32

ROLES = ("admin", "member", "read-only")
NODE_STATUSES = ("ready", "lost", "draining")
SNAPSHOT_KINDS = ("disk", "full")
SNAPSHOT_STATES = ("creating", "ready", "deleting")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Org(Base):
    __tablename__ = "orgs"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"))
    name: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_one_of("role", ROLES), name="role"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    # NULL: an org-level key (the org admin key `space up` prints).
    project_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"), index=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("orgs.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    # authenticate() looks keys up by this digest, hence the unique index.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(_one_of("status", NODE_STATUSES), name="status"),
        # mark_lost and list_nodes filter on status, then on heartbeat age.
        Index("ix_nodes_status_last_heartbeat_at", "status", "last_heartbeat_at"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    url: Mapped[str] = mapped_column(String(512), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    capacity: Mapped[dict[str, Any]] = mapped_column(JSON)
    used: Mapped[dict[str, Any]] = mapped_column(JSON)
    templates: Mapped[list[str]] = mapped_column(JSON)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Sandbox(Base):
    __tablename__ = "sandboxes"
    __table_args__ = (
        # list_sandboxes: one project's sandboxes in creation order.
        Index("ix_sandboxes_project_id_created_at", "project_id", "created_at"),
        # claim_work: rows whose retry time has come, oldest first; the state filter narrows further.
        Index("ix_sandboxes_next_attempt_at", "next_attempt_at"),
        Index("ix_sandboxes_state", "state"),
        # TTL sweep and per-node listings (node lost -> its sandboxes).
        Index("ix_sandboxes_expires_at", "expires_at"),
        Index("ix_sandboxes_node_id", "node_id"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("projects.id"))
    template: Mapped[str] = mapped_column(String(64))
    env: Mapped[dict[str, str]] = mapped_column(JSON)
    limits: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(STATE_LENGTH))
    desired_state: Mapped[str] = mapped_column(String(STATE_LENGTH))
    generation: Mapped[int] = mapped_column(BigInteger)
    node_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("nodes.id"))
    forked_from: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    fork_snapshot_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    idle_timeout_s: Mapped[int | None] = mapped_column(Integer)
    ttl_s: Mapped[int | None] = mapped_column(Integer)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_activity_at: Mapped[datetime] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)
    error_permanent: Mapped[bool] = mapped_column(Boolean)
    attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime())
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Snapshot(Base):
    __tablename__ = "snapshots"
    __table_args__ = (
        CheckConstraint(_one_of("kind", SNAPSHOT_KINDS), name="kind"),
        CheckConstraint(_one_of("state", SNAPSHOT_STATES), name="state"),
        Index("ix_snapshots_sandbox_id_created_at", "sandbox_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    sandbox_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("sandboxes.id"))
    kind: Mapped[str] = mapped_column(String(8))
    state: Mapped[str] = mapped_column(String(16))
    # NULL when the snapshot lives only in object storage.
    node_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("nodes.id"))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class IdempotencyRecord(Base):
    __tablename__ = "idempotency_records"
    __table_args__ = (Index("ix_idempotency_records_created_at", "created_at"),)

    # (scope, key) is the primary key, hence unique: the constraint that makes concurrent begins safe.
    scope: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)  # NULL while the request is in progress
    response_body: Mapped[Any | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
