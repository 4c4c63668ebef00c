"""BYOK admin routes: an org's tenant key (the key that wraps the data keys of everything its sandboxes
upload to object storage). Org admin keys only.

  GET  /v1/org/encryption-key            the registered key (service, key id, state, times)
  PUT  /v1/org/encryption-key            {"service": "local"|"kms", "key_id": ...}: register (local without a
                                         key id: create a new local key); checked by issuing one data key
  POST /v1/org/encryption-key/rotate     new key version for new data; old snapshots still open
  POST /v1/org/encryption-key/revoke     final: every snapshot wrapped by it becomes unrestorable
                                         (restores fail with 403 key_revoked), nothing new is written

Invariants:
- The key services are the ones the control plane's DataKeys provider uses (space.controlplane.keys), so a
  rotation or revocation here acts on exactly the key that wraps the org's data.
- Replacing the registered key does not revoke the old one: snapshots name the key that wrapped them
  ("<service>:<key id>"), so they stay restorable until that key itself is revoked.
- Every change is written to the audit log (credential_audit, action "org_key_*") in the same transaction
  as the change.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from space.controlplane.api.bodies import OrgKeyBody
from space.controlplane.api.deps import Auth, Principal, Services, Svc, credential_service, require_org_admin
from space.controlplane.api.views import OrgKey, key_view
from space.controlplane.store.credentials import AuditEntry, OrgKeyRecord
from space.core import errors
from space.crypto.keys import KeyService

router = APIRouter()


def key_services(services: Services) -> dict[str, KeyService]:
    """The key services of the control plane's DataKeys provider (OrgDataKeys.services)."""
    for holder in (services, services.reconciler):
        provider = getattr(holder, "data_keys", None)
        found = getattr(provider, "services", None)
        if isinstance(found, dict):
            return found
    raise errors.Unavailable("this control plane has no key service configured (no data keys provider)")


def add_kms(services: Services, url: str | None) -> None:
    """With a KMS url (`kms://?endpoint=...&region=...`, settings.kms_url), orgs may register KMS keys
    (BYOK): the KMS service joins the key services of the control plane's DataKeys provider."""
    provider = getattr(services.reconciler, "data_keys", None)
    known = getattr(provider, "services", None)
    if url and isinstance(known, dict) and "kms" not in known:
        from space.crypto.keys import open_key_service

        known["kms"] = open_key_service(url)


def _service(services: Services, name: str) -> KeyService:
    service = key_services(services).get(name)
    if service is None:
        raise errors.InvalidArgument(
            f"key service {name!r} is not configured on this control plane", field="service"
        )
    return service


def _org_admin(who: Principal) -> None:
    require_org_admin(who, "manage the org's encryption key")


def _audit(who: Principal, action: str) -> AuditEntry:
    # Written by the store in the same transaction as the change it records.
    return AuditEntry(org_id=who.key.org_id, action=action, actor=f"key:{who.key.id}")


async def _current(services: Services, who: Principal) -> OrgKeyRecord:
    record = await asyncio.to_thread(credential_service(services).credentials.get_org_key, who.key.org_id)
    if record is None:
        raise errors.NotFound(
            "this organization has no registered encryption key (a local one is created on first use)"
        )
    return record


async def _mark(
    services: Services, who: Principal, action: str, *, rotated: bool = False, revoked: bool = False
) -> dict[str, Any]:
    store = credential_service(services).credentials
    record = await asyncio.to_thread(
        store.mark_org_key, who.key.org_id, rotated=rotated, revoked=revoked, audit=_audit(who, action)
    )
    return key_view(record)


@router.get("/v1/org/encryption-key", response_model=OrgKey)
async def get_key(who: Auth, services: Svc) -> dict[str, Any]:
    _org_admin(who)
    return key_view(await _current(services, who))


@router.put("/v1/org/encryption-key", response_model=OrgKey)
async def put_key(body: OrgKeyBody, who: Auth, services: Svc) -> dict[str, Any]:
    _org_admin(who)
    service = _service(services, body.service)
    key_id = body.key_id
    if key_id is None:
        if body.service != "local":
            raise errors.InvalidArgument("a kms key is registered by its key_id", field="key_id")
        key_id = await asyncio.to_thread(service.create_key, f"space org {who.key.org_id}")
    # Proves the key exists, is enabled and usable by this control plane before anything depends on it.
    await asyncio.to_thread(service.generate_data_key, key_id)
    store = credential_service(services).credentials
    record = await asyncio.to_thread(
        store.set_org_key, who.key.org_id, body.service, key_id, audit=_audit(who, "org_key_set")
    )
    return key_view(record)


@router.post("/v1/org/encryption-key/rotate", response_model=OrgKey)
async def rotate_key(who: Auth, services: Svc) -> dict[str, Any]:
    _org_admin(who)
    record = await _current(services, who)
    if record.state == "revoked":
        raise errors.KeyRevoked("the organization's encryption key is revoked; register a new one")
    await asyncio.to_thread(_service(services, record.service).rotate_key, record.key_id)
    return await _mark(services, who, "org_key_rotate", rotated=True)


@router.post("/v1/org/encryption-key/revoke", response_model=OrgKey)
async def revoke_key(who: Auth, services: Svc) -> dict[str, Any]:
    _org_admin(who)
    record = await _current(services, who)
    # The key service first: once it refuses, nothing opens, whatever happens to the row afterwards.
    await asyncio.to_thread(_service(services, record.service).revoke_key, record.key_id)
    return await _mark(services, who, "org_key_revoke", revoked=True)
