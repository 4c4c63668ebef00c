"""The default vault's sealed values (`vault_secrets`): AES-GCM ciphertext under an opaque reference.

Invariants:
- Only ciphertext is stored (sealed by space.controlplane.credentials.vault); a reference is written once
  (a second put of it is AlreadyExists) and never overwritten.
- A value no credential points at is left by a crash between the vault write and the row update; it is
  found by `unreferenced_blobs` once older than a grace period (a younger one may be a put in flight).
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, select

from space.controlplane.store.database import Repository
from space.controlplane.store.models import Credential, VaultSecret
from space.core.errors import AlreadyExists


class VaultBlobRepository(Repository):
    """The vault_secrets table."""

    def put_blob(self, reference: str, sealed: bytes) -> None:
        with self._tx("storing a sealed value") as session:
            existing = session.get(VaultSecret, reference)
            if existing is not None:
                raise AlreadyExists("vault reference already used")
            session.add(VaultSecret(reference=reference, sealed=sealed, created_at=self.now()))

    def get_blob(self, reference: str) -> bytes | None:
        with self._tx("reading a sealed value") as session:
            row = session.get(VaultSecret, reference)
            return bytes(row.sealed) if row else None

    def delete_blob(self, reference: str) -> None:
        with self._tx("deleting a sealed value") as session:
            session.execute(delete(VaultSecret).where(VaultSecret.reference == reference))

    def unreferenced_blobs(self, older_than_s: float = 0.0) -> list[str]:
        """Sealed values no credential points at (left by a crash between vault write and row update),
        written more than `older_than_s` ago (younger ones may belong to a put in flight)."""
        cutoff = self.now() - timedelta(seconds=older_than_s)
        with self._tx("finding unreferenced sealed values") as session:
            used = select(Credential.vault_ref).where(Credential.vault == "local")
            query = select(VaultSecret.reference).where(
                VaultSecret.reference.not_in(used), VaultSecret.created_at <= cutoff
            )
            return list(session.scalars(query))
