"""Sandbox routes: create, list, read, change (snapshot policy), delete, and one route per lifecycle action.

Invariants:
- Lifecycle routes only *record desired state* (after checking the transition table allows the request,
  so a refused request is a 409 naming the current state) and then wait for the reconciler to settle it;
  they never call a node themselves. A DELETE also takes the table's `delete` edge itself (the sandbox is
  `deleting`, so refused everywhere, when it answers) and leaves the teardown to the reconciler
  (space.controlplane.reconciler.deletion.begin_deletion, docs/adr/0073-delete-answers-at-once.md).
- A create's `template` is a name or id the project sees (its own templates, the built-ins), recorded as
  the node-level name of a ready template (space.controlplane.template_catalog, ADR 0055).
- A create that waits takes the direct path (docs/adr/0046-direct-create-path.md): the request records the
  row, takes its work lease and runs the reconciler's own steps at once (Reconciler.drive: node chosen and
  incarnation recorded with the `create` swap, before the node call); it answers as soon as the sandbox
  runs. What it leaves undone (a failed node call, with its back-off; a lease another replica holds; a
  kill) the reconciler finishes, and the request then waits for that like any other.
- With an Idempotency-Key, a create derives the sandbox id from it: a retry that takes over the key of a
  request that died mid-way finds the sandbox that request recorded instead of making a second one.
- A sandbox with an egress policy or bound credentials has its policy recorded before its row exists, so
  nothing ever runs without it (issue 5).
- A list is one page, filtered, ordered and cut by the store in SQL (docs/adr/0048-metadata-lists-and-
  deadlines.md); `next_page_token` is in the answer only when another page follows.
- A deadline change (`/timeout`) is one conditional UPDATE of the store, never a lifecycle wish: it is
  allowed in every state but deleted (409 naming it), and the reconciler is woken to act on a passed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from space.controlplane.api import snapshot_sandboxes
from space.controlplane.api.bodies import CreateSandbox, EgressSpec, PatchSandbox, TimeoutBody
from space.controlplane.api.deps import (
    Auth,
    IdempotencyKey,
    Principal,
    Services,
    Svc,
    derived_sandbox_id,
    find_sandbox,
    idempotency_scope,
    idempotent,
    remember_running,
    wait_settled,
)
from space.controlplane.api.egress import prepare_create
from space.controlplane.api.views import Sandbox, Sandboxes, sandbox_view
from space.controlplane.reconciler.deletion import begin_deletion
from space.controlplane.scheduler import check_admissible
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.sandbox_listing import DEFAULT_PAGE, MAX_PAGE, MAX_TOKEN_LENGTH, SandboxQuery
from space.controlplane.template_catalog import find as find_template
from space.controlplane.template_catalog import resolve_for_create
from space.core import errors, isolation, lifecycle
from space.core.ids import new_sandbox_id, parse_sandbox_id
from space.core.lifecycle import Event, State, transition
from space.core.retention import SnapshotPolicy
from space.core.sandbox_options import MAX_METADATA_KEYS, check_metadata, metadata_filters
from space.core.settings import SandboxLimits

router = APIRouter()


@router.post("/sandboxes", status_code=201, response_model=Sandbox)
async def create_sandbox(
    body: CreateSandbox, who: Auth, services: Svc, idem: IdempotencyKey = None
) -> JSONResponse:
    who.require("member")
    check_metadata(body.metadata)  # before anything is recorded (its egress policy)
    _check_policy(body.isolation, body.snapshot_policy)
    if body.from_snapshot is not None:
        return await snapshot_sandboxes.create_route(body, who, services, idem)
    # A disk no node can hold, or an isolation no node runs, is refused now, not left waiting for a node
    # forever (ADR 0027, ADR 0076).
    await asyncio.to_thread(check_admissible, services.store, body.limits or SandboxLimits(), body.isolation)
    spec = body.egress or EgressSpec()
    allow, bound = [*body.allow, *spec.allow], [*body.credentials, *spec.credentials]
    has_policy = bool(allow or spec.deny or bound)
    sandbox_id = derived_sandbox_id(idempotency_scope(who), idem) if idem else None
    if sandbox_id is None and has_policy:
        sandbox_id = new_sandbox_id()  # its egress policy is recorded before the sandbox (issue 5)

    async def work() -> tuple[int, Any]:
        env = body.env
        if sandbox_id is not None and has_policy:
            env = await prepare_create(
                services, who, sandbox_id=sandbox_id, allow=allow, deny=spec.deny, credentials=bound,
                env=body.env,
            )  # fmt: skip
        return 201, sandbox_view(await _create(services, who, body, env, sandbox_id))

    return await idempotent(services, who, idem, f"POST /sandboxes {body.model_dump_json()}", work)


async def _create(
    services: Services, who: Principal, body: CreateSandbox, env: dict[str, str], sandbox_id: str | None
) -> SandboxRecord:
    policy = body.snapshot_policy.model_dump(mode="json") if body.snapshot_policy else None
    # A name or id the project sees, as the node-level name of a READY template (404 / 409 naming its status).
    template = await asyncio.to_thread(resolve_for_create, services.store, who.project_id, body.template)
    try:
        sb = await asyncio.to_thread(
            services.store.create_sandbox, who.project_id, template, env, body.limits,
            idle_timeout_s=body.idle_timeout_s, ttl_s=body.ttl_s, sandbox_id=sandbox_id,
            snapshot_policy=policy, metadata=body.metadata, on_timeout=body.on_timeout,
            isolation=body.isolation,
        )  # fmt: skip
    except errors.AlreadyExists:
        assert sandbox_id is not None
        sb = await find_sandbox(services, who, sandbox_id)  # a retry: that row is its first request's
    else:
        if body.wait:
            done = await services.reconciler.drive(sb)
            if done is not None:
                remember_running(services, who.project_id, done, created=True)  # its first exec is next
                return done
    if body.wait:
        return await wait_settled(services, sb.id)
    services.reconciler.poke()
    return sb


def _check_policy(kind: str, policy: SnapshotPolicy | None) -> None:
    """NotSupported (409) for a policy asking what sandboxes of isolation `kind` cannot do (ADR 0076)."""
    if policy is not None:
        isolation.refuse_policy(kind, disk_every_s=policy.disk_every_s, upload_full=policy.upload_full)


@router.get("/sandboxes", response_model=Sandboxes)
async def list_sandboxes(
    who: Auth,
    services: Svc,
    *,
    state: Annotated[list[str], Query(max_length=32, description="Repeatable; none: all but deleted.")] = [],  # noqa: B006
    template: Annotated[str | None, Query(max_length=64)] = None,
    metadata: Annotated[
        list[str], Query(max_length=MAX_METADATA_KEYS, description="Repeatable key=value; all must match.")
    ] = [],  # noqa: B006
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    page_token: Annotated[str | None, Query(max_length=MAX_TOKEN_LENGTH)] = None,
    created_after: Annotated[
        datetime | None, Query(description="Only sandboxes created at or after this time (with its offset).")
    ] = None,
) -> JSONResponse:
    if template is not None:  # a project template's name or id lists the sandboxes of its node-level name
        with contextlib.suppress(errors.SpaceError):
            template = (
                await asyncio.to_thread(find_template, services.store, who.project_id, template)
            ).node_name
    query = SandboxQuery(
        states=tuple(lifecycle.parse_state(s) for s in state), template=template,
        metadata=metadata_filters(metadata), order=order, limit=limit, page_token=page_token,
        created_after=created_after,
    )  # fmt: skip
    page = await asyncio.to_thread(services.store.page_sandboxes, who.project_id, query)
    body: dict[str, Any] = {"sandboxes": [sandbox_view(sb) for sb in page.sandboxes]}
    if page.next_page_token is not None:
        body["next_page_token"] = page.next_page_token
    return JSONResponse(body)


@router.get("/sandboxes/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: str, who: Auth, services: Svc) -> dict[str, Any]:
    return sandbox_view(await find_sandbox(services, who, sandbox_id))


@router.patch("/sandboxes/{sandbox_id}", response_model=Sandbox)
async def patch_sandbox(sandbox_id: str, body: PatchSandbox, who: Auth, services: Svc) -> dict[str, Any]:
    who.require("member")
    sb = await find_sandbox(services, who, sandbox_id)
    if "snapshot_policy" in body.model_fields_set:
        _check_policy(sb.isolation, body.snapshot_policy)
        policy = body.snapshot_policy.model_dump(mode="json") if body.snapshot_policy else None
        sb = await asyncio.to_thread(services.store.update_observed, sb.id, snapshot_policy=policy)
    return sandbox_view(sb)


@router.post("/sandboxes/{sandbox_id}/timeout", response_model=Sandbox)
async def set_sandbox_timeout(sandbox_id: str, body: TimeoutBody, who: Auth, services: Svc) -> dict[str, Any]:
    """The deadline becomes now + timeout_s (0: now, which may shorten it); with extend_only it only
    moves later (and a sandbox without one keeps none). What happens then is the sandbox's on_timeout."""
    who.require("member")
    sb = await find_sandbox(services, who, sandbox_id)
    updated = await asyncio.to_thread(
        services.store.set_deadline, sb.id, body.timeout_s, extend_only=body.extend_only
    )
    services.forget(sb.id)
    if updated.expires_at is not None and updated.expires_at <= services.store.now():
        services.reconciler.poke()  # passed already (timeout_s 0): act on it now
    return sandbox_view(updated)


