"""A sandbox's lifecycle routes (the reconciler's verbs) and its egress policy.

Invariants:
- PUT creates the sandbox with the id the control plane chose or returns it as it is (201 vs 200); an
  action whose target state already holds answers 200 with the state; DELETE of an absent sandbox is a 200.
  A request the lifecycle table refuses is a 409 whose details name the current state.
- An egress policy push applies only versions newer than the one in force (older ones answer "stale").
- Conditional by incarnation (docs/adr/0032-lost-nodes-and-incarnations.md): a PUT or an announcement
  (PUT .../incarnation) records the incarnation of the copy placed here before it is made; a DELETE naming
  an incarnation (`?incarnation=G`) removes the copy only if it is that one, else 409 `stale_incarnation`
  and nothing is touched.
"""

from __future__ import annotations

from typing import Any

from fastapi import Query, Request, Response
from pydantic import ValidationError

from space.core import errors
from space.core.ids import parse_sandbox_id
from space.node.agent import rpc_models as rm
from space.node.agent.egress_settings import EgressRequest
from space.node.agent.incarnations import MAX_INCARNATION
from space.node.agent.routes.deps import Service
from space.node.agent.rpc_auth import resource_router
from space.node.agent.service import ACTION_TARGETS

router = resource_router()


@router.get("/sandboxes/{sandbox_id}", response_model=rm.SandboxObserved)
async def get_sandbox(svc: Service, sandbox_id: str) -> rm.SandboxObserved:
    return await svc.observe_one(svc.agent.get(sandbox_id))


@router.put("/sandboxes/{sandbox_id}", response_model=rm.SandboxObserved, status_code=201)
async def put_sandbox(
    svc: Service, sandbox_id: str, body: rm.CreateSandboxRequest, response: Response
) -> rm.SandboxObserved:
    if body.incarnation is not None:
        sandbox_id = parse_sandbox_id(sandbox_id)
        has_copy = sandbox_id in svc.agent.sandboxes
        svc.agent.incarnations.place(sandbox_id, body.incarnation, has_copy=has_copy)
    observed, created = await svc.create(sandbox_id, body)
    response.status_code = 201 if created else 200
    return observed


@router.get("/sandboxes/{sandbox_id}/incarnation", response_model=rm.IncarnationHeld)
async def get_incarnation(svc: Service, sandbox_id: str) -> rm.IncarnationHeld:
    """The incarnation of this node's copy (404 when the node holds no copy and expects none)."""
    sandbox_id = parse_sandbox_id(sandbox_id)
    held = svc.agent.incarnations.get(sandbox_id)
    if held is None and sandbox_id not in svc.agent.sandboxes:
        raise errors.NotFound(f"sandbox {sandbox_id} does not exist on this node")
    return rm.IncarnationHeld(sandbox_id=sandbox_id, incarnation=held)


@router.put("/sandboxes/{sandbox_id}/incarnation", response_model=rm.IncarnationHeld)
async def place_incarnation(svc: Service, sandbox_id: str, body: rm.IncarnationBody) -> rm.IncarnationHeld:
    """Announce the incarnation of the copy about to be placed here (a restore, a fork child): from now on
    requests naming another one are refused. 409 if a copy of another incarnation is here."""
    sandbox_id = parse_sandbox_id(sandbox_id)
    has_copy = sandbox_id in svc.agent.sandboxes
    svc.agent.incarnations.place(sandbox_id, body.incarnation, has_copy=has_copy)
    return rm.IncarnationHeld(sandbox_id=sandbox_id, incarnation=body.incarnation)


def _action_route(action: str) -> None:
    async def run_action(svc: Service, sandbox_id: str) -> rm.SandboxObserved:
        return await svc.act(sandbox_id, action)

    router.add_api_route(
        f"/sandboxes/{{sandbox_id}}/{action}",
        run_action,
        methods=["POST"],
        response_model=rm.SandboxObserved,
        name=f"{action}_sandbox",
    )


for _action in ACTION_TARGETS:
    _action_route(_action)


@router.delete("/sandboxes/{sandbox_id}", response_model=rm.DeleteResult)
async def delete_sandbox(
    svc: Service, sandbox_id: str, incarnation: int | None = Query(default=None, ge=0, le=MAX_INCARNATION)
) -> rm.DeleteResult:
    """Delete the copy here; with `incarnation`, only if it is that copy (409 otherwise)."""
    sandbox_id = parse_sandbox_id(sandbox_id)
    svc.agent.incarnations.check(sandbox_id, incarnation, "deleting")
    result = await svc.delete(sandbox_id)
    svc.agent.incarnations.forget(sandbox_id, incarnation)
    return result


# egress policy pushed by the control plane at run time (issue 5)
@router.put("/sandboxes/{sandbox_id}/egress")
async def set_egress(svc: Service, sandbox_id: str, request: Request) -> dict[str, Any]:
    """Record the sandbox's new policy (newer versions only) and hand it to the node's egress gateway
    (space.node.agent.egress_wiring: in force at once, the sandbox's cached credentials dropped)."""
    handle = svc.agent.get(sandbox_id)  # NotFound for a sandbox this node does not run
    body = await request.json()
    policy, names = dict(body.get("policy") or {}), [str(n) for n in body.get("credentials") or []]
    if svc.egress is not None:
        try:
            wanted = EgressRequest.model_validate(
                {"allow": policy.get("allow") or [], "deny": policy.get("deny") or [],
                 "version": int(policy.get("version") or 0),
                 "private_networks": policy.get("private_networks")}
            )  # fmt: skip
        except (ValidationError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"egress policy: {exc}", field="policy") from exc
        return await svc.egress.apply(handle.sandbox_id, wanted, names)
    policies = svc.egress_policies
    known = policies.get(handle.sandbox_id)
    if known is not None and int(known["policy"].get("version", 0)) > int(policy.get("version", 0)):
        return {"applied": False, "reason": "stale", "version": known["policy"].get("version")}
    policies[handle.sandbox_id] = {"policy": policy, "credentials": names}
    reason = "no egress gateway on this node"
    return {"applied": False, "reason": reason, "version": policy.get("version")}
