"""A new sandbox from a full snapshot (`POST /v1/sandboxes {"from_snapshot": id-or-name}`), and the lookup
of a snapshot by its id or by its name, which SPACE's API and the E2B front share.

Invariants:
- A snapshot is named by its id (`snap-...`) or by a name it was given (`POST /v1/sandboxes/{id}/snapshots
  {"full": true, "name"}`); a name means the newest ready full snapshot of that name in the caller's
  project. Only the caller's project's ready full snapshots of live sandboxes (and kept ones, below) are
  found: another tenant's id or name, a disk snapshot, a snapshot still being taken or being deleted are
  the same 404 as a missing one.
- The new sandbox starts from the checkpoint like a fork child (SPACE's fork: a record with `forked_from`
  and `fork_snapshot_id` that the reconciler brings up on the source's node), in the caller's project,
  with the source's template, limits, idle timeout and egress policy; its env is the source's overlaid with
  the request's, and it takes the request's own deadline, metadata and timeout action.
- A named full snapshot outlives its sandbox when the control plane has an object store (ADR 0060): the
  sandbox's deletion keeps it there, and a sandbox from it is restored from object storage on a node the
  scheduler chooses (reconciler/kept_snapshots.py). A create that names one whose sandbox is being deleted
  waits for that deletion (which keeps it or, without an object store, drops it: then 404). Any other
  snapshot of a deleted sandbox is gone with it (404).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi.responses import JSONResponse

from space.controlplane.api.bodies import CreateSandbox
from space.controlplane.api.deps import (
    Principal,
    Services,
    derived_sandbox_id,
    find_sandbox,
    idempotency_scope,
    idempotent,
    wait_settled,
)
from space.controlplane.api.views import sandbox_view
from space.controlplane.reconciler.kept_snapshots import keepable, kept
from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.core import errors
from space.core.ids import SNAPSHOT, parse_snapshot_id
from space.core.lifecycle import State
from space.core.sandbox_options import OnTimeout

_GONE = (State.DELETED, State.DELETING)
#: What a sandbox from a snapshot takes from its source, so a create may not set it.
_FROM_SOURCE = (
    "template", "limits", "idle_timeout_s", "allow", "credentials", "egress", "snapshot_policy", "isolation",
)  # fmt: skip


async def create_route(
    body: CreateSandbox, who: Principal, services: Services, idem: str | None
) -> JSONResponse:
    """`POST /v1/sandboxes` with `from_snapshot` (the route has checked the role and the metadata)."""
    for field in _FROM_SOURCE:
        if field in body.model_fields_set:
            raise errors.InvalidArgument(
                f"a sandbox from a snapshot has its source's {field}", field=field, reason="from_snapshot"
            )
    assert body.from_snapshot is not None
    snap = await find_snapshot(services, who, body.from_snapshot, field="from_snapshot")
    sandbox_id = derived_sandbox_id(idempotency_scope(who), idem) if idem else None

    async def work() -> tuple[int, Any]:
        made = await create_from_snapshot(
            services, who, snap, env=body.env, ttl_s=body.ttl_s, metadata=body.metadata,
            on_timeout=body.on_timeout, sandbox_id=sandbox_id, wait=body.wait,
        )  # fmt: skip
        return 201, sandbox_view(made)

    return await idempotent(services, who, idem, f"POST /sandboxes {body.model_dump_json()}", work)


async def find_snapshot(services: Services, who: Principal, ref: str, *, field: str) -> SnapshotRecord:
    """The caller's ready full snapshot that `ref` (an id or a name) names; NotFound otherwise."""
    if ref.startswith(SNAPSHOT.prefix):
        try:
            parse_snapshot_id(ref, field=field)
        except errors.InvalidArgument as exc:
            raise errors.NotFound(f"snapshot {ref[:80]} not found") from exc
        snap = await asyncio.to_thread(services.store.get_snapshot, ref, project_id=who.project_id)
    else:
        named = await asyncio.to_thread(services.store.named_snapshots, who.project_id, ref[:128])
        snap = named[-1] if named else None
    if snap is None or snap.state != "ready" or snap.kind != "full":
        raise errors.NotFound(f"snapshot {ref[:80]} not found")
    return snap


async def create_from_snapshot(
    services: Services,
    who: Principal,
    snap: SnapshotRecord,
    *,
    env: dict[str, str],
    ttl_s: int | None,
    metadata: dict[str, str] | None,
    on_timeout: OnTimeout,
    sandbox_id: str | None,
    wait: bool = True,
) -> SandboxRecord:
    """The new sandbox (`sandbox_id`: the one an Idempotency-Key derives, so that a retry of a request that
    died finds the sandbox it recorded); once it runs when `wait`."""
    source = await asyncio.to_thread(services.store.load_sandbox, snap.sandbox_id)
    if source is None or source.project_id != who.project_id:
        raise errors.NotFound(f"snapshot {snap.id} not found")
    gone = source.state in _GONE or source.desired_state in _GONE
    if gone and not kept(snap) and keepable(snap) and services.reconciler.objects is not None:
        # Its sandbox is being deleted, and that step keeps it: the answer is what the step did.
        with contextlib.suppress(errors.SpaceError):
            await wait_settled(services, source.id)
        again = await asyncio.to_thread(services.store.get_snapshot, snap.id)
        snap = again if again is not None else snap
    if gone and not kept(snap):
        raise errors.NotFound(f"snapshot {snap.id} not found (its sandbox is gone)")
    try:
        child = await asyncio.to_thread(
            services.store.create_sandbox, who.project_id, source.template, {**source.env, **env},
            source.limits, idle_timeout_s=source.idle_timeout_s, ttl_s=ttl_s, forked_from=source.id,
            fork_snapshot_id=snap.id, metadata=metadata, on_timeout=on_timeout, sandbox_id=sandbox_id,
        )  # fmt: skip
    except errors.AlreadyExists:
        assert sandbox_id is not None
        child = await find_sandbox(services, who, sandbox_id)  # a retry: that row is its first request's
    if not wait:
        services.reconciler.poke()
        return child
    return await wait_settled(services, child.id)
