"""Routes of the credential store, egress policies and tenant keys (issue 5); included by app.py.

Tenant routes (API key):
  PUT    /v1/credentials/{name}             set or rotate (value write-only) + metadata; project admin key
                                            (org scope: org admin key); members only bind (ADR 0026)
  GET    /v1/credentials                    metadata of the org's, the project's and its sandboxes' ones
  DELETE /v1/credentials/{name}             ?scope=&sandbox_id=
  GET    /v1/credentials/{name}/audit       ?scope=&sandbox_id=&after=&limit=
  GET    /v1/sandboxes/{id}/egress          the policy and bound credentials (no values)
  PUT    /v1/sandboxes/{id}/egress          change it at run time; pushed to the sandbox's node
  GET|PUT /v1/projects/{project}/private-networks   private CIDRs a project's allow lists may name (PUT:
                                            org admin key only)
  GET|PUT /v1/org/encryption-key, POST /v1/org/encryption-key/{rotate,revoke}   (org admin key; BYOK)
Node routes (the node's identity, the secret issued at that node's latest registration; ADR 0019):
  GET    /v1/nodes/{node_id}/sandboxes/{sid}/credentials   values, only for sandboxes assigned to that node
  POST   /v1/nodes/{node_id}/audit                         the gateway's uses/denials into the audit log

Invariants:
- No answer to an API key ever carries a credential value or vault reference.
- Another project's credential or sandbox answers exactly like a missing one (404).
- A node gets values only for a sandbox whose record names it as its node (403 otherwise, also for unknown
  sandboxes, so a node learns nothing about sandboxes elsewhere); every hand-out is audited.
- Every change (set, rotate, update, delete, bind, policy change) and every use is in the audit log.
- Credentials by capability: only admin keys create, rotate, change or delete a credential (org scope:
  org admin keys); a member key binds existing credentials to its sandboxes and nothing more, so it
  cannot send a value to a host the credential was not made for.
- A private range reaches a sandbox's allow list only inside a network an org admin opened for its
  project; what a node is handed is filtered by the project's current approval again.

(No `from __future__ import annotations` here: the routes are defined inside `router()` and FastAPI must
see their annotations as objects.)
"""

import asyncio
import contextlib
import functools
import logging
import os
import pathlib
import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query
from pydantic import BaseModel, ConfigDict, Field

from space.controlplane.api import app as cp_app
from space.controlplane.credentials import spec
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.credentials import (
    AuditEntry,
    AuditRecord,
    CredentialFields,
    CredentialRecord,
    EgressRecord,
    credential_view,
    egress_view,
)
from space.controlplane.store.records import ProjectRecord, SandboxRecord
from space.core import errors
from space.core.ids import parse_node_id, parse_sandbox_id
from space.core.lifecycle import State

log = logging.getLogger(__name__)

MAX_NODE_AUDIT_EVENTS = 1000
KMS_URL_ENV = "SPACE_KMS_URL"
PURGE_INTERVAL_S = 600.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PutCredential(_Body):
    value: str | None = Field(default=None, max_length=64 << 10, repr=False)  # write-only: never in a repr
    hosts: list[str] | None = None
    method: Literal["header", "bearer", "basic", "query"] | None = None
    header: str | None = Field(default=None, max_length=4096)
    query_param: str | None = None
    env_var: str | None = None
    scope: Literal["org", "project", "sandbox"] = "project"
    sandbox_id: str | None = None
    project: str | None = None
    expires_at: datetime | None = None
    rate_per_minute: int | None = None


class EgressBody(_Body):
    allow: list[str] | None = None
    deny: list[str] | None = None
    credentials: list[str] | None = None


NODE_AUDIT_ACTIONS = frozenset(
    {"injected", "denied", "rate_limited", "expired", "egress_denied", "placeholder_blocked"}
)


class NodeAuditEvent(BaseModel):
    """One gateway record. Lenient on purpose (best-effort channel): a malformed event is counted as
    rejected on its own instead of failing the whole batch, and long hosts are cut, not refused."""

    model_config = ConfigDict(extra="ignore")

    sandbox_id: str | None = None
    action: str = ""
    credential: str | None = None
    host: str | None = None
    at: float | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class NodeAuditBody(BaseModel):
    events: list[NodeAuditEvent] = Field(max_length=MAX_NODE_AUDIT_EVENTS)


class PrivateNetworksBody(_Body):
    allowed_private_networks: list[str] = Field(max_length=spec.MAX_PRIVATE_NETWORKS)


