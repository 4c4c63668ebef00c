"""What an E2B sandbox asks of SPACE's own sandbox options: metadata, pause-on-timeout and a deadline
that can be reset (`set_timeout`) or only extended (`connect`).

Invariants:
- These are SPACE features (issue 13 adds them to SPACE's own API first); the E2B front passes them
  through and adds nothing of its own. Where this build of SPACE lacks one, the request is refused with
  501 naming it (never silently ignored).
- E2B's `autoPause` is SPACE's `on_timeout: "pause"`; without it an expired sandbox is deleted (E2B: kill).
"""

from __future__ import annotations

import asyncio
from typing import Any

from space.controlplane.api.bodies import CreateSandbox
from space.controlplane.api.deps import Principal, Services
from space.controlplane.e2b.bodies import NewSandbox
from space.controlplane.e2b.errors import NotSupported
from space.controlplane.store.records import SandboxRecord


def with_create_options(fields: dict[str, Any], body: NewSandbox) -> CreateSandbox:
    """SPACE's create body: `fields` plus the sandbox options E2B asked for."""
    offered = CreateSandbox.model_fields
    if body.metadata:
        if "metadata" not in offered:
            raise NotSupported("sandbox metadata is not supported by this SPACE build", field="metadata")
        fields["metadata"] = body.metadata
    if body.auto_pause:
        if "on_timeout" not in offered:
            raise NotSupported("autoPause is not supported by this SPACE build", field="autoPause")
        fields["on_timeout"] = "pause"
    return CreateSandbox(**fields)


async def set_deadline(
    services: Services, who: Principal, sb: SandboxRecord, seconds: int, *, extend_only: bool
) -> SandboxRecord:
    """The sandbox's deadline becomes now + `seconds` (with `extend_only`, only if that is later)."""
    setter = getattr(services.store, "set_deadline", None)
    if setter is None:
        if extend_only:
            return sb  # nothing to extend in a build without resettable deadlines: the create's ttl holds
        raise NotSupported("set_timeout is not supported by this SPACE build", field="timeout")
    updated: SandboxRecord = await asyncio.to_thread(setter, sb.id, seconds, extend_only=extend_only)
    return updated