@router.delete("/sandboxes/{sandbox_id}", status_code=202, response_model=Sandbox)
async def delete_sandbox(
    sandbox_id: str, who: Auth, services: Svc, idem: IdempotencyKey = None, wait: bool = False
) -> JSONResponse:
    """Answers once the sandbox is `deleting` (refused by every data and lifecycle route from then on);
    the teardown runs in the background (docs/adr/0073-delete-answers-at-once.md). `wait=true` also waits
    for it: the answer is then the `deleted` record."""
    who.require("member")
    parse_sandbox_id(sandbox_id, field="sandbox_id")

    async def work() -> tuple[int, Any]:
        # Looked up inside: a replay of a finished DELETE must get its first answer, not a 404.
        sb = await find_sandbox(services, who, sandbox_id)
        services.forget(sb.id)
        updated = await asyncio.to_thread(begin_deletion, services.store, sb)
        services.reconciler.poke()  # the teardown starts now, in this process's reconciler
        if wait:
            updated = await wait_settled(services, sb.id)
        return 202, sandbox_view(updated)

    return await idempotent(services, who, idem, f"DELETE /sandboxes/{sandbox_id}", work)


# -- lifecycle actions: one typed route per action (no /{action} catch-all) ---------------------------------
LIFECYCLE_TARGETS: dict[str, tuple[Event, State]] = {
    "pause": (Event.PAUSE, State.PAUSED),
    "resume": (Event.RESUME, State.RUNNING),
    "stop": (Event.STOP, State.STOPPED),
    "start": (Event.START, State.RUNNING),
    "suspend": (Event.SUSPEND, State.SUSPENDED),
    "restore": (Event.RESTORE, State.RUNNING),
}


