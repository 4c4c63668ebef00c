"""Node-facing routes of the control plane: registration (bootstrap token) and heartbeats (per-node identity).

Invariants:
- The bootstrap token registers nodes and does nothing else; every other node-facing call authenticates
  with the identity issued to THAT node (ADR 0019).
- Crash reports and stale copies reported by a node only ever touch sandboxes recorded on that node.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request

from space.controlplane.api.app import Services
from space.controlplane.reconciler.loop import is_orphan_copy
from space.controlplane.store.store import Store, new_node_identity
from space.core import errors
from space.core.lifecycle import State


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.InvalidArgument("body must be a JSON object")
    return body


async def _crash_reports(services: Services, node_id: str, crashed: list[str], beat_time: Any) -> None:
    """Runtimes the node saw die become `crashed` (the reconciler then recovers them). Only a report made
    after the record's last change counts: a heartbeat assembled before a recovery finished must not
    undo it."""
    if not crashed:
        return
    observed_at = datetime.fromtimestamp(float(beat_time), UTC) if beat_time else None
    for sandbox_id in crashed:
        changed = await asyncio.to_thread(
            services.store.report_crash, sandbox_id, node_id,
            notice=f"the sandbox's runtime died on node {node_id}", observed_at=observed_at,
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


def _capacity(raw: dict[str, Any]) -> dict[str, Any]:
    memory_mb = int(raw.get("memory_mb", 0))
    capacity: dict[str, Any] = {"cpus": float(raw.get("cpus", 0)), "memory_mb": memory_mb}
    capacity["sandboxes"] = max(1, memory_mb // 64)
    for field in ("disk_mb", "disk_free_mb", "disk_reserve_mb"):  # scheduler.py's disk admission
        value = raw.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            capacity[field] = max(0, value)
    return capacity


# -- node registration ---------------------------------------------------------------------------------------
async def authenticate_node(store: Store, node_id: str, authorization: str | None) -> None:
    """Node-facing routes other than registration: `Authorization: Bearer <identity>` must be the secret
    issued at THIS node's latest registration (ADR 0019), else 401 (the node then registers again)."""
    presented = (authorization or "").removeprefix("Bearer ").strip()
    if not presented:
        raise errors.Unauthenticated("missing node identity")
    if await asyncio.to_thread(store.authenticate_node, node_id, presented) is None:
        raise errors.Unauthenticated(f"bad identity for node {node_id}: register again")


def router(services: Services) -> APIRouter:
    r = APIRouter(include_in_schema=False)
    store = services.store

    def check_node_token(authorization: str | None) -> None:
        """The cluster's bootstrap token: good for registering, nothing else (ADR 0019)."""
        presented = (authorization or "").removeprefix("Bearer ").strip()
        if not presented or not hmac.compare_digest(presented, services.node_token):
            raise errors.Unauthenticated("bad node token")

    @r.post("/register")
    async def register(
        request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        check_node_token(authorization)
        body = await _json_object(request)
        # A fresh identity per registration: answered once, stored hashed; the previous one stops working.
        identity = new_node_identity()
        node = await asyncio.to_thread(
            store.register_node, str(body.get("url", "")), str(body.get("token", "")),
            capacity=_capacity(body.get("capacity") or {}), templates=list(body.get("templates") or []),
            identity=identity,
        )  # fmt: skip
        return {"node_id": node.id, "identity": identity}

    @r.post("/{node_id}/heartbeat")
    async def heartbeat(
        node_id: str, request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        await authenticate_node(store, node_id, authorization)
        beat = await _json_object(request)
        templates = list(beat.get("templates") or [])
        used = dict(beat.get("used") or {})
        used["sandboxes"] = int(beat.get("sandbox_count", len(beat.get("sandboxes") or [])))
        activity = {}
        crashed: list[str] = []
        for item in beat.get("sandboxes") or []:
            at = item.get("last_activity_at")
            if at:
                activity[str(item["id"])] = datetime.fromtimestamp(float(at), UTC)
            if item.get("state") == State.CRASHED.value:
                crashed.append(str(item["id"]))
        await asyncio.to_thread(
            store.heartbeat, node_id, used=used, templates=templates, activity=activity,
            capacity=_capacity(beat.get("capacity") or {}),
        )  # fmt: skip
        await _crash_reports(services, node_id, crashed, beat.get("time"))
        reported = [str(item["id"]) for item in beat.get("sandboxes") or [] if item.get("id")]
        await _stale_copies(services, node_id, reported)
        return {"ok": True}

    return r
