"""The credential service: vault + metadata store + audit, used by the API routes (sync; call from threads).

Invariants:
- A value is written to the vault BEFORE the row that references it, and the replaced value is deleted
  only AFTER the row stopped referencing it: a crash at any point leaves at worst an unreferenced sealed
  value, never a row pointing at nothing; `purge()` deletes such values once they are older than
  PURGE_GRACE_S (younger ones may belong to a put in flight), and the credentials of deleted sandboxes.
- Values leave this service only in `bundle_for_node`, only for credentials bound to that sandbox, and each
  such hand-out is audited as "fetched_by_node" in the same call.
- Expired credentials are never handed out (audited as "expired" instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from space.controlplane.credentials.login import split_login_value
from space.controlplane.credentials.spec import Scope, within_approval
from space.controlplane.credentials.vault import EncryptedLocalVault, VaultBackend
from space.controlplane.store.credentials import (
    AuditEntry,
    CredentialChange,
    CredentialFields,
    CredentialRecord,
    CredentialStore,
    EgressRecord,
    scope_id_of,
)
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors

log = logging.getLogger(__name__)

MASTER_KEY_FILENAME: Final = "credentials.master.key"
PURGE_GRACE_S: Final = 600.0  # an unreferenced value younger than this may be a put in flight
MAX_FORK_DEPTH: Final = 64  # a fork of a fork of ...: looked up this far for an inherited policy


@dataclass(frozen=True, slots=True)
class NodeBundle:
    """What a node gets for one sandbox: its policy, and the values of its bound, unexpired credentials."""

    sandbox_id: str
    policy: EgressRecord | None
    credentials: list[tuple[CredentialRecord, str]] = field(repr=False)  # (record, value): never in a repr
    missing: list[str]
    expired: list[str]
    private_networks: list[str] = field(default_factory=list)  # the project's org-approved ranges

    def to_wire(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "policy": {
                "allow": self.policy.allow if self.policy else [],
                "deny": self.policy.deny if self.policy else [],
                "version": self.policy.version if self.policy else 0,
                "private_networks": list(self.private_networks),
            },
            "credentials": [
                {
                    **_login_wire(record, value),
                    "name": record.name,
                    "scope": record.scope,
                    "value": _wire_value(record, value),
                    "hosts": record.hosts,
                    "method": record.injection.method,
                    "header_name": record.injection.header_name,
                    "header_template": record.injection.header_template,
                    "query_param": record.injection.query_param,
                    "placeholder": record.placeholder,
                    "env_var": record.env_var,
                    "expires_at": record.expires_at.isoformat() if record.expires_at else None,
                    "rate_per_minute": record.rate_per_minute,
                    "version": record.version,
                }
                for record, value in self.credentials
            ],
            "missing": self.missing,
            "expired": self.expired,
        }


def _login_wire(record: CredentialRecord, value: str) -> dict[str, Any]:
    """A login credential's form and username for the node (its `value` becomes the password alone)."""
    login = record.injection.login
    if record.injection.method != "login" or login is None:
        return {}
    username, _password = split_login_value(value)
    return {**login.to_json(), "username": username}


def _wire_value(record: CredentialRecord, value: str) -> str:
    return split_login_value(value)[1] if record.injection.method == "login" else value


