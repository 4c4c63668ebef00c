"""Egress routes (issue 5): a sandbox's egress policy and bound credentials, a project's private networks,
and the policy a new sandbox is created with.

  GET|PUT /v1/sandboxes/{id}/egress                  the policy and bound credentials (no values); PUT
                                                     changes it at run time and pushes it to the node
  GET|PUT /v1/projects/{project}/private-networks    private CIDRs a project's allow lists may name (PUT:
                                                     org admin key only)

Invariants:
- Every change (policy, bind, unbind, private networks) is in the audit log, written by the store in the
  same transaction as the change.
- A private range reaches a sandbox's allow list only inside a network an org admin opened for its
  project; what a node is handed is filtered by the project's current approval again.
- The database is the truth: a node that missed a pushed policy gets it with its credentials on its next
  fetch, so a failed push is reported (`applied: false`, `node_error`), not an error.
- A member key binds existing credentials to its sandboxes; it creates none (credentials.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Literal

from fastapi import APIRouter

from space.controlplane.api.bodies import EgressBody, PrivateNetworksBody
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
from space.controlplane.api.views import EgressPolicy, EgressPolicyApplied, PrivateNetworks
from space.controlplane.credentials import spec
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.credentials import AuditEntry, CredentialRecord, EgressRecord, egress_view
from space.controlplane.store.records import SandboxRecord
from space.core import errors

log = logging.getLogger(__name__)

router = APIRouter()


def binding_entry(
    action: Literal["bind", "unbind"],
    name: str,
    record: CredentialRecord | None,
    *,
    org_id: str,
    who: Principal,
    project_id: str,
    sandbox_id: str,
) -> AuditEntry:
    """The audit entry of binding credential `name` to a sandbox or unbinding it (`record`: what the name
    resolves to, None for an unbind of a credential that is gone)."""
    return AuditEntry(
        org_id=org_id, action=action, actor=actor(who), project_id=project_id, sandbox_id=sandbox_id,
        credential_id=record.id if record else None, credential_name=name,
        scope=record.scope if record else None,
    )  # fmt: skip


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


def _with_placeholders(env: dict[str, str], records: dict[str, CredentialRecord]) -> dict[str, str]:
    """`env` with each bound credential's placeholder under its env_var (a clash is InvalidArgument)."""
    merged = dict(env)
    for name, record in records.items():
        if record.env_var in merged and merged[record.env_var] != record.placeholder:
            raise errors.InvalidArgument(
                f"env {record.env_var} is also where credential {name!r} puts its placeholder",
                field=f"env.{record.env_var}",
            )
        merged[record.env_var] = record.placeholder
    return merged


