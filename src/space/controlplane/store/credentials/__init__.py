"""The store's credential side (issue 5): credentials, their audit log, the default vault's sealed values,
sandbox egress policies, projects' private networks and tenant keys, as `CredentialStore`.

Invariants (each module states its own):
- No method takes or returns a credential's value (only opaque vault references and ciphertext).
- Every change writes its audit entries in the SAME transaction as the change.
- Everything runs on the one Database of the Store a CredentialStore is made from.

Modules: records.py (what is handed out), metadata.py (credentials), audit.py, vault_blobs.py, egress.py
(policies, private networks), org_keys.py (BYOK), views.py (what tenants see), store.py (the composition).
"""

from space.controlplane.store.credentials.audit import MAX_AUDIT_PAGE
from space.controlplane.store.credentials.metadata import CREDENTIAL_ID_PREFIX, new_credential_id
from space.controlplane.store.credentials.records import (
    AuditEntry,
    AuditRecord,
    CredentialChange,
    CredentialFields,
    CredentialRecord,
    CredentialUsage,
    EgressRecord,
    KeyService,
    KeyState,
    OrgKeyRecord,
    scope_id_of,
)
from space.controlplane.store.credentials.store import CredentialStore
from space.controlplane.store.credentials.views import credential_view, egress_view

__all__ = [
    "CREDENTIAL_ID_PREFIX",
    "MAX_AUDIT_PAGE",
    "AuditEntry",
    "AuditRecord",
    "CredentialChange",
    "CredentialFields",
    "CredentialRecord",
    "CredentialStore",
    "CredentialUsage",
    "EgressRecord",
    "KeyService",
    "KeyState",
    "OrgKeyRecord",
    "credential_view",
    "egress_view",
    "new_credential_id",
    "scope_id_of",
]