class OrgKeyBody(_Body):
    service: Literal["local", "kms"] = "local"
    key_id: str | None = Field(default=None, min_length=1, max_length=256)


def audit_view(entry: AuditRecord) -> dict[str, Any]:
    return {
        "id": entry.id,
        "at": entry.at.isoformat(),
        "action": entry.action,
        "actor": entry.actor,
        "credential": entry.credential_name,
        "credential_id": entry.credential_id,
        "scope": entry.scope,
        "project_id": entry.project_id,
        "sandbox_id": entry.sandbox_id,
        "host": entry.host,
        "detail": entry.detail,
    }


def _actor(who: "cp_app.Principal") -> str:
    return f"key:{who.key.id}"


def require_org_admin(who: "cp_app.Principal", to: str) -> None:
    """An org-wide key (no project) with the admin role, else PermissionDenied naming what it may not do."""
    if who.key.project_id is not None or who.role != "admin":
        raise errors.PermissionDenied(f"only an organization admin key may {to}")


def _binding_entry(
    action: Literal["bind", "unbind"],
    name: str,
    record: CredentialRecord | None,
    *,
    org_id: str,
    who: "cp_app.Principal",
    project_id: str,
    sandbox_id: str,
) -> AuditEntry:
    """The audit entry of binding credential `name` to a sandbox or unbinding it (`record`: what the name
    resolves to, None for an unbind of a credential that is gone)."""
    return AuditEntry(
        org_id=org_id, action=action, actor=_actor(who), project_id=project_id, sandbox_id=sandbox_id,
        credential_id=record.id if record else None, credential_name=name,
        scope=record.scope if record else None,
    )  # fmt: skip


async def resolve_project(services: "cp_app.Services", who: "cp_app.Principal", ref: str | None) -> str:
    """The project a request acts in: `ref` (name or id, within the key's org and reach) or the key's."""
    if ref is None:
        return who.project_id
    store = services.store
    project: ProjectRecord | None = await asyncio.to_thread(store.get_project_by_name, who.key.org_id, ref)
    if project is None and ref.startswith("prj-"):
        project = await asyncio.to_thread(store.get_project, ref)
    if project is None or project.org_id != who.key.org_id or who.key.project_id not in (None, project.id):
        raise errors.NotFound(f"project {ref!r} not found")
    return project.id


async def sandbox_of(
    services: "cp_app.Services", project_id: str, sandbox_id: str, field: str
) -> SandboxRecord:
    parse_sandbox_id(sandbox_id, field=field)
    sb = await asyncio.to_thread(services.store.get_sandbox, project_id, sandbox_id)
    if sb is None or sb.state == State.DELETED:
        raise errors.NotFound(f"sandbox {sandbox_id} not found", field=field)
    return sb


async def validate_bindings(
    credentials: CredentialService, org_id: str, project_id: str, sandbox_id: str | None, names: list[str]
) -> dict[str, CredentialRecord]:
    """Every name resolves to a credential visible to the sandbox (else NotFound naming the entry)."""
    for i, name in enumerate(names):
        spec.validate_name(name, f"credentials[{i}]")
    if len(set(names)) != len(names):
        raise errors.InvalidArgument("credentials: a name is listed twice", field="credentials")
    resolved = await asyncio.to_thread(credentials.credentials.resolve, org_id, project_id, sandbox_id, names)
    found: dict[str, CredentialRecord] = {}
    for i, name in enumerate(names):
        record = resolved.get(name)
        if record is None:
            raise errors.NotFound(
                f"no credential named {name!r} in this project or org", field=f"credentials[{i}]"
            )
        found[name] = record
    return found


