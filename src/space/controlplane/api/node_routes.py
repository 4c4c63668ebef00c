"""Node-facing routes of the control plane: enrolment, re-registration, heartbeats (ADR 0019, 0021), clean
deregistration and the fencing lease (ADR 0033), and a node's credential hand-outs and gateway audit reports
(issue 5). None of them is in the OpenAPI document.

Invariants:
- Enrolment (`POST /v1/nodes/register`) takes the cluster's bootstrap token or an enrolment token (one use
  consumed per enrolment) and makes a NEW node only: a url that a node already holds is a 409, so nobody
  takes another node's place, identity or sandboxes with a bootstrap token.
- Re-registration (`POST /v1/nodes/{id}/register`) and every other node-facing call authenticate with the
  identity issued to THAT node at its enrolment; the bootstrap token does nothing there.
- Every registration announces the node protocol versions the node speaks (space.protocol.node_protocol;
  none announced: 1..1) and is refused before anything is written when they do not overlap this control
  plane's (409 `incompatible_protocol` naming both ranges, ADR 0071); the answer names the version both
  use and this side's range.
- Every registration carries the node's own RPC token, which is stored only sealed (space.controlplane.nodes)
  and is the only token the control plane presents to that node.
- Enrolment, re-registration and heartbeats authenticate the caller before they read its body (the audit
  batch is parsed first, bounded by the limits middleware, then its node is authenticated).
- Crash reports, activity and stale copies reported by a node only ever touch sandboxes recorded on that
  node.
- Every heartbeat answer grants the node a lease, `fence_after_s` (node_lost_after_s - fence_grace_s): the
  node stops its own sandboxes that long after it sent the heartbeat, before any replica may mark it lost.
- A heartbeat's `pools` ({template: ready pooled sandboxes}, issue 12) orders the scheduler's choice (and
  spares a pooled node the room check its own `used` already made): it is parsed, not trusted. Templates
  the node does not report holding, names that are not template names, and counts that are not integers
  are left out; a count is clamped to 0..MAX_POOL_COUNT; a map of more than MAX_POOL_TEMPLATES entries,
  or one that is not a map, is recorded as empty. Its `space_version` (the node's release, ADR 0079) is
  kept only when it is a version token (space.core.versions), else dropped.
- Deregistration needs the node's own identity and the `beat` of its LATEST heartbeat (a 409 otherwise), so
  a replayed or delayed deregistration never takes a node that has reported since offline.
- A node gets credential values only for a sandbox whose record names it as its node (403 otherwise, also
  for unknown sandboxes, so a node learns nothing about sandboxes elsewhere); every hand-out is audited, and
  a node's audit events are kept only for its own sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Header, Request

from space.controlplane.api.bodies import NodeAuditBody, NodeAuditEvent
from space.controlplane.api.deps import Services, Svc, credential_service
from space.controlplane.credentials import spec
from space.controlplane.credentials.service import CredentialService
from space.controlplane.reconciler.deletion import is_orphan_copy
from space.controlplane.store.credentials import AuditEntry, CredentialRecord
from space.controlplane.store.digests import new_node_identity
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors, ids, lifecycle, runtimes, versions
from space.core.ids import parse_node_id, parse_sandbox_id
from space.core.lifecycle import State
from space.protocol import node_protocol

log = logging.getLogger(__name__)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.InvalidArgument("body must be a JSON object")
    return body


CRASH_REASON_LENGTH = 300  # what a node may say of a crash (the event's message is bounded again)
_HALTED_FROM = frozenset({State.RUNNING, State.PAUSED})  # records a `stopped` report contradicts


async def _crash_reports(services: Services, node_id: str, reported: _Reported, beat_time: Any) -> None:
    """Runtimes the node saw die become `crashed` (the reconciler then recovers them), with the reason the
    node gives (its `crash_reason`, bounded: e.g. the memory limit); so do copies the node holds `stopped`
    while their records say running or paused (their runtime ended while the agent was down). Only a report
    made after the record's last change counts: a heartbeat assembled before a recovery finished must not
    undo it."""
    observed_at = datetime.fromtimestamp(float(beat_time), UTC) if beat_time else None
    reports: list[tuple[str, str, frozenset[State]]] = [
        (sandbox_id, f"the sandbox's runtime died on node {node_id}" + (f": {reason}" if reason else ""),
         lifecycle.LIVE_STATES)
        for sandbox_id, reason in reported.crashed.items()
    ]  # fmt: skip
    reports += [
        (sandbox_id, f"the sandbox's runtime ended on node {node_id} while its agent was away", _HALTED_FROM)
        for sandbox_id in reported.halted
    ]
    for sandbox_id, notice, only_in in reports:
        changed = await asyncio.to_thread(
            services.store.report_crash, sandbox_id, node_id, notice=notice, observed_at=observed_at,
            only_in=only_in,
        )  # fmt: skip
        if changed is not None:
            services.forget(sandbox_id)
            services.reconciler.poke()


async def _stale_copies(services: Services, node_id: str, reported: list[str]) -> None:
    """A node that reports a copy of a sandbox that now lives elsewhere (recovered or restored while the
    node was lost) or nowhere (suspended, deleted) gets its orphans collected now, not at the next round:
    the window in which such a copy still runs is one heartbeat."""
    if not reported:
        return
    mine = {sb.id for sb in await asyncio.to_thread(services.store.list_sandboxes_on_node, node_id)}
    for sandbox_id in (i for i in reported if i not in mine):
        record = await asyncio.to_thread(services.store.load_sandbox, sandbox_id)
        if record is not None and is_orphan_copy(record, node_id, services.store.now()):
            services.reconciler.collect_orphans_soon()
            return


def _capacity(raw: Any) -> dict[str, Any]:
    try:
        memory_mb, cpus = int(raw.get("memory_mb", 0)), float(raw.get("cpus", 0))
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise errors.InvalidArgument(f"capacity: {exc}", field="capacity") from exc
    capacity = {"cpus": cpus, "memory_mb": memory_mb, "sandboxes": max(1, memory_mb // 64)}
    for field in ("disk_mb", "disk_free_mb", "disk_reserve_mb"):  # scheduler.py's disk admission
        value = raw.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            capacity[field] = max(0, value)
    return capacity


MAX_POOL_TEMPLATES = 64  # templates with a pool a node may report
MAX_POOL_COUNT = 1024  # ready pooled sandboxes of one template a node may report


def _pools(raw: Any, templates: list[str]) -> dict[str, int] | None:
    """A heartbeat's pools, parsed (see the module invariants); None when it reports none (older agents)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_POOL_TEMPLATES:
        return {}
    held = set(templates)
    pools: dict[str, int] = {}
    for template, count in raw.items():
        if template not in held or isinstance(count, bool) or not isinstance(count, int):
            continue
        with contextlib.suppress(errors.InvalidArgument):
            pools[ids.parse_template_name(template)] = min(max(0, count), MAX_POOL_COUNT)
    return pools


