"""A `login` credential bound to a sandbox, as the routes that hand its placeholders out see it: the
placeholder route (ADR 0063) and the browser's page fill (ADR 0066).

Invariants:
- Bound means named by the sandbox's effective egress policy and resolved by scope as for the node's
  hand-out; an unbound, non-login or missing credential is 404 (the same answer), an expired one 409.
- The caller has already looked the sandbox up for its key (another project's sandbox is 404 there).
- Every hand-out of placeholders is audited with the credential's version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from space.controlplane.api.deps import Principal, Services, actor, credential_service
from space.controlplane.credentials import login
from space.controlplane.credentials.spec import LoginForm
from space.controlplane.store.credentials import AuditEntry, CredentialRecord
from space.controlplane.store.records import SandboxRecord
from space.core import errors


@dataclass(frozen=True)
class BoundLogin:
    sandbox: SandboxRecord
    org_id: str
    record: CredentialRecord
    form: LoginForm

    @property
    def placeholder(self) -> str:
        """The password's placeholder (the credential's own)."""
        return self.record.placeholder

    @property
    def username_placeholder(self) -> str:
        return login.login_username_placeholder(self.record.placeholder)


async def bound_login(services: Services, sb: SandboxRecord, name: str) -> BoundLogin:
    """The login credential `name` bound to `sb` (module invariants)."""
    service = credential_service(services)
    project = await asyncio.to_thread(services.store.get_project, sb.project_id)
    if project is None:
        raise errors.NotFound(f"project {sb.project_id} not found")
    policy = await asyncio.to_thread(service.effective_egress, sb)
    missing = errors.NotFound(f"no login credential {name!r} is bound to sandbox {sb.id}", field="name")
    if policy is None or name not in policy.credentials:
        raise missing
    resolved = await asyncio.to_thread(
        service.credentials.resolve, project.org_id, sb.project_id, sb.id, [name]
    )
    record = resolved.get(name)
    if record is None or record.injection.login is None:
        raise missing
    if record.expired(services.store.now()):
        raise errors.Conflict(f"credential {name!r} has expired (rotate it with a new expiry)", field="name")
    return BoundLogin(sb, project.org_id, record, record.injection.login)


async def audit_login(
    services: Services, who: Principal, bound: BoundLogin, action: str, detail: dict[str, Any]
) -> None:
    """One audit entry about `who`'s use of a bound login credential."""
    record, sb = bound.record, bound.sandbox
    await asyncio.to_thread(
        credential_service(services).credentials.audit,
        [
            AuditEntry(
                org_id=bound.org_id, action=action, actor=actor(who), project_id=sb.project_id,
                sandbox_id=sb.id, credential_id=record.id, credential_name=record.name, scope=record.scope,
                host=bound.form.host, detail={"version": record.version, **detail},
            )
        ],
    )  # fmt: skip