async def prepare_create(
    services: "cp_app.Services",
    who: "cp_app.Principal",
    *,
    sandbox_id: str,
    allow: list[str],
    deny: list[str],
    credentials: list[str],
    env: dict[str, str],
) -> dict[str, str]:
    """For POST /v1/sandboxes: validate the policy and bindings, record the policy for `sandbox_id` BEFORE
    its sandbox row exists (so nothing ever runs without it), audit the bindings, and return the env with
    each bound credential's placeholder added under its env_var."""
    service = credential_service(services)
    bound = list(credentials)
    project = await asyncio.to_thread(services.store.get_project, who.project_id)
    if project is None:  # deleted since the key was checked
        raise errors.NotFound(f"project {who.project_id} not found")
    approved = await asyncio.to_thread(service.credentials.get_private_networks, who.project_id)
    allow_n, deny_n = spec.normalize_policy(allow, deny, "egress", approved=approved)
    records = await validate_bindings(service, project.org_id, who.project_id, None, bound)
    merged = dict(env)
    for name, record in records.items():
        if record.env_var in merged and merged[record.env_var] != record.placeholder:
            raise errors.InvalidArgument(
                f"env {record.env_var} is also where credential {name!r} puts its placeholder",
                field=f"env.{record.env_var}",
            )
        merged[record.env_var] = record.placeholder
    if allow_n or deny_n or bound:
        entry = functools.partial(
            _binding_entry, org_id=project.org_id, who=who, project_id=who.project_id, sandbox_id=sandbox_id
        )
        entries = [entry("bind", name, r) for name, r in records.items()]
        changed = AuditEntry(
            org_id=project.org_id, action="egress_policy_set", actor=_actor(who), project_id=who.project_id,
            sandbox_id=sandbox_id,
        )  # fmt: skip
        await asyncio.to_thread(
            service.credentials.put_egress, sandbox_id, who.project_id,
            allow=allow_n, deny=deny_n, credentials=bound, audit=changed, also=entries,
        )  # fmt: skip
    return merged


def credential_service(services: "cp_app.Services") -> CredentialService:
    service: CredentialService | None = getattr(services, "credential_service", None)
    if service is None:
        raise errors.Unavailable("the credential store is not configured on this control plane")
    _maybe_purge(service)
    return service


_purges: set["asyncio.Task[dict[str, int]]"] = set()


def _maybe_purge(service: CredentialService) -> None:
    """Start CredentialService.purge() in the background at most every PURGE_INTERVAL_S per process (the
    first credential request after start-up runs one); replicas may overlap, purge is idempotent."""
    now = time.monotonic()
    if now - service.last_purge < PURGE_INTERVAL_S:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    service.last_purge = now
    task = loop.create_task(asyncio.to_thread(service.purge))
    _purges.add(task)

    def done(finished: "asyncio.Task[dict[str, int]]") -> None:
        _purges.discard(finished)
        if not finished.cancelled() and finished.exception() is not None:
            log.warning("credential purge failed: %s", finished.exception())

    task.add_done_callback(done)


def install(services: "cp_app.Services", data_dir: pathlib.Path | None) -> APIRouter:
    """Open the credential service (vault master key in `data_dir`, default: next to a SQLite database)
    and return the router of this module's routes."""
    if data_dir is None:
        database = services.store.engine.url.database
        if services.store.dialect == "sqlite" and database and database != ":memory:":
            data_dir = pathlib.Path(database).resolve().parent
    if data_dir is not None:
        services.credential_service = CredentialService.open(services.store, data_dir)  # type: ignore[attr-defined]
    _add_kms(services, os.environ.get(KMS_URL_ENV))
    return router(services)


def _add_kms(services: "cp_app.Services", url: str | None) -> None:
    """With SPACE_KMS_URL (`kms://?endpoint=...&region=...`), orgs may register KMS keys (BYOK): the KMS
    service joins the key services of the control plane's DataKeys provider."""
    provider = getattr(services.reconciler, "data_keys", None)
    known = getattr(provider, "services", None)
    if url and isinstance(known, dict) and "kms" not in known:
        from space.crypto.keys import open_key_service

        known["kms"] = open_key_service(url)


