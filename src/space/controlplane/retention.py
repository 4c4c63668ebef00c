"""Retention of rows that only grow: idempotency records and the credential audit log (ADR 0025).

Invariants:
- A row is deleted only once it is older than its retention: idempotency records after
  SPACE_RETENTION_IDEMPOTENCY_S (default 24 h: a retry with the same Idempotency-Key replays the first
  answer for that long), audit entries after SPACE_RETENTION_AUDIT_S (default 30 days).
- Deletes go in bounded batches (`batch` rows, one short transaction each) and a run stops after
  `max_batches`, so a large backlog never holds locks for long nor starves other housekeeping; the next
  run goes on where this one stopped.
- The settings are ControlPlaneSettings' `retention_*` fields (space.controlplane.settings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from space.controlplane.settings import ControlPlaneSettings, default_of
from space.controlplane.store.credentials import CredentialStore
from space.controlplane.store.store import Store


@dataclass(frozen=True)
class RetentionSettings:
    """ControlPlaneSettings' `retention_<field>` fields."""

    idempotency_s: float = default_of("retention_idempotency_s")
    audit_s: float = default_of("retention_audit_s")
    batch: int = default_of("retention_batch")
    max_batches: int = default_of("retention_max_batches")

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> RetentionSettings:
        return cls(**{spec.name: getattr(settings, "retention_" + spec.name) for spec in fields(cls)})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionSettings:
        return cls.of(ControlPlaneSettings.from_env(environ))


async def purge_expired(store: Store, settings: RetentionSettings | None = None) -> dict[str, int]:
    """Delete what is past its retention (bounded, see the module invariants); rows deleted per table."""
    settings = settings or RetentionSettings.from_env()
    audit = CredentialStore(store)
    batch = settings.batch
    return {
        "idempotency_records": await _in_batches(
            lambda: store.purge_idempotency(settings.idempotency_s, limit=batch), settings
        ),
        "credential_audit": await _in_batches(
            lambda: audit.purge_audit(settings.audit_s, limit=batch), settings
        ),
    }


async def _in_batches(delete_batch: Callable[[], int], settings: RetentionSettings) -> int:
    total = 0
    for _ in range(settings.max_batches):
        deleted = await asyncio.to_thread(delete_batch)
        total += deleted
        if deleted < settings.batch:
            break
    return total
