"""How the E2B front finds a caller's sandbox: as E2B's view shows it.

Invariants:
- A malformed id, a missing sandbox, another project's, a deleted one and one being deleted are all the
  same 404 (E2B's SDK turns it into SandboxNotFoundException), and nothing about which it was leaks.
"""

from __future__ import annotations

from space.controlplane.api.deps import Principal, Services, find_sandbox
from space.controlplane.e2b.views import visible
from space.controlplane.store.records import SandboxRecord
from space.core import errors
from space.core.ids import parse_sandbox_id


def _not_found(sandbox_id: str) -> errors.NotFound:
    return errors.NotFound(f"sandbox {sandbox_id[:80]} not found")


async def shown_sandbox(services: Services, who: Principal, sandbox_id: str) -> SandboxRecord:
    try:
        parse_sandbox_id(sandbox_id, field="sandboxID")
        sb = await find_sandbox(services, who, sandbox_id)
    except (errors.InvalidArgument, errors.NotFound) as exc:
        raise _not_found(sandbox_id) from exc
    if not visible(sb):
        raise _not_found(sandbox_id)
    return sb