# -- node registration ---------------------------------------------------------------------------------------
MIN_RPC_TOKEN_LENGTH = 16
MAX_RPC_TOKEN_LENGTH = 256


def _bearer(authorization: str | None) -> str:
    return (authorization or "").removeprefix("Bearer ").strip()


def _protocol(body: dict[str, Any]) -> dict[str, int]:
    """The node protocol version this control plane and the registering node both speak, and this side's
    range, for the answer; 409 `incompatible_protocol` naming both ranges when there is none (ADR 0071)."""
    ours = node_protocol.own_range()
    try:
        theirs = node_protocol.announced_range(body)
    except node_protocol.MalformedRange as exc:
        raise errors.InvalidArgument(str(exc), field="protocol_min") from exc
    chosen = node_protocol.common_version(ours, theirs)
    if chosen is None:
        message = node_protocol.describe(ours, theirs, we="control plane", they="node")
        log.warning("node registration refused (url %r): %s", str(body.get("url"))[:200], message)
        raise errors.IncompatibleProtocol(
            message, node_protocol=list(theirs), control_plane_protocol=list(ours)
        )
    return {"protocol": chosen, "protocol_min": ours[0], "protocol_max": ours[1]}


def _registration(body: dict[str, Any]) -> tuple[str, str]:
    """(url, rpc token) of a registration body, checked: the control plane will call that url with that
    token, so it must be a plain http(s) base url and a token of sane length."""
    url, token = body.get("url"), body.get("token")
    if not isinstance(url, str) or not 0 < len(url) <= 512:
        raise errors.InvalidArgument("url: expected 1 to 512 characters", field="url")
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname or parts.username or parts.password \
            or parts.query or parts.fragment:  # fmt: skip
        raise errors.InvalidArgument("url must be http(s)://host[:port][/path]", field="url")
    if not isinstance(token, str) or not MIN_RPC_TOKEN_LENGTH <= len(token) <= MAX_RPC_TOKEN_LENGTH:
        raise errors.InvalidArgument(
            f"token (the node's RPC token): {MIN_RPC_TOKEN_LENGTH} to {MAX_RPC_TOKEN_LENGTH} characters",
            field="token",
        )
    return url, token


