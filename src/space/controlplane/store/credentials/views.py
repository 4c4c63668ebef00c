"""What tenants see of credentials and egress policies (everything but values and vault references)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from space.controlplane.credentials.login import login_username_placeholder
from space.controlplane.store.credentials.records import CredentialRecord, EgressRecord


def egress_view(record: EgressRecord | None) -> dict[str, Any]:
    if record is None:
        return {"allow": [], "deny": [], "credentials": [], "version": 0}
    return {
        "allow": record.allow,
        "deny": record.deny,
        "credentials": record.credentials,
        "version": record.version,
        "updated_at": record.updated_at.isoformat(),
    }


def credential_view(record: CredentialRecord, now: datetime) -> Mapping[str, Any]:
    """What tenants see of a credential: everything but the value (and the vault reference)."""
    return {
        "id": record.id,
        "name": record.name,
        "scope": record.scope,
        "project_id": record.project_id,
        "sandbox_id": record.sandbox_id,
        "hosts": record.hosts,
        "method": record.injection.method,
        "header": (
            f"{record.injection.header_name}: {record.injection.header_template}"
            if record.injection.header_name
            else None
        ),
        "query_param": record.injection.query_param,
        "login": record.injection.login.to_json() if record.injection.login else None,
        "env_var": record.env_var,
        "placeholder": record.placeholder,
        "username_placeholder": (
            login_username_placeholder(record.placeholder) if record.injection.method == "login" else None
        ),
        "version": record.version,
        "expires_at": record.expires_at.isoformat() if record.expires_at else None,
        "expired": record.expired(now),
        "rate_per_minute": record.rate_per_minute,
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
        "rotated_at": record.rotated_at.isoformat(),
    }
