"""E2B's fork and snapshot routes, and a sandbox created from a snapshot (a snapshot id or name as
`templateID`).

Invariants:
- A fork is SPACE's fork (one full checkpoint, the children brought up by the reconciler on the
  parent's node) answered as E2B's `[{"sandbox": Sandbox}]`, 201; each child gets the fork's timeout.
- An E2B snapshot is a SPACE full snapshot (memory and disk) of the sandbox, named when E2B's create asks
  for a name (SPACE's named snapshots: not unique; a name used again names a newer snapshot, as E2B assigns
  a new build to the existing template). Its E2B id is the SPACE snapshot id; `names` is its name, if any.
  Either is usable as `templateID`: the new sandbox starts from the (newest) snapshot like a fork child
  (api/snapshot_sandboxes.py: on the source sandbox's node, or, when the source was killed, restored from
  object storage on any node: a named snapshot outlives its sandbox, as on E2B, ADR 0060); it takes the
  given metadata (else its source's), and runs under its source's egress policy.
- A killed sandbox's id still lists the named snapshots it left (`GET /snapshots?sandboxID=`, as on E2B).
- Only the caller's project's snapshots are seen, listed, used or deleted; any other id or name is a 404
  (or an empty list), exactly like a missing one. Deleting a name deletes every snapshot of that name (E2B
  deletes the template with all its builds).
- A list page token is opaque to the client and checked on the way in (a token that is not one of ours
  is a 400); it only says where the last page ended, never grants anything.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from space.controlplane.api import snapshot_sandboxes
from space.controlplane.api import snapshots as space_snapshots
from space.controlplane.api.bodies import ForkBody as SpaceForkBody
from space.controlplane.api.deps import Principal, Services, Svc, running_sandbox
from space.controlplane.api.snapshot_sandboxes import find_snapshot
from space.controlplane.e2b import options
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.bodies import ForkBody, NewSandbox, SnapshotBody
from space.controlplane.e2b.errors import NotSupported
from space.controlplane.e2b.lookups import shown_sandbox
from space.controlplane.e2b.views import E2B_ALIASES, sandbox_answer
from space.controlplane.reconciler.kept_snapshots import kept
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors
from space.core.ids import SNAPSHOT, parse_sandbox_id, parse_snapshot_id
from space.node.volumes.templates import BUILTIN_TEMPLATES

router = APIRouter()

MAX_PAGE = 100


def _info(snap: SnapshotRecord) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name] if snap.name else [snap.id]}


# -- fork ----------------------------------------------------------------------------------------------------
@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, body: ForkBody, who: E2bAuth, services: Svc) -> Any:
    who.require("member")
    sb = await shown_sandbox(services, who, sandbox_id)
    answered = await space_snapshots.fork(sb.id, SpaceForkBody(count=body.count), who, services, None)
    payload = json.loads(bytes(answered.body))
    results = []
    for child in payload["sandboxes"]:
        record = await asyncio.to_thread(services.store.load_sandbox, str(child["id"]))
        if record is None:
            raise errors.NotFound(f"fork {child['id']} not found")
        record = await options.set_deadline(services, record, body.timeout, extend_only=False)
        results.append({"sandbox": sandbox_answer(record, who, services.node_token)})
    return results


# -- snapshots -----------------------------------------------------------------------------------------------
@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox_id: str, who: E2bAuth, services: Svc, body: SnapshotBody | None = None
) -> Any:
    who.require("member")
    name = body.name if body is not None else None
    sb = await shown_sandbox(services, who, sandbox_id)
    running = await running_sandbox(services, who, sb.id)
    return _info(await space_snapshots.take_snapshot(services, running, full=True, name=name))


def _page_token(last: SnapshotRecord) -> str:
    raw = json.dumps({"after": last.id}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _after(token: str | None) -> str | None:
    if token is None:
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        decoded = json.loads(base64.urlsafe_b64decode(padded.encode()))
        return parse_snapshot_id(decoded["after"], field="nextToken")
    except (ValueError, KeyError, TypeError, binascii.Error, errors.InvalidArgument) as exc:
        raise errors.InvalidArgument("invalid nextToken", field="nextToken") from exc


async def _named_snapshots(
    services: Services, who: Principal, sandbox_id: str | None, name: str | None
) -> list[SnapshotRecord]:
    """The snapshots a filter names: one sandbox's (few), the one whose id is `name`, or those called
    `name`."""
    if name is not None:
        if name.startswith(SNAPSHOT.prefix):
            try:
                snaps = [await _project_snapshot(services, who, name)]
            except errors.NotFound:
                return []
        else:
            snaps = await asyncio.to_thread(services.store.named_snapshots, who.project_id, name)
        return [s for s in snaps if sandbox_id in (None, s.sandbox_id)]
    assert sandbox_id is not None
    try:
        sb = await shown_sandbox(services, who, sandbox_id)
    except errors.NotFound:
        return await _kept_of_killed(services, who, sandbox_id)
    snaps = await asyncio.to_thread(services.store.list_snapshots, sb.id)
    return [s for s in snaps if s.state == "ready" and s.kind == "full"]


async def _kept_of_killed(services: Services, who: Principal, sandbox_id: str) -> list[SnapshotRecord]:
    """A killed sandbox of the caller's project lists the named snapshots it left (ADR 0060); anything
    else (another project's, a malformed id, a missing one) lists nothing."""
    try:
        parse_sandbox_id(sandbox_id, field="sandboxID")
    except errors.InvalidArgument:
        return []
    sb = await asyncio.to_thread(services.store.get_sandbox, who.project_id, sandbox_id)
    if sb is None:
        return []
    return [s for s in await asyncio.to_thread(services.store.list_snapshots, sb.id) if kept(s)]


@router.get("/snapshots")
async def list_snapshots(
    *,
    who: E2bAuth,
    services: Svc,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID", max_length=128)] = None,
    name: Annotated[str | None, Query(max_length=512)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=512)] = None,
) -> Response:
    after = _after(next_token)
    if sandbox_id is not None or name is not None:
        snaps = await _named_snapshots(services, who, sandbox_id, name)
        if after is not None:
            ids = [s.id for s in snaps]
            snaps = snaps[ids.index(after) + 1 :] if after in ids else []
    else:  # the project's, a page at a time in SQL
        snaps = await asyncio.to_thread(
            services.store.page_project_snapshots, who.project_id, after=after, limit=limit + 1
        )
    page = snaps[:limit]
    headers = {"X-Next-Token": _page_token(page[-1])} if len(snaps) > limit else {}
    return JSONResponse([_info(s) for s in page], headers=headers)