def router(services: "cp_app.Services") -> APIRouter:
    r = APIRouter()
    store = services.store

    async def org_of(project_id: str) -> str:
        project = await asyncio.to_thread(store.get_project, project_id)
        if project is None:
            raise errors.NotFound(f"project {project_id} not found")
        return project.org_id

    async def owner(
        who: cp_app.Principal, scope: str, project_ref: str | None, sandbox_id: str | None
    ) -> tuple[str, str | None, str | None, str]:
        """(org id, project id, sandbox id, scope id) of a credential reference, checked for reach."""
        project_id = await resolve_project(services, who, project_ref)
        if scope == "org":
            if sandbox_id is not None:
                raise errors.InvalidArgument("sandbox_id is only for scope 'sandbox'", field="sandbox_id")
            return who.key.org_id, None, None, who.key.org_id
        if scope == "project":
            if sandbox_id is not None:
                raise errors.InvalidArgument("sandbox_id is only for scope 'sandbox'", field="sandbox_id")
            return who.key.org_id, project_id, None, project_id
        if scope != "sandbox":
            raise errors.InvalidArgument(f"invalid scope {scope!r}", field="scope")
        if sandbox_id is None:
            raise errors.InvalidArgument("scope 'sandbox' needs sandbox_id", field="sandbox_id")
        sb = await sandbox_of(services, project_id, sandbox_id, "sandbox_id")
        return who.key.org_id, project_id, sb.id, sb.id

    def may_change(who: cp_app.Principal, scope: str) -> None:
        """Credentials by capability: an admin key of the project (or the org) makes and changes them; a
        member only binds existing ones to its sandboxes (module invariants)."""
        if scope == "org":
            require_org_admin(who, "change org credentials")
        elif who.role != "admin":
            raise errors.PermissionDenied(
                f"a {who.role} key may not create, change or delete credentials (needs a project admin key); "
                "members bind existing credentials to sandboxes (create with credentials, PUT egress)"
            )

    # -- credentials -----------------------------------------------------------------------------------
    @r.put("/v1/credentials/{name}")
    async def put_credential(name: str, body: PutCredential, who: cp_app.Auth) -> dict[str, Any]:
        spec.validate_name(name)
        may_change(who, body.scope)
        service = credential_service(services)
        org_id, project_id, sandbox_id, scope_id = await owner(who, body.scope, body.project, body.sandbox_id)
        injection = None
        if body.method is not None or body.header is not None or body.query_param is not None:
            injection = spec.parse_injection(body.method, body.header, body.query_param)
        value: bytes | None = None
        if body.value is not None:
            # The value is checked against the injection it will be used with (stored or new).
            current = await asyncio.to_thread(service.credentials.get_credential, scope_id, name)
            effective = injection or (current.injection if current else spec.parse_injection(None))
            value = spec.validate_value(body.value, effective)
        explicit = body.model_fields_set
        fields = CredentialFields(
            hosts=spec.normalize_hosts(body.hosts) if body.hosts is not None else None,
            injection=injection,
            env_var=spec.validate_env_var(body.env_var) if body.env_var is not None else None,
            expires_at=spec.validate_expiry(body.expires_at, store.now()),
            clear_expiry="expires_at" in explicit and body.expires_at is None,
            rate_per_minute=spec.validate_rate(body.rate_per_minute),
            clear_rate="rate_per_minute" in explicit and body.rate_per_minute is None,
        )
        change = await asyncio.to_thread(
            service.put, org_id=org_id, project_id=project_id, sandbox_id=sandbox_id, scope=body.scope,
            name=name, fields=fields, value=value, actor=_actor(who),
        )  # fmt: skip
        return {**credential_view(change.record, store.now()), "action": change.action}

    @r.get("/v1/credentials")
    async def list_credentials(who: cp_app.Auth, project: str | None = None) -> dict[str, Any]:
        service = credential_service(services)
        project_id = await resolve_project(services, who, project)
        rows = await asyncio.to_thread(service.credentials.list_credentials, who.key.org_id, project_id)
        now = store.now()
        return {"credentials": [credential_view(row, now) for row in rows]}

    @r.delete("/v1/credentials/{name}")
    async def delete_credential(
        name: str,
        who: cp_app.Auth,
        scope: Literal["org", "project", "sandbox"] = "project",
        sandbox_id: str | None = None,
        project: str | None = None,
    ) -> dict[str, Any]:
        spec.validate_name(name)
        may_change(who, scope)
        service = credential_service(services)
        _org, _project, _sandbox, scope_id = await owner(who, scope, project, sandbox_id)
        record = await asyncio.to_thread(service.delete, scope_id, name, actor=_actor(who))
        return {"deleted": True, "name": record.name, "scope": record.scope, "id": record.id}

    @r.get("/v1/credentials/{name}/audit")
    async def credential_audit(
        name: str,
        who: cp_app.Auth,
        *,
        scope: Literal["org", "project", "sandbox"] = "project",
        sandbox_id: str | None = None,
        project: str | None = None,
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        spec.validate_name(name)
        service = credential_service(services)
        org_id, _project, _sandbox, scope_id = await owner(who, scope, project, sandbox_id)
        # A project key reads what happened in its project only (an org credential is used everywhere).
        only_project = who.key.project_id
        entries = await asyncio.to_thread(
            service.credentials.list_audit, org_id, name, scope=scope, scope_id=scope_id,
            project_id=only_project, limit=limit, after_id=after,
        )  # fmt: skip
        return {"entries": [audit_view(e) for e in entries]}

    # -- sandbox egress policies -----------------------------------------------------------------------
    @r.get("/v1/sandboxes/{sandbox_id}/egress")
    async def get_egress(sandbox_id: str, who: cp_app.Auth) -> dict[str, Any]:
        service = credential_service(services)
        sb = await sandbox_of(services, who.project_id, sandbox_id, "sandbox_id")
        policy = await asyncio.to_thread(service.effective_egress, sb)
        return egress_view(policy) | {"sandbox_id": sb.id}

    @r.put("/v1/sandboxes/{sandbox_id}/egress")
    async def put_egress(sandbox_id: str, body: EgressBody, who: cp_app.Auth) -> dict[str, Any]:
        who.require("member")
        service = credential_service(services)
        sb = await sandbox_of(services, who.project_id, sandbox_id, "sandbox_id")
        org_id = await org_of(sb.project_id)
        approved = await asyncio.to_thread(service.credentials.get_private_networks, sb.project_id)
        allow, deny = spec.normalize_policy(body.allow or [], body.deny or [], "egress", approved=approved)
        records: dict[str, CredentialRecord] = {}
        if body.credentials is not None:
            records = await validate_bindings(service, org_id, sb.project_id, sb.id, body.credentials)
        before = await asyncio.to_thread(service.effective_egress, sb)  # a fork's starts from its parent's
        kept = before or EgressRecord(sb.id, sb.project_id, [], [], [], 0, store.now())
        bindings: list[AuditEntry] = []
        entry = functools.partial(
            _binding_entry, org_id=org_id, who=who, project_id=sb.project_id, sandbox_id=sb.id
        )
        for name, record in records.items():
            if name not in kept.credentials:
                bindings.append(entry("bind", name, record))
        dropped = (
            sorted(set(kept.credentials) - set(body.credentials)) if body.credentials is not None else []
        )
        if dropped:
            previous = await asyncio.to_thread(
                service.credentials.resolve, org_id, sb.project_id, sb.id, dropped
            )
            for name in dropped:
                bindings.append(entry("unbind", name, previous.get(name)))
        changed = AuditEntry(
            org_id=org_id, action="egress_policy_set", actor=_actor(who), project_id=sb.project_id,
            sandbox_id=sb.id,
        )  # fmt: skip
        policy = await asyncio.to_thread(
            service.credentials.put_egress, sb.id, sb.project_id,
            allow=allow if body.allow is not None else kept.allow,
            deny=deny if body.deny is not None else kept.deny,
            credentials=body.credentials if body.credentials is not None else kept.credentials,
            audit=changed, also=bindings,
        )  # fmt: skip
        applied, node_error = await _push_policy(
            services, sb, allow=spec.within_approval(policy.allow, approved), deny=policy.deny,
            credentials=policy.credentials, version=policy.version, private_networks=approved,
        )  # fmt: skip
        return egress_view(policy) | {"sandbox_id": sb.id, "applied": applied, "node_error": node_error}

    # -- private networks of a project (org admin) -----------------------------------------------------
    @r.get("/v1/projects/{project}/private-networks")
    async def get_private_networks(project: str, who: cp_app.Auth) -> dict[str, Any]:
        service = credential_service(services)
        project_id = await resolve_project(services, who, project)
        networks = await asyncio.to_thread(service.credentials.get_private_networks, project_id)
        return {"project_id": project_id, "allowed_private_networks": networks}

    @r.put("/v1/projects/{project}/private-networks")
    async def put_private_networks(
        project: str, body: PrivateNetworksBody, who: cp_app.Auth
    ) -> dict[str, Any]:
        """Open private CIDRs for the project's allow lists (org admin keys only: a project's own keys
        cannot give their sandboxes a way to the machines beside the node). Replaces the list; narrowing
        it takes effect at each sandbox's next policy hand-out."""
        require_org_admin(who, "open private networks for a project")
        service = credential_service(services)
        project_id = await resolve_project(services, who, project)
        networks = spec.normalize_private_networks(body.allowed_private_networks)
        audit = AuditEntry(
            org_id=who.key.org_id, action="private_networks_set", actor=_actor(who), project_id=project_id
        )
        stored = await asyncio.to_thread(
            service.credentials.set_private_networks, project_id, networks, actor=_actor(who), audit=audit
        )
        return {"project_id": project_id, "allowed_private_networks": stored}

    # -- node-facing -----------------------------------------------------------------------------------
    async def check_node(node_id: str, authorization: str | None) -> None:
        parse_node_id(node_id, field="node_id")
        # The identity issued to THIS node at its latest registration (ADR 0019): another node's identity
        # or the cluster's bootstrap token is a 401, so the node id in the path is the caller's own.
        from space.controlplane.api.node_routes import authenticate_node

        await authenticate_node(store, node_id, authorization)

    async def assigned(node_id: str, sandbox_id: str) -> SandboxRecord:
        sb = None
        try:
            parse_sandbox_id(sandbox_id, field="sandbox_id")
            sb = await asyncio.to_thread(store.load_sandbox, sandbox_id)
        except errors.InvalidArgument:
            pass
        if sb is None or sb.node_id != node_id or sb.state == State.DELETED:
            raise errors.PermissionDenied(f"sandbox {sandbox_id} is not assigned to node {node_id}")
        return sb

    @r.get("/v1/nodes/{node_id}/sandboxes/{sandbox_id}/credentials", include_in_schema=False)
    async def node_credentials(
        node_id: str, sandbox_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        await check_node(node_id, authorization)
        service = credential_service(services)
        sb = await assigned(node_id, sandbox_id)
        org_id = await org_of(sb.project_id)
        bundle = await asyncio.to_thread(service.bundle_for_node, node_id, sb, org_id)
        return bundle.to_wire()

    @r.post("/v1/nodes/{node_id}/audit", include_in_schema=False)
    async def node_audit(
        node_id: str, body: NodeAuditBody, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        await check_node(node_id, authorization)
        service = credential_service(services)
        accepted: list[AuditEntry] = []
        rejected = 0
        orgs: dict[str, str] = {}
        sandboxes: dict[str, SandboxRecord | None] = {}  # a batch is mostly about a few sandboxes
        for event in body.events:
            if event.action not in NODE_AUDIT_ACTIONS or not event.sandbox_id:
                rejected += 1
                continue
            if event.sandbox_id not in sandboxes:
                try:
                    sandboxes[event.sandbox_id] = await assigned(node_id, event.sandbox_id)
                except errors.PermissionDenied:
                    sandboxes[event.sandbox_id] = None
            sb = sandboxes[event.sandbox_id]
            if sb is None:
                rejected += 1  # a node reports only about its own sandboxes
                continue
            if event.credential is not None and spec.NAME_PATTERN.fullmatch(event.credential) is None:
                event.credential = None  # not a name a credential can have: keep the event, not the name
            if sb.project_id not in orgs:
                orgs[sb.project_id] = await org_of(sb.project_id)
            resolved: CredentialRecord | None = None
            if event.credential is not None:
                found = await asyncio.to_thread(
                    service.credentials.resolve, orgs[sb.project_id], sb.project_id, sb.id, [event.credential]
                )
                resolved = found.get(event.credential)
            detail = dict(event.detail)
            if event.at is not None:
                with contextlib.suppress(ValueError, OverflowError, OSError):  # a nonsense time is dropped
                    detail["reported_at"] = datetime.fromtimestamp(event.at, UTC).isoformat()
            accepted.append(AuditEntry(
                org_id=orgs[sb.project_id], action=event.action, actor=f"node:{node_id}",
                project_id=sb.project_id, sandbox_id=sb.id, credential_id=resolved.id if resolved else None,
                credential_name=event.credential, scope=resolved.scope if resolved else None,
                host=event.host, detail=detail,
            ))  # fmt: skip
        await asyncio.to_thread(service.credentials.audit, accepted)
        return {"accepted": len(accepted), "rejected": rejected}

    # -- tenant keys (BYOK) ----------------------------------------------------------------------------
    _byok_routes(r, services)
    return r


async def _push_policy(
    services: "cp_app.Services",
    sb: SandboxRecord,
    *,
    allow: list[str],
    deny: list[str],
    credentials: list[str],
    version: int,
    private_networks: list[str],
) -> tuple[bool, str | None]:
    """Tell the sandbox's node about a changed policy; the database stays the truth either way (a node
    that missed it gets the policy with the credentials on its next fetch)."""
    if sb.node_id is None:
        return False, None
    try:
        client = services.nodes.client(sb.node_id)
        policy = {"allow": allow, "deny": deny, "version": version, "private_networks": private_networks}
        answer = await client.set_egress(sb.id, policy, credentials)
    except errors.SpaceError as exc:
        log.warning("egress policy of %s not pushed to node %s: %s", sb.id, sb.node_id, exc.message)
        return False, f"{exc.code}: {exc.message}"
    applied = bool(answer.get("applied"))
    return applied, None if applied else str(answer.get("reason") or "not applied by the node")


def _byok_routes(r: APIRouter, services: "cp_app.Services") -> None:
    from space.controlplane.api import byok

    byok.routes(r, services)
