"""Rows of the credential tables to their records (see store/mapping.py for the invariants)."""

from __future__ import annotations

from typing import cast

from space.controlplane.credentials.spec import Injection, Method, Scope
from space.controlplane.store.credentials.records import (
    AuditRecord,
    CredentialRecord,
    EgressRecord,
    KeyService,
    KeyState,
    OrgKeyRecord,
)
from space.controlplane.store.models import Credential, CredentialAudit, OrgKey, SandboxEgress


def credential_record(row: Credential) -> CredentialRecord:
    return CredentialRecord(
        id=row.id,
        org_id=row.org_id,
        project_id=row.project_id,
        sandbox_id=row.sandbox_id,
        scope=cast(Scope, row.scope),
        scope_id=row.scope_id,
        name=row.name,
        hosts=list(row.hosts),
        injection=Injection(cast(Method, row.method), row.header_name, row.header_template, row.query_param),
        env_var=row.env_var,
        placeholder=row.placeholder,
        vault=row.vault,
        vault_ref=row.vault_ref,
        version=row.version,
        expires_at=row.expires_at,
        rate_per_minute=row.rate_per_minute,
        created_by=row.created_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        rotated_at=row.rotated_at,
    )


def audit_record(row: CredentialAudit) -> AuditRecord:
    return AuditRecord(
        id=row.id,
        at=row.at,
        org_id=row.org_id,
        project_id=row.project_id,
        sandbox_id=row.sandbox_id,
        credential_id=row.credential_id,
        credential_name=row.credential_name,
        scope=row.scope,
        action=row.action,
        actor=row.actor,
        host=row.host,
        detail=dict(row.detail or {}),
    )


def egress_record(row: SandboxEgress) -> EgressRecord:
    return EgressRecord(
        sandbox_id=row.sandbox_id,
        project_id=row.project_id,
        allow=list(row.allow),
        deny=list(row.deny),
        credentials=list(row.credentials),
        version=row.version,
        updated_at=row.updated_at,
    )


def org_key_record(row: OrgKey) -> OrgKeyRecord:
    return OrgKeyRecord(
        org_id=row.org_id,
        service=cast(KeyService, row.service),
        key_id=row.key_id,
        state=cast(KeyState, row.state),
        created_at=row.created_at,
        rotated_at=row.rotated_at,
        revoked_at=row.revoked_at,
    )