async def authenticate_node(store: Store, node_id: str, authorization: str | None) -> None:
    """Node-facing routes other than enrolment: `Authorization: Bearer <identity>` must be the secret
    issued at THIS node's enrolment (ADR 0019, 0021), else 401 (the node then registers again)."""
    presented = _bearer(authorization)
    if not presented:
        raise errors.Unauthenticated("missing node identity")
    if await asyncio.to_thread(store.authenticate_node, node_id, presented) is None:
        raise errors.Unauthenticated(f"bad identity for node {node_id}: register again")


router = APIRouter(include_in_schema=False)

NODE_AUDIT_ACTIONS = frozenset(
    {"injected", "denied", "rate_limited", "expired", "egress_denied", "placeholder_blocked"}
)


async def _enrolment_credential(services: Services, authorization: str | None) -> str | None:
    """None for the cluster's (multi-use) bootstrap token, else the enrolment token presented; 401 if it
    is neither (checked before the body is read; enrol_node takes the use atomically)."""
    presented = _bearer(authorization)
    if presented and hmac.compare_digest(presented.encode(), services.node_token.encode()):
        return None
    usable: bool = bool(presented) and await asyncio.to_thread(
        services.store.enrolment_token_usable, presented
    )
    if not usable:
        raise errors.Unauthenticated("bad node token")
    return presented


