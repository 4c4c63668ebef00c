"""Rows to records: the one place where ORM objects become the frozen records callers get.

Invariants:
- Every record the store hands out is built here, from a row read or written inside a transaction, so
  no ORM object leaves the store package (models.py).
- A row that does not parse (an unknown state, malformed limits) fails loudly on read.
"""

from __future__ import annotations

from typing import cast

from space.controlplane.store.models import ApiKey, IdempotencyRecord, Node, Org, Project, Sandbox, Snapshot
from space.controlplane.store.records import (
    ApiKeyRecord,
    IdempotencyRecordView,
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
from space.core import lifecycle
from space.core.settings import SandboxLimits


def org_record(row: Org) -> OrgRecord:
    return OrgRecord(id=row.id, name=row.name, created_at=row.created_at)


def project_record(row: Project) -> ProjectRecord:
    return ProjectRecord(id=row.id, org_id=row.org_id, name=row.name, created_at=row.created_at)


def api_key_record(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        project_id=row.project_id,
        org_id=row.org_id,
        role=cast(Role, row.role),
        prefix=row.prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


def node_record(row: Node) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        url=row.url,
        capacity=dict(row.capacity),
        used=dict(row.used),
        templates=list(row.templates),
        labels=dict(row.labels),
        status=cast(NodeStatus, row.status),
        last_heartbeat_at=row.last_heartbeat_at,
        registered_at=row.registered_at,
    )


def sandbox_record(row: Sandbox) -> SandboxRecord:
    return SandboxRecord(
        id=row.id,
        project_id=row.project_id,
        template=row.template,
        env=dict(row.env),
        limits=SandboxLimits.model_validate(row.limits),
        state=lifecycle.parse_state(row.state),
        desired_state=lifecycle.parse_state(row.desired_state),
        generation=row.generation,
        node_id=row.node_id,
        forked_from=row.forked_from,
        fork_snapshot_id=row.fork_snapshot_id,
        idle_timeout_s=row.idle_timeout_s,
        ttl_s=row.ttl_s,
        expires_at=row.expires_at,
        last_activity_at=row.last_activity_at,
        error=row.error,
        error_permanent=row.error_permanent,
        attempts=row.attempts,
        next_attempt_at=row.next_attempt_at,
        lease_owner=row.lease_owner,
        lease_until=row.lease_until,
        created_at=row.created_at,
        updated_at=row.updated_at,
        deleted_at=row.deleted_at,
        snapshot_policy=dict(row.snapshot_policy) if row.snapshot_policy is not None else None,
        suspended_snapshot_id=row.suspended_snapshot_id,
        suspended_prefix=row.suspended_prefix,
        recovered_at=row.recovered_at,
        recovered_from=row.recovered_from,
        crash_count=row.crash_count or 0,
        notice=row.notice,
        data_key_id=row.data_key_id,
    )


def snapshot_record(row: Snapshot) -> SnapshotRecord:
    return SnapshotRecord(
        id=row.id,
        sandbox_id=row.sandbox_id,
        kind=cast(SnapshotKind, row.kind),
        state=cast(SnapshotState, row.state),
        node_id=row.node_id,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        prefix=row.prefix,
        uploaded_at=row.uploaded_at,
        exclusive_bytes=row.exclusive_bytes,
        restorable=bool(row.restorable),
        data_key_id=row.data_key_id,
        wrapped_key=row.wrapped_key,
        error=row.error,
        origin=row.origin,
    )


def idempotency_record(row: IdempotencyRecord) -> IdempotencyRecordView:
    return IdempotencyRecordView(
        scope=row.scope,
        key=row.key,
        request_hash=row.request_hash,
        status_code=row.status_code,
        response_body=row.response_body,
        created_at=row.created_at,
    )