class CredentialService:
    def __init__(self, store: Store, vault: VaultBackend, *, backends: Sequence[VaultBackend] = ()) -> None:
        self.store = store
        self.credentials = CredentialStore(store)
        self.vault = vault  # where new values go
        self._backends = {b.name: b for b in (*backends, vault)}  # where existing values may be
        self.last_purge = float("-inf")  # monotonic time of the last purge() started by the API

    @classmethod
    def open(cls, store: Store, data_dir: pathlib.Path) -> CredentialService:
        """The default: EncryptedLocalVault sealing into the SQL store, master key in `data_dir`."""
        data_dir.mkdir(parents=True, exist_ok=True)
        credentials = CredentialStore(store)
        return cls(store, EncryptedLocalVault.open(data_dir / MASTER_KEY_FILENAME, credentials))

    def backend(self, name: str) -> VaultBackend:
        try:
            return self._backends[name]
        except KeyError:
            raise errors.Unavailable(
                f"vault backend {name!r} is not configured on this control plane"
            ) from None

    def put(
        self,
        *,
        org_id: str,
        project_id: str | None,
        sandbox_id: str | None,
        scope: Scope,
        name: str,
        fields: CredentialFields,
        value: bytes | None,
        actor: str,
    ) -> CredentialChange:
        reference: str | None = None
        if value is not None:
            hint = f"{scope_id_of(scope, org_id, project_id, sandbox_id)}.{name}"
            reference = self.vault.put(hint, value)
        try:
            change = self.credentials.put_credential(
                org_id=org_id, project_id=project_id, sandbox_id=sandbox_id, scope=scope, name=name,
                fields=fields, vault=self.vault.name, vault_ref=reference, actor=actor,
            )  # fmt: skip
        except BaseException:
            if reference is not None:
                with contextlib.suppress(Exception):
                    self.vault.delete(reference)
            raise
        if change.stale_ref is not None and change.stale_vault is not None:
            self._forget(change.stale_vault, change.stale_ref)
        return change

    def _forget(self, backend: str, reference: str) -> None:
        try:
            self.backend(backend).delete(reference)
        except Exception:  # the row no longer points at it: an unreferenced value, found and purged later
            log.warning("could not delete a replaced credential value from vault %s", backend, exc_info=True)

    def delete(self, scope_id: str, name: str, *, actor: str) -> CredentialRecord:
        record = self.credentials.delete_credential(scope_id, name, actor=actor)
        self._forget(record.vault, record.vault_ref)
        return record

    def effective_egress(self, sandbox: SandboxRecord) -> EgressRecord | None:
        """The sandbox's policy; a fork without a policy of its own has its source's (as it was when
        looked up), so a child starts with the egress and bindings of its parent."""
        current: SandboxRecord | None = sandbox
        for _depth in range(MAX_FORK_DEPTH):
            if current is None:
                return None
            policy = self.credentials.get_egress(current.id)
            if policy is not None or current.forked_from is None:
                return policy
            current = self.store.load_sandbox(current.forked_from)
        return None

    def purge(self, *, unreferenced_older_than_s: float = PURGE_GRACE_S) -> dict[str, int]:
        """Housekeeping: delete sealed values no row points at any more (a crash between the steps of a
        put or delete), and the credentials of deleted sandboxes (audited as deleted by "system")."""
        removed = 0
        for record in self.credentials.credentials_of_deleted_sandboxes():
            with contextlib.suppress(errors.NotFound):  # a concurrent purge or delete was first
                self.delete(record.scope_id, record.name, actor="system:sandbox-deleted")
                removed += 1
        blobs = 0
        if isinstance(self.vault, EncryptedLocalVault):
            for reference in self.credentials.unreferenced_blobs(unreferenced_older_than_s):
                self.vault.delete(reference)
                blobs += 1
        return {"credentials": removed, "values": blobs}

    def bundle_for_node(self, node_id: str, sandbox: SandboxRecord, org_id: str) -> NodeBundle:
        """The policy and credential values of `sandbox` (the caller checked it runs on `node_id`)."""
        policy = self.effective_egress(sandbox)
        # The project's approval as it is now (an org admin may have narrowed it since the policy was
        # written): a node never gets a private range the project may no longer name, and gets the
        # approval itself so its gateway checks the same (ADR 0026).
        approved = self.credentials.get_private_networks(sandbox.project_id)
        if policy is not None:
            policy = dataclasses.replace(policy, allow=within_approval(policy.allow, approved))
        names = policy.credentials if policy else []
        resolved = self.credentials.resolve(org_id, sandbox.project_id, sandbox.id, names)
        now = self.store.now()
        handed: list[tuple[CredentialRecord, str]] = []
        missing: list[str] = []
        expired: list[str] = []
        entries: list[AuditEntry] = []
        actor = f"node:{node_id}"
        for name in names:
            record = resolved.get(name)
            if record is None:
                missing.append(name)
                continue
            base = {
                "org_id": org_id, "project_id": sandbox.project_id, "sandbox_id": sandbox.id,
                "credential_id": record.id, "credential_name": name, "scope": record.scope, "actor": actor,
            }  # fmt: skip
            if record.expired(now):
                expired.append(name)
                entries.append(AuditEntry(action="expired", detail={"version": record.version}, **base))
                continue
            value = self.backend(record.vault).get(record.vault_ref).decode("utf-8")
            handed.append((record, value))
            entries.append(AuditEntry(action="fetched_by_node", detail={"version": record.version}, **base))
        self.credentials.audit(entries)
        return NodeBundle(sandbox.id, policy, handed, missing, expired, approved)
