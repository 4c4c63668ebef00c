"""Rows of the credential tables to their records, by the generic RowMapper of store/mapping.py.

A credential's injection is stored as five columns (method, header name, header template, query
parameter, login form) and handed out as one `Injection`: the one field derived rather than read.
"""

from __future__ import annotations

from typing import cast

from space.controlplane.credentials.spec import Injection, LoginForm, Method
from space.controlplane.store.credentials.records import (
    AuditRecord,
    CredentialRecord,
    EgressRecord,
    OrgKeyRecord,
)
from space.controlplane.store.mapping import RowMapper
from space.controlplane.store.models import Credential


def _injection(row: Credential) -> Injection:
    login = LoginForm(**row.login) if row.login else None
    return Injection(cast(Method, row.method), row.header_name, row.header_template, row.query_param, login)


credential_record = RowMapper(CredentialRecord, injection=_injection)
audit_record = RowMapper(AuditRecord)
egress_record = RowMapper(EgressRecord)
org_key_record = RowMapper(OrgKeyRecord)
