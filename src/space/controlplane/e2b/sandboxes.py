"""E2B's sandbox routes: create (v1 and v2), get, kill, set timeout, pause, connect (resume).

Invariants:
- Every route is a translation onto SPACE's own API code: a create IS SPACE's create route (its
  idempotency, admission, egress policy before the row, the direct create path), lifecycle requests go
  through the lifecycle table (a refused request is a 409 naming the state) and settle through the
  reconciler.
- Success statuses are E2B's: create 201, get 200, kill/timeout/pause 204, connect 200 when the sandbox
  was running and 201 when it was resumed. A missing sandbox, a deleted one and another project's are the
  same 404; pausing a paused sandbox is a 409 (E2B's SDK reads it as "already paused").
- E2B's memory pause is SPACE's pause (processes and memory kept); `memory: false` (E2B's
  filesystem-only pause) is SPACE's stop (processes gone, disk kept). Connect undoes whichever it was,
  also a suspend.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse

from space.controlplane.api import sandboxes as space_sandboxes
from space.controlplane.api.bodies import CreateSandbox, EgressSpec
from space.controlplane.api.deps import (
    Principal,
    Services,
    Svc,
    derived_sandbox_id,
    idempotency_scope,
    idempotent,
    wait_settled,
)
from space.controlplane.e2b import options, snapshots
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.bodies import ConnectBody, NewSandbox, PauseBody, TimeoutBody
from space.controlplane.e2b.lookups import shown_sandbox
from space.controlplane.e2b.views import (
    detail_answer,
    e2b_state,
    sandbox_answer,
    space_template,
)
from space.controlplane.reconciler.deletion import begin_deletion
from space.controlplane.store.records import SandboxRecord
from space.core import errors
from space.core.lifecycle import Event, State, transition

router = APIRouter()

#: E2B's Idempotency-Key is 1 to 255 characters; SPACE keeps at most 128 (longer ones are digested).
E2bIdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", max_length=255, pattern=r"^[A-Za-z0-9_.:-]+$")
]
#: Denying both address families is E2B's `allow_internet_access: false`.
NO_INTERNET = ["0.0.0.0/0", "::/0"]


def _space_idempotency_key(key: str | None) -> str | None:
    """E2B's key in SPACE's key space: prefixed, so that a SPACE request with the same key string is never
    its replay, and digested when it would exceed SPACE's 128 characters."""
    if key is None:
        return None
    if len(key) <= 124:
        return "e2b-" + key
    return "e2b-" + hashlib.sha256(key.encode()).hexdigest()


def _space_create_body(body: NewSandbox) -> CreateSandbox:
    allow: list[str] = []
    deny: list[str] = []
    if body.network is not None:
        allow = list(body.network.allow_out or [])
        deny = list(body.network.deny_out or [])
    internet = body.allow_internet_access
    if body.network is not None and body.network.allow_internet_access is not None:
        internet = body.network.allow_internet_access
    if internet is False:
        deny = [*deny, *(cidr for cidr in NO_INTERNET if cidr not in deny)]
    fields: dict[str, Any] = {
        "template": space_template(body.template_id),
        "env": body.env_vars or {},
        "ttl_s": body.timeout,
        "wait": True,
        "egress": EgressSpec(allow=allow, deny=deny) if allow or deny else None,
    }
    return options.with_create_options(fields, body)


async def _answer_record(services: Services, answered: JSONResponse) -> SandboxRecord:
    """The record of a SPACE create's answer (a replayed failure is raised again as its typed error)."""
    payload = json.loads(bytes(answered.body))
    if answered.status_code >= 300:
        raise errors.error_from_dict(payload.get("error", {}))
    sb = await asyncio.to_thread(services.store.load_sandbox, str(payload["id"]))
    if sb is None:
        raise errors.NotFound(f"sandbox {payload['id']} not found")
    return sb