async def _project_snapshot(services: Services, who: Principal, ref: str) -> SnapshotRecord:
    """The caller's snapshot of that id or name (E2B calls it a template: so does the 404)."""
    try:
        return await find_snapshot(services, who, ref, field="templateID")
    except errors.NotFound as exc:
        raise errors.NotFound(f"template {ref[:80]} not found") from exc


@router.delete("/templates/{template_id:path}", status_code=204)
async def delete_snapshot(template_id: str, who: E2bAuth, services: Svc) -> Response:
    """E2B deletes a snapshot as a template: by id that snapshot, by name every snapshot of the name."""
    who.require("member")
    if template_id.startswith(SNAPSHOT.prefix):
        snaps = [await _project_snapshot(services, who, template_id)]
    else:
        snaps = await asyncio.to_thread(services.store.named_snapshots, who.project_id, template_id[:128])
        if not snaps:
            raise errors.NotFound(f"template {template_id[:80]} not found")
    await space_snapshots.delete_snapshots(services, snaps)
    return Response(status_code=204)


# -- a sandbox from a snapshot -------------------------------------------------------------------------------
async def snapshot_source(services: Services, who: Principal, template_id: str) -> SnapshotRecord | None:
    """The caller's snapshot a create's `templateID` names (None: it names a template). An id is always a
    snapshot's; a name is a snapshot's when the project has a snapshot of that name, except the built-in
    templates' names and E2B's aliases of them, which stay templates."""
    if template_id.startswith(SNAPSHOT.prefix):
        return await _project_snapshot(services, who, template_id)
    if template_id in BUILTIN_TEMPLATES or template_id in E2B_ALIASES:
        return None
    named = await asyncio.to_thread(services.store.named_snapshots, who.project_id, template_id[:128])
    return named[-1] if named else None


async def create_from_snapshot(
    services: Services, who: Principal, snap: SnapshotRecord, body: NewSandbox, *, sandbox_id: str | None
) -> SandboxRecord:
    """The new sandbox (`sandbox_id`: the one an Idempotency-Key derives), once it runs."""
    if body.network is not None or body.allow_internet_access is False:
        # A fork child runs under its source's egress policy (SPACE's rule for forks).
        raise NotSupported("a sandbox from a snapshot has its source's network settings", field="network")
    try:
        return await snapshot_sandboxes.create_from_snapshot(
            services, who, snap, env=body.env_vars or {}, ttl_s=body.timeout, metadata=body.metadata,
            on_timeout=options.on_timeout(body), sandbox_id=sandbox_id,
        )  # fmt: skip
    except errors.NotFound as exc:
        raise errors.NotFound(f"template {snap.id} not found (its sandbox is gone)") from exc