@router.post("/register")
async def enrol(
    request: Request, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    enrolment = await _enrolment_credential(services, authorization)
    body = await _json_object(request)
    protocol = _protocol(body)
    url, rpc_token = _registration(body)
    # The identity is answered once and stored hashed; the node keeps it and re-registers with it.
    identity = new_node_identity()
    node = await asyncio.to_thread(
        services.store.enrol_node, ids.new_node_id(), url, identity=identity,
        seal_rpc_token=lambda node_id: services.nodes.tokens.seal(node_id, rpc_token),
        capacity=_capacity(body.get("capacity") or {}), templates=list(body.get("templates") or []),
        enrolment_token=enrolment,
    )  # fmt: skip
    return {"node_id": node.id, "identity": identity, **protocol}


@router.post("/{node_id}/register")
async def reregister(
    node_id: str, request: Request, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    await authenticate_node(services.store, node_id, authorization)
    body = await _json_object(request)
    protocol = _protocol(body)
    url, rpc_token = _registration(body)
    node = await asyncio.to_thread(
        services.store.reregister_node, node_id, _bearer(authorization), url,
        rpc_token_sealed=services.nodes.tokens.seal(node_id, rpc_token),
        capacity=_capacity(body.get("capacity") or {}), templates=list(body.get("templates") or []),
    )  # fmt: skip
    if node is None:
        raise errors.Unauthenticated(f"bad identity for node {node_id}")
    return {"node_id": node.id, **protocol}


@dataclass
class _Reported:
    """What a heartbeat says about the node's sandboxes."""

    activity: dict[str, datetime] = dataclasses.field(default_factory=dict)  # last activity per sandbox
    crashed: dict[str, str] = dataclasses.field(default_factory=dict)  # runtime seen dying -> its reason
    # Runtime gone without a crash being seen: a restarted agent adopts such copies as `stopped`. Only a
    # record that says running or paused makes that a crash (a user's stop is `stopping`, then `stopped`).
    halted: list[str] = dataclasses.field(default_factory=list)


def _reported_sandboxes(beat: dict[str, Any]) -> _Reported:
    reported = _Reported()
    for item in beat.get("sandboxes") or []:
        at = item.get("last_activity_at")
        if at:
            reported.activity[str(item["id"])] = datetime.fromtimestamp(float(at), UTC)
        if item.get("state") == State.CRASHED.value:
            reported.crashed[str(item["id"])] = str(item.get("crash_reason") or "")[:CRASH_REASON_LENGTH]
        elif item.get("state") == State.STOPPED.value:
            reported.halted.append(str(item["id"]))
    return reported


@router.post("/{node_id}/heartbeat")
async def heartbeat(
    node_id: str, request: Request, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    await authenticate_node(services.store, node_id, authorization)
    beat = await _json_object(request)
    templates = [t for t in beat.get("templates") or [] if isinstance(t, str)]
    used = dict(beat.get("used") or {})
    used["sandboxes"] = int(beat.get("sandbox_count", len(beat.get("sandboxes") or [])))
    reported_sandboxes = _reported_sandboxes(beat)
    node = await asyncio.to_thread(
        services.store.heartbeat, node_id, used=used, templates=templates,
        activity=reported_sandboxes.activity,
        capacity=_capacity(beat.get("capacity") or {}),
        # What the node's runtime restores (ADR 0035): untrusted, so parsed; an unreadable one is no report.
        runtime=runtimes.parse_or_none(beat.get("runtime")),
        pools=_pools(beat.get("pools"), templates),
        space_version=versions.parse_reported(beat.get("space_version")),  # untrusted too (ADR 0079)
    )  # fmt: skip
    await _crash_reports(services, node_id, reported_sandboxes, beat.get("time"))
    reported = [str(item["id"]) for item in beat.get("sandboxes") or [] if item.get("id")]
    await _stale_copies(services, node_id, reported)
    # The node's lease (ADR 0033): it stops its sandboxes `fence_after_s` after it SENT this heartbeat,
    # strictly before any replica may mark it lost. `beat` names this heartbeat for a later deregistration.
    return {
        "ok": True,
        "fence_after_s": services.settings.fence_after_s,
        "beat": node.last_heartbeat_at.isoformat(),
        # This replica's protocol range: a node running under a replica it cannot speak to stops (ADR 0071).
        **dict(zip(("protocol_min", "protocol_max"), node_protocol.own_range(), strict=True)),
    }


@router.post("/{node_id}/deregister")
async def deregister(
    node_id: str, request: Request, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    """A node leaving cleanly (`space down`): it becomes `offline`, which the scheduler never picks and which
    is never marked lost (so its sandboxes are not recovered elsewhere: they wait on its disk for its
    return), until it registers again. The body names the node's latest heartbeat (`beat`, as that
    heartbeat's answer gave it): a replayed deregistration of an earlier session is a 409."""
    parse_node_id(node_id, field="node_id")
    await authenticate_node(services.store, node_id, authorization)
    body = await _json_object(request)
    beat = body.get("beat")
    if not isinstance(beat, str) or not 0 < len(beat) <= 64:
        raise errors.InvalidArgument("beat: the `beat` of the node's latest heartbeat answer", field="beat")
    node = await asyncio.to_thread(services.store.get_node, node_id)
    if node is None:
        raise errors.Unauthenticated(f"bad identity for node {node_id}")
    if node.status == "offline":
        return {"node_id": node_id, "status": "offline"}
    if not hmac.compare_digest(beat.encode(), node.last_heartbeat_at.isoformat().encode()):
        raise errors.Conflict(
            f"node {node_id} has reported since that heartbeat (state {node.status}): a stale deregistration"
        )
    await asyncio.to_thread(services.store.set_node_status, node_id, "offline")
    return {"node_id": node_id, "status": "offline"}


# -- credentials for the node's sandboxes (issue 5) ----------------------------------------------------------
async def _check_node(store: Store, node_id: str, authorization: str | None) -> None:
    parse_node_id(node_id, field="node_id")
    # The identity issued to THIS node at its latest registration (ADR 0019): another node's identity or the
    # cluster's bootstrap token is a 401, so the node id in the path is the caller's own.
    await authenticate_node(store, node_id, authorization)


async def _assigned(store: Store, node_id: str, sandbox_id: str) -> SandboxRecord:
    sb = None
    try:
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        sb = await asyncio.to_thread(store.load_sandbox, sandbox_id)
    except errors.InvalidArgument:
        pass
    if sb is None or sb.node_id != node_id or sb.state == State.DELETED:
        raise errors.PermissionDenied(f"sandbox {sandbox_id} is not assigned to node {node_id}")
    return sb


async def _org_of(store: Store, project_id: str) -> str:
    project = await asyncio.to_thread(store.get_project, project_id)
    if project is None:
        raise errors.NotFound(f"project {project_id} not found")
    return project.org_id


@router.get("/{node_id}/sandboxes/{sandbox_id}/credentials")
async def node_credentials(
    node_id: str, sandbox_id: str, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    await _check_node(services.store, node_id, authorization)
    service = credential_service(services)
    sb = await _assigned(services.store, node_id, sandbox_id)
    org_id = await _org_of(services.store, sb.project_id)
    bundle = await asyncio.to_thread(service.bundle_for_node, node_id, sb, org_id)
    return bundle.to_wire()


class _AuditBatch:
    """What one node audit batch needs looked up: a batch is mostly about a few sandboxes."""

    def __init__(self, services: Services, service: CredentialService, node_id: str) -> None:
        self.store = services.store
        self.service = service
        self.node_id = node_id
        self.orgs: dict[str, str] = {}
        self.sandboxes: dict[str, SandboxRecord | None] = {}

    async def sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """The event's sandbox if it is this node's (a node reports only about its own), else None."""
        if sandbox_id not in self.sandboxes:
            try:
                self.sandboxes[sandbox_id] = await _assigned(self.store, self.node_id, sandbox_id)
            except errors.PermissionDenied:
                self.sandboxes[sandbox_id] = None
        return self.sandboxes[sandbox_id]

    async def entry(self, event: NodeAuditEvent, sb: SandboxRecord) -> AuditEntry:
        if event.credential is not None and spec.NAME_PATTERN.fullmatch(event.credential) is None:
            event.credential = None  # not a name a credential can have: keep the event, not the name
        if sb.project_id not in self.orgs:
            self.orgs[sb.project_id] = await _org_of(self.store, sb.project_id)
        org_id = self.orgs[sb.project_id]
        resolved: CredentialRecord | None = None
        if event.credential is not None:
            found = await asyncio.to_thread(
                self.service.credentials.resolve, org_id, sb.project_id, sb.id, [event.credential]
            )
            resolved = found.get(event.credential)
        detail = dict(event.detail)
        if event.at is not None:
            with contextlib.suppress(ValueError, OverflowError, OSError):  # a nonsense time is dropped
                detail["reported_at"] = datetime.fromtimestamp(event.at, UTC).isoformat()
        return AuditEntry(
            org_id=org_id, action=event.action, actor=f"node:{self.node_id}", project_id=sb.project_id,
            sandbox_id=sb.id, credential_id=resolved.id if resolved else None,
            credential_name=event.credential, scope=resolved.scope if resolved else None, host=event.host,
            detail=detail,
        )  # fmt: skip


@router.post("/{node_id}/audit")
async def node_audit(
    node_id: str, body: NodeAuditBody, services: Svc, authorization: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    await _check_node(services.store, node_id, authorization)
    service = credential_service(services)
    batch = _AuditBatch(services, service, node_id)
    accepted: list[AuditEntry] = []
    rejected = 0
    for event in body.events:
        sb = None
        if event.action in NODE_AUDIT_ACTIONS and event.sandbox_id:
            sb = await batch.sandbox(event.sandbox_id)
        if sb is None:
            rejected += 1
            continue
        accepted.append(await batch.entry(event, sb))
    await asyncio.to_thread(service.credentials.audit, accepted)
    return {"accepted": len(accepted), "rejected": rejected}
