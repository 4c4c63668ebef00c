"""Retention of rows that only grow: idempotency records and the credential audit log (ADR 0025).

Invariants:
- A row is deleted only once it is older than its retention: idempotency records after
  SPACE_RETENTION_IDEMPOTENCY_S (default 24 h: a retry with the same Idempotency-Key replays the first
  answer for that long), audit entries after SPACE_RETENTION_AUDIT_S (default 30 days).
- Deletes go in bounded batches (`BATCH` rows, one short transaction each) and a run stops after
  `MAX_BATCHES`, so a large backlog never holds locks for long nor starves other housekeeping; the next
  run goes on where this one stopped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from space.controlplane.store.credentials import CredentialStore
from space.controlplane.store.store import Store
from space.core import errors

BATCH = 1000
MAX_BATCHES = 50


@dataclass(frozen=True)
class RetentionSettings:
    idempotency_s: float = 24 * 3600.0
    audit_s: float = 30 * 24 * 3600.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionSettings:
        environ = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for name, var in (
            ("idempotency_s", "SPACE_RETENTION_IDEMPOTENCY_S"),
            ("audit_s", "SPACE_RETENTION_AUDIT_S"),
        ):
            raw = environ.get(var)
            if raw is None or not raw.strip():
                continue
            try:
                values[name] = float(raw)
            except ValueError as exc:
                raise errors.InvalidArgument(f"{var}={raw!r} is not a number of seconds") from exc
            if values[name] <= 0:
                raise errors.InvalidArgument(f"{var} must be positive")
        return cls(**values)


async def purge_expired(store: Store, settings: RetentionSettings | None = None) -> dict[str, int]:
    """Delete what is past its retention (bounded, see the module invariants); rows deleted per table."""
    settings = settings or RetentionSettings.from_env()
    audit = CredentialStore(store)
    return {
        "idempotency_records": await _in_batches(
            lambda: store.purge_idempotency(settings.idempotency_s, limit=BATCH)
        ),
        "credential_audit": await _in_batches(lambda: audit.purge_audit(settings.audit_s, limit=BATCH)),
    }


async def _in_batches(batch: Callable[[], int]) -> int:
    total = 0
    for _ in range(MAX_BATCHES):
        deleted = await asyncio.to_thread(batch)
        total += deleted
        if deleted < BATCH:
            break
    return total
