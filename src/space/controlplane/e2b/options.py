"""What an E2B sandbox asks of SPACE's own sandbox options (ADR 0048): metadata, pause-on-timeout and a
deadline that can be reset (`set_timeout`) or only extended (`connect`).

Invariants:
- These are SPACE features (issue 13 added them to SPACE's own API first); the E2B front passes them
  through and adds nothing of its own: the bounds on metadata are SPACE's (400 naming `metadata`).
- E2B's `autoPause` is SPACE's `on_timeout: "pause"` (the expired sandbox is kept suspended, and
  `connect` brings it back); without it an expired sandbox is deleted (E2B: killed).
"""

from __future__ import annotations

import asyncio
from typing import Any

from space.controlplane.api.bodies import CreateSandbox
from space.controlplane.api.deps import Services
from space.controlplane.e2b.bodies import NewSandbox
from space.controlplane.store.records import SandboxRecord
from space.core.sandbox_options import OnTimeout


def on_timeout(body: NewSandbox) -> OnTimeout:
    return "pause" if body.auto_pause else "delete"


def with_create_options(fields: dict[str, Any], body: NewSandbox) -> CreateSandbox:
    """SPACE's create body: `fields` plus the sandbox options E2B asked for."""
    return CreateSandbox(**fields, metadata=body.metadata or {}, on_timeout=on_timeout(body))


async def set_deadline(
    services: Services, sb: SandboxRecord, seconds: int, *, extend_only: bool
) -> SandboxRecord:
    """The sandbox's deadline becomes now + `seconds` (with `extend_only`, only if that is later)."""
    updated = await asyncio.to_thread(services.store.set_deadline, sb.id, seconds, extend_only=extend_only)
    services.forget(sb.id)
    if updated.expires_at is not None and updated.expires_at <= services.store.now():
        services.reconciler.poke()  # passed already (timeout 0): act on it now
    return updated