async def _act(
    services: Services, who: Principal, sandbox_id: str, event: Event, target: State, *, drive: bool = False
) -> SandboxRecord:
    """Record `target` as the sandbox's desired state if the table allows `event` (else 409); a request
    that will `drive` the step takes the sandbox's lease in the same write (ADR 0074)."""
    current = await find_sandbox(services, who, sandbox_id)  # the row as it is: no second read
    if current.desired_state != target or (current.error_permanent and current.state != target):
        # The table decides on the state the user sees; an already-wished request is a no-op, unless the
        # last attempt gave up (e.g. a corrupt snapshot): asking again retries.
        transition(current.state, event)
        services.forget(current.id)
        hold = services.reconciler.request_lease if drive else None
        current = await asyncio.to_thread(
            functools.partial(services.store.set_desired, current.id, target, current.generation, hold=hold)
        )
    return current


async def _settle_directly(services: Services, current: SandboxRecord) -> SandboxRecord:
    """The sandbox once it reached its desired state. The request runs the reconciler's own steps itself
    (Reconciler.drive: the sandbox's lease held meanwhile), so no pass of the loop is waited for
    (docs/adr/0074-lifecycle-steps-in-the-request.md); what it leaves undone (a lease held elsewhere, a
    failed node call with its back-off) the reconciler finishes, and the request waits for that."""
    if current.state == current.desired_state:
        # Already there, and no lease taken: a wish (with its lease) is written only when the table allows
        # the request's event, which it never does from the request's own target state.
        return current
    if not current.error_permanent:
        driven = await services.reconciler.drive(current)
        if driven is not None and driven.state == driven.desired_state:
            return driven
    return await wait_settled(services, current.id)


def _lifecycle_route(action: str, event: Event, target: State) -> None:
    async def lifecycle_action(
        sandbox_id: str, who: Auth, services: Svc, idem: IdempotencyKey = None, wait: bool = True
    ) -> JSONResponse:
        who.require("member")
        if action == "suspend" and services.reconciler.objects is None:
            raise errors.InvalidArgument(
                "suspend needs object storage: start the control plane with --store-url", action=action
            )
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        if action in isolation.RESTRICTED:  # only then is the record read for it first
            isolation.refuse_unsupported((await find_sandbox(services, who, sandbox_id)).isolation, action)

        async def work() -> tuple[int, Any]:
            current = await _act(services, who, sandbox_id, event, target, drive=wait)
            if wait:
                return 200, sandbox_view(await _settle_directly(services, current))
            services.reconciler.poke()
            return 202, sandbox_view(current)

        return await idempotent(services, who, idem, f"POST /sandboxes/{sandbox_id}/{action}", work)

    router.add_api_route(
        f"/sandboxes/{{sandbox_id}}/{action}", lifecycle_action, methods=["POST"], name=f"{action}_sandbox",
        response_model=Sandbox, responses={202: {"model": Sandbox, "description": "Accepted (wait=false)"}},
    )  # fmt: skip


for _action, (_event, _target) in LIFECYCLE_TARGETS.items():
    _lifecycle_route(_action, _event, _target)
