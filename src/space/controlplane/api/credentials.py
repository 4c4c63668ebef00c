"""Credential routes (issue 5; ADR 0017, 0026): set or rotate, list, delete, and read the audit log.

  PUT    /v1/credentials/{name}             set or rotate (value write-only) + metadata; project admin key
                                            (org scope: org admin key); members only bind (egress.py)
  GET    /v1/credentials                    metadata of the org's, the project's and its sandboxes' ones,
                                            each with its usage (injections, refusals, newest of each)
  DELETE /v1/credentials/{name}             ?scope=&sandbox_id=&project=
  GET    /v1/credentials/{name}/audit       ?scope=&sandbox_id=&project=&after=&limit=
  POST   /v1/sandboxes/{id}/credentials/{name}/login   a bound login credential's origin and the
                                            placeholders to type into its form (ADR 0063); member key

Invariants:
- No answer to an API key ever carries a credential value or vault reference.
- Another project's credential or sandbox answers exactly like a missing one (404).
- Every change (set, rotate, update, delete) is in the audit log.
- Usage counts come from the audit log like the audit route: a project key counts only its project's uses
  of a credential (an org credential's uses in other projects are not its business).
- Credentials by capability: only admin keys create, rotate, change or delete a credential (org scope:
  org admin keys); a member key binds existing credentials to its sandboxes and nothing more, so it
  cannot send a value to a host the credential was not made for.
- A value is checked against the injection it will be used with (the stored one or the new one).
- A `login` credential (ADR 0063) is bound to one https origin: its hosts are that origin's host, its value
  is given as username + password (both at once), and its placeholders are handed to a sandbox only for
  a credential bound to it (its egress policy names it).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from space.controlplane.api.bodies import PutCredential, Scope
from space.controlplane.api.deps import (
    Auth,
    Principal,
    Services,
    Svc,
    actor,
    credential_service,
    require_org_admin,
    resolve_project,
    sandbox_of,
)
from space.controlplane.api.login_binding import audit_login, bound_login
from space.controlplane.api.views import (
    AuditLog,
    CredentialChange,
    CredentialDeleted,
    Credentials,
    LoginPlaceholders,
    audit_view,
)
from space.controlplane.credentials import login, spec
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.credentials import (
    CredentialFields,
    CredentialUsage,
    credential_view,
)
from space.controlplane.store.store import Store
from space.core import errors

router = APIRouter()

#: (org id, project id, sandbox id, scope id) of a credential reference.
Owner = tuple[str, str | None, str | None, str]


async def owner(
    services: Services, who: Principal, scope: str, project_ref: str | None, sandbox_id: str | None
) -> Owner:
    """Where a credential reference lives, checked for the caller's reach."""
    project_id = await resolve_project(services, who, project_ref)
    if scope in ("org", "project") and sandbox_id is not None:
        raise errors.InvalidArgument("sandbox_id is only for scope 'sandbox'", field="sandbox_id")
    if scope == "org":
        return who.key.org_id, None, None, who.key.org_id
    if scope == "project":
        return who.key.org_id, project_id, None, project_id
    if scope != "sandbox":
        raise errors.InvalidArgument(f"invalid scope {scope!r}", field="scope")
    if sandbox_id is None:
        raise errors.InvalidArgument("scope 'sandbox' needs sandbox_id", field="sandbox_id")
    sb = await sandbox_of(services, project_id, sandbox_id, "sandbox_id")
    return who.key.org_id, project_id, sb.id, sb.id


def may_change(who: Principal, scope: str) -> None:
    """Credentials by capability: an admin key of the project (or the org) makes and changes them; a
    member only binds existing ones to its sandboxes (module invariants)."""
    if scope == "org":
        require_org_admin(who, "change org credentials")
    elif who.role != "admin":
        raise errors.PermissionDenied(
            f"a {who.role} key may not create, change or delete credentials (needs a project admin key); "
            "members bind existing credentials to sandboxes (create with credentials, PUT egress)"
        )


async def _checked_value(
    service: CredentialService,
    body: PutCredential,
    scope_id: str,
    name: str,
    injection: spec.Injection | None,
) -> bytes | None:
    current = await asyncio.to_thread(service.credentials.get_credential, scope_id, name)
    effective = injection or (current.injection if current else spec.parse_injection(None))
    if current is not None and (current.injection.method == "login") != (effective.method == "login"):
        raise errors.InvalidArgument(
            "a credential cannot change between method 'login' and the others (delete and create it)",
            field="method",
        )
    if effective.method == "login":
        if body.hosts is not None:
            raise errors.InvalidArgument(
                "a login credential's host is its origin's (change login.origin)", field="hosts"
            )
        if body.value is not None:
            raise errors.InvalidArgument(
                "a login credential takes username and password, not value", field="value"
            )
        if body.username is None and body.password is None:
            return None
        return login.login_value(body.username, body.password)
    if body.username is not None or body.password is not None:
        raise errors.InvalidArgument("username and password are only for method 'login'", field="username")
    if body.value is None:
        return None
    return spec.validate_value(body.value, effective)


