"""The control plane's state store (SQLite embedded, PostgreSQL shared); see store.py for its map.

The only package of SPACE that imports SQLAlchemy: everything else uses `Store` and its records.
"""

from space.controlplane.store.database import Clock, utcnow
from space.controlplane.store.digests import hash_request, hash_secret
from space.controlplane.store.engine import make_engine, sqlite_url
from space.controlplane.store.migrate import head_revision, migrate
from space.controlplane.store.records import (
    ApiKeyRecord,
    IdempotencyRecordView,
    IdempotentBegin,
    NodeRecord,
    NodeStatus,
    OrgRecord,
    ProjectRecord,
    Role,
    SandboxRecord,
    SnapshotKind,
    SnapshotRecord,
    SnapshotState,
)
from space.controlplane.store.sandbox_state import OBSERVED_FIELDS, TRANSITION_FIELDS
from space.controlplane.store.sandboxes import DESIRABLE_STATES
from space.controlplane.store.store import Store, open_store

__all__ = [
    "DESIRABLE_STATES",
    "OBSERVED_FIELDS",
    "TRANSITION_FIELDS",
    "ApiKeyRecord",
    "Clock",
    "IdempotencyRecordView",
    "IdempotentBegin",
    "NodeRecord",
    "NodeStatus",
    "OrgRecord",
    "ProjectRecord",
    "Role",
    "SandboxRecord",
    "SnapshotKind",
    "SnapshotRecord",
    "SnapshotState",
    "Store",
    "hash_request",
    "hash_secret",
    "head_revision",
    "make_engine",
    "migrate",
    "open_store",
    "sqlite_url",
    "utcnow",
]