async def prepare_create(
    services: Services,
    who: Principal,
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
    merged = _with_placeholders(env, records)
    if allow_n or deny_n or bound:
        entry = functools.partial(
            binding_entry, org_id=project.org_id, who=who, project_id=who.project_id, sandbox_id=sandbox_id
        )
        entries = [entry("bind", name, r) for name, r in records.items()]
        changed = AuditEntry(
            org_id=project.org_id, action="egress_policy_set", actor=actor(who), project_id=who.project_id,
            sandbox_id=sandbox_id,
        )  # fmt: skip
        await asyncio.to_thread(
            service.credentials.put_egress, sandbox_id, who.project_id,
            allow=allow_n, deny=deny_n, credentials=bound, audit=changed, also=entries,
        )  # fmt: skip
    return merged


async def _org_of(services: Services, project_id: str) -> str:
    project = await asyncio.to_thread(services.store.get_project, project_id)
    if project is None:
        raise errors.NotFound(f"project {project_id} not found")
    return project.org_id


@router.get(
    "/v1/sandboxes/{sandbox_id}/egress", response_model=EgressPolicy, response_model_exclude_unset=True
)
async def get_egress(sandbox_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    service = credential_service(services)
    sb = await sandbox_of(services, who.project_id, sandbox_id, "sandbox_id")
    policy = await asyncio.to_thread(service.effective_egress, sb)
    return egress_view(policy) | {"sandbox_id": sb.id}


async def _binding_changes(
    service: CredentialService,
    who: Principal,
    org_id: str,
    sb: SandboxRecord,
    *,
    kept: EgressRecord,
    wanted: list[str] | None,
) -> list[AuditEntry]:
    """The audit entries of a PUT's credential list against the policy it replaces (None: unchanged)."""
    if wanted is None:
        return []
    records = await validate_bindings(service, org_id, sb.project_id, sb.id, wanted)
    entry = functools.partial(
        binding_entry, org_id=org_id, who=who, project_id=sb.project_id, sandbox_id=sb.id
    )
    changes = [
        entry("bind", name, record) for name, record in records.items() if name not in kept.credentials
    ]
    dropped = sorted(set(kept.credentials) - set(wanted))
    if dropped:
        previous = await asyncio.to_thread(service.credentials.resolve, org_id, sb.project_id, sb.id, dropped)
        changes.extend(entry("unbind", name, previous.get(name)) for name in dropped)
    return changes


@router.put("/v1/sandboxes/{sandbox_id}/egress", response_model=EgressPolicyApplied)
async def put_egress(sandbox_id: str, body: EgressBody, who: Auth, services: Svc) -> dict[str, Any]:
    who.require("member")
    service = credential_service(services)
    sb = await sandbox_of(services, who.project_id, sandbox_id, "sandbox_id")
    org_id = await _org_of(services, sb.project_id)
    approved = await asyncio.to_thread(service.credentials.get_private_networks, sb.project_id)
    allow, deny = spec.normalize_policy(body.allow or [], body.deny or [], "egress", approved=approved)
    before = await asyncio.to_thread(service.effective_egress, sb)  # a fork's starts from its parent's
    kept = before or EgressRecord(sb.id, sb.project_id, [], [], [], 0, services.store.now())
    bindings = await _binding_changes(service, who, org_id, sb, kept=kept, wanted=body.credentials)
    changed = AuditEntry(
        org_id=org_id,
        action="egress_policy_set",
        actor=actor(who),
        project_id=sb.project_id,
        sandbox_id=sb.id,
    )
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


async def _push_policy(
    services: Services,
    sb: SandboxRecord,
    *,
    allow: list[str],
    deny: list[str],
    credentials: list[str],
    version: int,
    private_networks: list[str],
) -> tuple[bool, str | None]:
    """Tell the sandbox's node about a changed policy (module invariants: the database stays the truth)."""
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


# -- private networks of a project (org admin) ---------------------------------------------------------------
@router.get("/v1/projects/{project}/private-networks", response_model=PrivateNetworks)
async def get_private_networks(project: str, who: Auth, services: Svc) -> dict[str, Any]:
    service = credential_service(services)
    project_id = await resolve_project(services, who, project)
    networks = await asyncio.to_thread(service.credentials.get_private_networks, project_id)
    return {"project_id": project_id, "allowed_private_networks": networks}


@router.put("/v1/projects/{project}/private-networks", response_model=PrivateNetworks)
async def put_private_networks(
    project: str, body: PrivateNetworksBody, who: Auth, services: Svc
) -> dict[str, Any]:
    """Open private CIDRs for the project's allow lists (org admin keys only: a project's own keys
    cannot give their sandboxes a way to the machines beside the node). Replaces the list; narrowing
    it takes effect at each sandbox's next policy hand-out."""
    require_org_admin(who, "open private networks for a project")
    service = credential_service(services)
    project_id = await resolve_project(services, who, project)
    networks = spec.normalize_private_networks(body.allowed_private_networks)
    audit = AuditEntry(
        org_id=who.key.org_id, action="private_networks_set", actor=actor(who), project_id=project_id
    )
    stored = await asyncio.to_thread(
        service.credentials.set_private_networks, project_id, networks, actor=actor(who), audit=audit
    )
    return {"project_id": project_id, "allowed_private_networks": stored}