def _injection(body: PutCredential) -> spec.Injection | None:
    if body.method == "login" or body.login is not None:
        if body.method not in (None, "login") or body.header is not None or body.query_param is not None:
            raise errors.InvalidArgument("login is only for method 'login'", field="login")
        if body.login is None:
            raise errors.InvalidArgument("method 'login' needs login (origin and field names)", field="login")
        form = body.login
        injection = login.parse_login(form.origin, form.username_field, form.password_field, form.form_action)
        if body.hosts is not None:
            raise errors.InvalidArgument("a login credential's host is its origin's: no hosts", field="hosts")
        return injection
    if body.method is not None or body.header is not None or body.query_param is not None:
        return spec.parse_injection(body.method, body.header, body.query_param)
    return None


def _fields(body: PutCredential, injection: spec.Injection | None, store: Store) -> CredentialFields:
    """The metadata a PUT changes, validated; an explicit null clears expiry or rate."""
    explicit = body.model_fields_set
    hosts = spec.normalize_hosts(body.hosts) if body.hosts is not None else None
    if injection is not None and injection.login is not None:
        hosts = [injection.login.host]
    return CredentialFields(
        hosts=hosts,
        injection=injection,
        env_var=spec.validate_env_var(body.env_var) if body.env_var is not None else None,
        expires_at=spec.validate_expiry(body.expires_at, store.now()),
        clear_expiry="expires_at" in explicit and body.expires_at is None,
        rate_per_minute=spec.validate_rate(body.rate_per_minute),
        clear_rate="rate_per_minute" in explicit and body.rate_per_minute is None,
    )


@router.put("/v1/credentials/{name}", response_model=CredentialChange)
async def put_credential(name: str, body: PutCredential, who: Auth, services: Svc) -> dict[str, Any]:
    spec.validate_name(name)
    may_change(who, body.scope)
    service = credential_service(services)
    store = services.store
    org_id, project_id, sandbox_id, scope_id = await owner(
        services, who, body.scope, body.project, body.sandbox_id
    )
    injection = _injection(body)
    value = await _checked_value(service, body, scope_id, name, injection)
    change = await asyncio.to_thread(
        service.put, org_id=org_id, project_id=project_id, sandbox_id=sandbox_id, scope=body.scope,
        name=name, fields=_fields(body, injection, store), value=value, actor=actor(who),
    )  # fmt: skip
    return {**credential_view(change.record, store.now()), "action": change.action}


@router.get("/v1/credentials", response_model=Credentials)
async def list_credentials(who: Auth, services: Svc, project: str | None = None) -> dict[str, Any]:
    service = credential_service(services)
    project_id = await resolve_project(services, who, project)
    rows = await asyncio.to_thread(service.credentials.list_credentials, who.key.org_id, project_id)
    usage = await asyncio.to_thread(
        service.credentials.usage_of, who.key.org_id, [(row.id, row.name) for row in rows],
        project_id=who.key.project_id,
    )  # fmt: skip
    now = services.store.now()
    return {
        "credentials": [
            {**credential_view(row, now), "usage": usage_view(usage.get(row.id, CredentialUsage()))}
            for row in rows
        ]
    }


def usage_view(usage: CredentialUsage) -> dict[str, Any]:
    def iso(at: datetime | None) -> str | None:
        return at.isoformat() if at is not None else None

    return {
        "injected": usage.injected,
        "last_used_at": iso(usage.last_used_at),
        "refused": usage.refused,
        "last_refused_at": iso(usage.last_refused_at),
    }


@router.delete("/v1/credentials/{name}", response_model=CredentialDeleted)
async def delete_credential(
    name: str,
    who: Auth,
    services: Svc,
    *,
    scope: Scope = "project",
    sandbox_id: str | None = None,
    project: str | None = None,
) -> dict[str, Any]:
    spec.validate_name(name)
    may_change(who, scope)
    service = credential_service(services)
    _org, _project, _sandbox, scope_id = await owner(services, who, scope, project, sandbox_id)
    record = await asyncio.to_thread(service.delete, scope_id, name, actor=actor(who))
    return {"deleted": True, "name": record.name, "scope": record.scope, "id": record.id}


@router.get("/v1/credentials/{name}/audit", response_model=AuditLog)
async def credential_audit(
    name: str,
    who: Auth,
    services: Svc,
    *,
    scope: Scope = "project",
    sandbox_id: str | None = None,
    project: str | None = None,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    spec.validate_name(name)
    service = credential_service(services)
    org_id, _project, _sandbox, scope_id = await owner(services, who, scope, project, sandbox_id)
    # A project key reads what happened in its project only (an org credential is used everywhere).
    entries = await asyncio.to_thread(
        service.credentials.list_audit, org_id, name, scope=scope, scope_id=scope_id,
        project_id=who.key.project_id, limit=limit, after_id=after,
    )  # fmt: skip
    return {"entries": [audit_view(e) for e in entries]}


@router.post("/v1/sandboxes/{sandbox_id}/credentials/{name}/login", response_model=LoginPlaceholders)
async def login_placeholders(sandbox_id: str, name: str, who: Auth, services: Svc) -> dict[str, Any]:
    """What to type into a login form (ADR 0063): the bound login credential's origin and, per form field,
    the placeholder the egress gateway replaces in that origin's form submission. Never a value."""
    who.require("member")
    spec.validate_name(name)
    sb = await sandbox_of(services, who.project_id, sandbox_id, "sandbox_id")
    bound = await bound_login(services, sb, name)
    await audit_login(services, who, bound, "login_requested", {})
    form = bound.form
    return {
        "credential": name,
        "origin": form.origin,
        "form_action": form.form_action,
        "fields": {form.username_field: bound.username_placeholder, form.password_field: bound.placeholder},
    }
