"""Data keys for what leaves a node for object storage: one fresh data key per artifact, wrapped by the
tenant's (org's) key.

Invariants:
- Every org has one tenant key. If an admin registered one (BYOK, the `org_keys` table kept by
  space.controlplane.store.credentials), that one is used; otherwise a key is created in the control plane's
  embedded LocalKeyService on first use and registered as the org's key.
- The key that wrapped an artifact is named on the records that point to it, as "<service>:<key id>"
  (snapshots.data_key_id, sandboxes.data_key_id), so `unwrap` goes to the service and key that actually
  wrapped it: rotating the org key, or registering another one, keeps old snapshots readable; revoking the
  key makes them unreadable (KeyRevoked), on purpose.
- A revoked org key is never used to wrap new data (KeyRevoked): a suspend fails visibly instead of writing
  data its owner has declared unreadable.
- Nothing here logs or returns plaintext keys except to the caller that sends them to a node.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Protocol

from space.controlplane.store.credentials import CredentialStore
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.crypto.envelope import DataKey
from space.crypto.keys import KeyService, LocalKeyService

LOCAL: Final = "local"


class DataKeys(Protocol):
    def for_sandbox(self, sandbox: SandboxRecord) -> DataKey | None:
        """A fresh data key for an artifact of this sandbox (None: store it unencrypted). Its key_id is
        the qualified "<service>:<key id>" to record next to the wrapped key."""

    def unwrap(self, sandbox: SandboxRecord, key_id: str, wrapped: bytes) -> bytes:
        """The plaintext data key of an artifact of this sandbox; KeyRevoked / NotFound / KeyUnavailable."""


def qualify(service: str, key_id: str) -> str:
    return f"{service}:{key_id}"


def split_key_id(qualified: str) -> tuple[str, str]:
    service, sep, key_id = qualified.partition(":")
    if not sep or not key_id:
        raise errors.InvalidArgument(f"malformed data key id {qualified!r}", field="data_key_id")
    return service, key_id


class OrgDataKeys:
    """The default DataKeys: one tenant key per org (BYOK if registered, else a local one)."""

    def __init__(self, store: Store, services: Mapping[str, KeyService]) -> None:
        if LOCAL not in services:
            raise ValueError("OrgDataKeys needs a 'local' key service for orgs without their own key")
        self.store = store
        self.credentials = CredentialStore(store)
        self.services = dict(services)
        self._orgs: dict[str, str] = {}  # project id -> org id (never changes)
        self._lock = threading.Lock()

    @classmethod
    def local(cls, store: Store, directory: Path, **more: KeyService) -> OrgDataKeys:
        return cls(store, {LOCAL: LocalKeyService(directory), **more})

    def _org_of(self, sandbox: SandboxRecord) -> str:
        org = self._orgs.get(sandbox.project_id)
        if org is None:
            project = self.store.get_project(sandbox.project_id)
            if project is None:
                raise errors.NotFound(f"project {sandbox.project_id} not found")
            org = self._orgs[sandbox.project_id] = project.org_id
        return org

    def _service(self, name: str) -> KeyService:
        service = self.services.get(name)
        if service is None:
            raise errors.KeyUnavailable(f"key service {name!r} is not configured on this control plane")
        return service

    def org_key(self, org_id: str) -> tuple[str, str]:
        """(service name, key id) of the org's tenant key, creating a local one on first use."""
        record = self.credentials.get_org_key(org_id)
        if record is None:
            with self._lock:  # one creation per process; a concurrent replica's twin is merely unused
                record = self.credentials.get_org_key(org_id)
                if record is None:
                    key_id = self._service(LOCAL).create_key(f"space org {org_id}")
                    record = self.credentials.set_org_key(org_id, LOCAL, key_id)
        if record.state == "revoked":
            raise errors.KeyRevoked(f"the encryption key of org {org_id} is revoked: nothing new is written")
        return record.service, record.key_id

    def for_sandbox(self, sandbox: SandboxRecord) -> DataKey | None:
        service, key_id = self.org_key(self._org_of(sandbox))
        key = self._service(service).generate_data_key(key_id)
        return DataKey(key_id=qualify(service, key_id), wrapped=key.wrapped, plaintext=key.plaintext)

    def unwrap(self, sandbox: SandboxRecord, key_id: str, wrapped: bytes) -> bytes:
        service, raw_id = split_key_id(key_id)
        return self._service(service).decrypt_data_key(raw_id, wrapped)