async def create(body: NewSandbox, who: Principal, services: Services, idem: str | None) -> dict[str, Any]:
    who.require("member")
    body.refuse_unsupported()
    key = _space_idempotency_key(idem)
    from_snapshot = await snapshots.snapshot_source(services, who, body.template_id)
    if from_snapshot is not None:
        snap = from_snapshot
        derived = derived_sandbox_id(idempotency_scope(who), key) if key else None

        async def work() -> tuple[int, Any]:
            made = await snapshots.create_from_snapshot(services, who, snap, body, sandbox_id=derived)
            return 201, {"id": made.id}

        fingerprint = f"POST e2b /v2/sandboxes {body.model_dump_json()}"
        answered = await idempotent(services, who, key, fingerprint, work)
    else:
        answered = await space_sandboxes.create_sandbox(_space_create_body(body), who, services, key)
    sb = await _answer_record(services, answered)
    return sandbox_answer(sb, who, services.node_token)


@router.post("/sandboxes", status_code=201)
async def create_v1(body: NewSandbox, who: E2bAuth, services: Svc, idem: E2bIdempotencyKey = None) -> Any:
    return await create(body, who, services, idem)


@router.post("/v2/sandboxes", status_code=201)
async def create_v2(body: NewSandbox, who: E2bAuth, services: Svc, idem: E2bIdempotencyKey = None) -> Any:
    return await create(body, who, services, idem)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, who: E2bAuth, services: Svc) -> Any:
    sb = await shown_sandbox(services, who, sandbox_id)
    return detail_answer(sb, who, services.node_token)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, who: E2bAuth, services: Svc) -> Response:
    who.require("member")
    sb = await shown_sandbox(services, who, sandbox_id)
    services.forget(sb.id)
    await asyncio.to_thread(begin_deletion, services.store, sb)  # refused everywhere from now on (ADR 0073)
    services.reconciler.poke()  # the reconciler destroys it; E2B's view hides it from now on
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, who: E2bAuth, services: Svc) -> Response:
    who.require("member")
    sb = await shown_sandbox(services, who, sandbox_id)
    await options.set_deadline(services, sb, body.timeout, extend_only=False)
    return Response(status_code=204)


async def _wish(services: Services, sb: SandboxRecord, event: Event, target: State) -> SandboxRecord:
    """Record `target` as desired if the lifecycle table allows `event` now (else 409 naming the state),
    then wait until the reconciler settled it."""
    transition(sb.state, event)
    services.forget(sb.id)
    await asyncio.to_thread(services.store.set_desired, sb.id, target, sb.generation)
    return await wait_settled(services, sb.id)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(
    sandbox_id: str, who: E2bAuth, services: Svc, body: PauseBody | None = None
) -> Response:
    who.require("member")
    sb = await shown_sandbox(services, who, sandbox_id)
    if e2b_state(sb) == "paused":
        raise errors.Conflict(f"sandbox {sb.id} is already paused", state=sb.state.value)
    if sb.state != State.RUNNING:
        sb = await wait_settled(services, sb.id)  # still being created or resumed: pause once it runs
    memory = body.memory if body is not None else True
    await _wish(services, sb, *((Event.PAUSE, State.PAUSED) if memory else (Event.STOP, State.STOPPED)))
    return Response(status_code=204)


#: How a paused sandbox (in E2B's sense) comes back, by SPACE state.
_RESUME = {
    State.PAUSED: (Event.RESUME, State.RUNNING),
    State.STOPPED: (Event.START, State.RUNNING),
    State.SUSPENDED: (Event.RESTORE, State.RUNNING),
}


async def connect(sandbox_id: str, body: ConnectBody, who: Principal, services: Services) -> JSONResponse:
    who.require("member")
    sb = await shown_sandbox(services, who, sandbox_id)
    resumed = e2b_state(sb) == "paused"
    if sb.state != sb.desired_state or sb.state not in (State.RUNNING, *_RESUME):
        sb = await wait_settled(services, sb.id)  # a step in flight: resume from where it lands
    if sb.state in _RESUME:
        event, target = _RESUME[sb.state]
        sb = await _wish(services, sb, event, target)
    sb = await options.set_deadline(services, sb, body.timeout, extend_only=not resumed)
    return JSONResponse(sandbox_answer(sb, who, services.node_token), status_code=201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect_v1(sandbox_id: str, body: ConnectBody, who: E2bAuth, services: Svc) -> JSONResponse:
    return await connect(sandbox_id, body, who, services)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(
    sandbox_id: str, who: E2bAuth, services: Svc, body: ConnectBody | None = None
) -> JSONResponse:
    return await connect(sandbox_id, body or ConnectBody(), who, services)
