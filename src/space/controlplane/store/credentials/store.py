"""`CredentialStore`: the credential repositories over the Database of a `Store`.

Invariants:
- A CredentialStore opens no sessions of its own: it runs on the one Database (session factory,
  transaction helper, clock) of the Store it is given (store/database.py), so a credential change and a
  store change see the same database the same way.
- Each public method is one short transaction returning frozen records (records.py), like Store.
"""

from __future__ import annotations

from space.controlplane.store.credentials.audit import AuditRepository
from space.controlplane.store.credentials.egress import EgressRepository
from space.controlplane.store.credentials.metadata import CredentialRepository
from space.controlplane.store.credentials.org_keys import OrgKeyRepository
from space.controlplane.store.credentials.vault_blobs import VaultBlobRepository
from space.controlplane.store.database import Repository
from space.controlplane.store.store import Store


class CredentialStore(
    CredentialRepository,
    AuditRepository,
    VaultBlobRepository,
    EgressRepository,
    OrgKeyRepository,
    Repository,
):
    """The credential tables (credentials, audit log, sealed values, egress policies, private networks,
    tenant keys), over the database and clock of `store`."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.database)
        self.store = store
