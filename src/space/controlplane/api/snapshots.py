"""Snapshot routes: take and list a sandbox's snapshots, roll it back to one, fork it from a new checkpoint.

Invariants:
- A user snapshot is taken on the sandbox's node first and recorded after; it is `ready` once recorded
  with its size (the node's answer).
- A rollback moves through the lifecycle table (ROLLBACK, then ROLLED_BACK or FAIL), so a refused request
  is a 409 naming the current state, and a sandbox rolled back wants to run again. The request holds the
  sandbox's work lease while it runs, so only a dead control plane's rollback is taken over (failed).
  A completed rollback writes the sandbox event `sandbox.rolled_back` (detail: the snapshot's id, kind and
  name) in the same transaction as its ROLLED_BACK transition, so the history (the console's snapshot
  tree: later snapshots branch off that snapshot) never misses one nor tells of one that did not finish.
- A fork takes ONE full checkpoint and creates its children as records the reconciler brings up on the
  parent's node (FORK -> creating -> running), like any other create.
- A snapshot of another project's sandbox answers like a missing one (404).
- A full snapshot may be given a name (not unique; `from_snapshot` and E2B's templateID take the newest
  of that name: api/snapshot_sandboxes.py).
- The project's full snapshots are listed and deleted by id or name without naming a sandbox
  (`GET /v1/snapshots`, `DELETE /v1/snapshots/{id-or-name}`): a named one outlives its sandbox (ADR 0060),
  so it is reached that way after its sandbox is gone. Deleting only marks the rows `deleting` (the
  snapshot collector removes the node copy and the artifact, then the row); the checkpoint a sandbox is
  suspended to or recovering from is refused (409), as deleting it would lose the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space.controlplane.api.bodies import SNAPSHOT_NAME_PATTERN, ForkBody, RollbackBody, SnapshotBody
from space.controlplane.api.deps import (
    Auth,
    IdempotencyKey,
    Principal,
    Services,
    Svc,
    find_sandbox,
    idempotent,
    node_of,
    running_sandbox,
    wait_settled,
)
from space.controlplane.api.snapshot_sandboxes import find_snapshot
from space.controlplane.api.views import Sandbox, Sandboxes, Snapshot, Snapshots, sandbox_view, snapshot_view
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.controlplane.store.sandbox_state import Note
from space.core import errors, isolation
from space.core.ids import SNAPSHOT, parse_snapshot_id
from space.core.lifecycle import Event, State
from space.core.sandbox_options import check_metadata

#: How long listing snapshots waits for the node's current exclusive sizes before using recorded ones.
LIVE_SIZES_TIMEOUT_S = 3.0
#: How long a rollback request holds its sandbox: longer than any rollback's node call; a control plane that
#: dies meanwhile is replaced sooner on its own host (its leases are freed at the next start).
ROLLBACK_LEASE_S = 120.0
#: The most snapshots one page of the project's list holds.
MAX_PAGE = 100

router = APIRouter()


async def take_snapshot(
    services: Services, sb: SandboxRecord, *, full: bool, name: str | None = None
) -> SnapshotRecord:
    if name is not None and not full:
        raise errors.InvalidArgument("only a full snapshot can have a name", field="name")
    if name is not None and (
        name.startswith(SNAPSHOT.prefix) or not re.fullmatch(SNAPSHOT_NAME_PATTERN, name)
    ):
        raise errors.InvalidArgument(
            f"invalid snapshot name {name[:80]!r}: letters, digits, '.', '_', '-' (not 'snap-...')",
            field="name",
        )
    if not full:
        isolation.refuse_unsupported(sb.isolation, "disk_snapshot")  # every caller of the API and E2B
    info = await services.nodes.client(node_of(sb)).create_snapshot(sb.id, full=full)
    # The node made it already: its row is written `ready`, in one write (ADR 0074).
    return await asyncio.to_thread(
        services.store.create_snapshot, sb.id, "full" if full else "disk", node_id=sb.node_id,
        snapshot_id=info.snapshot_id, ready=True, origin="user",
        exclusive_bytes=getattr(info, "exclusive_bytes", None), name=name, size_bytes=info.image_bytes,
    )  # fmt: skip


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=Snapshot)
async def create_snapshot(sandbox_id: str, body: SnapshotBody, who: Auth, services: Svc) -> dict[str, Any]:
    who.require("member")
    if body.name is not None and not body.full:  # refused before the sandbox is touched
        raise errors.InvalidArgument("only a full snapshot can have a name", field="name")
    if not body.full:  # refused before a paused sandbox is resumed for it (ADR 0076)
        isolation.refuse_unsupported(
            (await find_sandbox(services, who, sandbox_id)).isolation, "disk_snapshot"
        )
    sb = await running_sandbox(services, who, sandbox_id)
    return snapshot_view(await take_snapshot(services, sb, full=body.full, name=body.name))


async def _live_exclusive_bytes(
    services: Services, sb: SandboxRecord, rows: list[SnapshotRecord]
) -> dict[str, int]:
    """Exclusive bytes grow as the sandbox diverges from a snapshot: the node's figure of today per
    snapshot it holds (none when the node is slow or away: the recorded ones are the fallback)."""
    live: dict[str, int] = {}
    if sb.node_id is None or not any(s.node_id == sb.node_id for s in rows):
        return live
    with contextlib.suppress(errors.SpaceError, TimeoutError):
        client = services.nodes.client(sb.node_id)
        infos = await asyncio.wait_for(client.list_snapshots(sb.id), LIVE_SIZES_TIMEOUT_S)
        for info in infos:
            value = getattr(info, "exclusive_bytes", None)
            if isinstance(value, int):
                live[info.snapshot_id] = value
    return live


@router.get("/sandboxes/{sandbox_id}/snapshots", response_model=Snapshots)
async def list_snapshots(sandbox_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    sb = await find_sandbox(services, who, sandbox_id)
    rows = await asyncio.to_thread(services.store.list_snapshots, sb.id)
    live = await _live_exclusive_bytes(services, sb, rows)
    return {"snapshots": [snapshot_view(s, live.get(s.id)) for s in rows]}


#: The sandbox event a completed rollback writes (docs/api.md lists the kinds).
ROLLED_BACK_EVENT = "sandbox.rolled_back"


def rolled_back_note(snap: SnapshotRecord) -> Note:
    """The event of a completed rollback to `snap`: the snapshot, never anything of its contents."""
    label = f"{snap.name} ({snap.id})" if snap.name else snap.id
    detail = {"snapshot_id": snap.id, "snapshot_kind": snap.kind, "snapshot_name": snap.name}
    return Note(ROLLED_BACK_EVENT, f"rolled back to {snap.kind} snapshot {label}", detail)


@router.post("/sandboxes/{sandbox_id}/rollback", response_model=Sandbox)
async def rollback(sandbox_id: str, body: RollbackBody, who: Auth, services: Svc) -> dict[str, Any]:
    who.require("member")
    parse_snapshot_id(body.snapshot_id, field="snapshot_id")
    store = services.store
    sb = await find_sandbox(services, who, sandbox_id)
    snap = await asyncio.to_thread(store.get_snapshot, body.snapshot_id, project_id=who.project_id)
    if snap is None or snap.sandbox_id != sb.id:
        raise errors.NotFound(f"snapshot {body.snapshot_id} of sandbox {sandbox_id} not found")
    services.forget(sb.id)
    owner = services.reconciler.owner
    # The step runs here, not in the reconciler: it holds the sandbox's work lease meanwhile, so the
    # reconciler takes over a `rolling_back` row only once this process is gone (it then fails the step:
    # crashed, and recovered like any crash).
    if not await asyncio.to_thread(store.hold, sb.id, owner, ROLLBACK_LEASE_S):
        raise errors.Conflict(f"sandbox {sb.id} is in the middle of another step; retry the rollback")
    try:
        sb = await asyncio.to_thread(store.transition, sb.id, sb.state, sb.generation, Event.ROLLBACK)
        try:
            await services.nodes.client(node_of(sb)).rollback(sb.id, snap.id)
        except errors.SpaceError:
            await asyncio.to_thread(store.transition, sb.id, sb.state, sb.generation, Event.FAIL)
            raise
        sb = await asyncio.to_thread(
            store.transition, sb.id, sb.state, sb.generation, Event.ROLLED_BACK, note=rolled_back_note(snap)
        )
    finally:
        with contextlib.suppress(errors.SpaceError):
            await asyncio.to_thread(store.release, sb.id, owner)
    if sb.desired_state != State.RUNNING:
        sb = await asyncio.to_thread(store.set_desired, sb.id, State.RUNNING)
    return sandbox_view(sb)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201, response_model=Sandboxes)
async def fork(
    sandbox_id: str, body: ForkBody, who: Auth, services: Svc, idem: IdempotencyKey = None
) -> JSONResponse:
    who.require("member")
    if body.metadata is not None:
        check_metadata(body.metadata)  # before the checkpoint, which a refused child would leave behind
    sb = await running_sandbox(services, who, sandbox_id)

    async def work() -> tuple[int, Any]:
        snap = await take_snapshot(services, sb, full=True)
        children = []
        for _ in range(body.count):
            child = await asyncio.to_thread(
                services.store.create_sandbox, who.project_id, sb.template, sb.env, sb.limits,
                idle_timeout_s=sb.idle_timeout_s, ttl_s=sb.ttl_s, forked_from=sb.id, fork_snapshot_id=snap.id,
                metadata=body.metadata, on_timeout=body.on_timeout,
            )  # fmt: skip
            children.append(child)
        settled = [await wait_settled(services, child.id) for child in children]
        return 201, {"sandboxes": [sandbox_view(child) for child in settled]}

    fingerprint = f"POST /sandboxes/{sandbox_id}/fork {body.model_dump_json()}"
    return await idempotent(services, who, idem, fingerprint, work)


@router.get("/snapshots", response_model=Snapshots)
async def list_project_snapshots(
    who: Auth,
    services: Svc,
    name: Annotated[str | None, Query(max_length=128, description="An id or a name.")] = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> dict[str, Any]:
    """The project's ready full snapshots (of live sandboxes, and named ones kept after their sandbox was
    deleted), oldest first; `name`: those of that name (or the one of that id); `after`: the page after
    that snapshot."""
    if after is not None:
        parse_snapshot_id(after, field="after")
    if name is None:
        rows = await asyncio.to_thread(
            services.store.page_project_snapshots, who.project_id, after=after, limit=limit
        )
        return {"snapshots": [snapshot_view(s) for s in rows]}
    rows = await project_snapshots(services, who, name)
    if after is not None:
        ids = [s.id for s in rows]
        rows = rows[ids.index(after) + 1 :] if after in ids else []
    return {"snapshots": [snapshot_view(s) for s in rows[:limit]]}


async def project_snapshots(services: Services, who: Principal, ref: str) -> list[SnapshotRecord]:
    """The caller's ready full snapshots `ref` names: the one of that id, or every one of that name
    (oldest first); [] when none (another project's are none)."""
    if ref.startswith(SNAPSHOT.prefix):
        try:
            return [await find_snapshot(services, who, ref, field="name")]
        except errors.NotFound:
            return []
    return await asyncio.to_thread(services.store.named_snapshots, who.project_id, ref[:128])


async def delete_snapshots(services: Services, snaps: list[SnapshotRecord]) -> None:
    """Mark `snaps` deleting (the collector removes their data); 409 before any is marked if one is the
    checkpoint its sandbox is suspended to or recovering from."""
    for snap in snaps:
        sb = await asyncio.to_thread(services.store.load_sandbox, snap.sandbox_id)
        if (
            sb is not None
            and sb.state != State.DELETED
            and snap.id in (sb.suspended_snapshot_id, sb.recovered_from)
        ):
            raise errors.Conflict(
                f"snapshot {snap.id} holds sandbox {sb.id} ({sb.state}); delete the sandbox instead",
                state=sb.state.value,
            )
    for snap in snaps:
        await asyncio.to_thread(services.store.delete_snapshot, snap.id)


class DeletedSnapshots(BaseModel):
    deleted: list[str] = Field(description="The ids of the snapshots deleted (their data goes soon after).")


@router.delete("/snapshots/{snapshot_id}", response_model=DeletedSnapshots)
async def delete_project_snapshots(snapshot_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    """Delete the snapshot of that id, or every snapshot of that name (404: none of the caller's)."""
    who.require("member")
    snaps = await project_snapshots(services, who, snapshot_id)
    if not snaps:
        raise errors.NotFound(f"snapshot {snapshot_id[:80]} not found")
    await delete_snapshots(services, snaps)
    return {"deleted": [s.id for s in snaps]}
