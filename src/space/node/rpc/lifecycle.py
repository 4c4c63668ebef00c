"""The node's sandbox lifecycle over RPC: node info, create, actions, delete, snapshots, egress, fork.

Invariants:
- The lifecycle calls are as idempotent as the node makes them (see space.node.agent.server): retrying one
  after a timeout or a crash is always safe; `fork` and `create_snapshot` take an idempotency key (or, for
  fork, the children's ids) to make their retries safe too.
- Every answer is validated into its space.node.agent.rpc_models model before it is returned.
- Placing calls name the incarnation they place and deletes the one they mean (docs/adr/0032-lost-nodes-
  and-incarnations.md); the node answers a stale one with Conflict (details: reason `stale_incarnation`,
  the incarnation it holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from space.core.settings import SandboxLimits
from space.node.agent import rpc_models as rm
from space.node.rpc.transport import (
    NodeTransport,
    idempotency_header,
    raise_for_error,
    sandbox_path,
    translated,
)


class LifecycleCalls(NodeTransport):
    # -- node ------------------------------------------------------------------------------------------------
    async def info(self) -> rm.NodeInfo:
        return rm.NodeInfo.model_validate(await self._request("GET", "/info"))

    async def list_sandboxes(self, *, guest: bool = True) -> rm.SandboxList:
        answer = await self._request("GET", "/sandboxes", params={"guest": guest})
        return rm.SandboxList.model_validate(answer)

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def get_sandbox(self, sandbox_id: str) -> rm.SandboxObserved:
        return rm.SandboxObserved.model_validate(
            await self._request("GET", sandbox_path(sandbox_id), sandbox_id=sandbox_id)
        )

    async def create_sandbox(
        self,
        sandbox_id: str,
        *,
        template: str = "python",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | Mapping[str, Any] | None = None,
        egress: Mapping[str, Any] | None = None,
        incarnation: int | None = None,
    ) -> tuple[rm.SandboxObserved, bool]:
        """Create the sandbox with this id, or get it as it is if it exists; (observed, created). `egress`
        ({"allow", "deny", "credentials", "version"}): its policy; without it a node with a control plane
        asks the control plane for it, and no policy means no egress."""
        body: dict[str, Any] = {"template": template, "env": dict(env or {})}
        if limits is not None:
            body["limits"] = limits.model_dump() if isinstance(limits, SandboxLimits) else dict(limits)
        if egress is not None:
            body["egress"] = dict(egress)
        if incarnation is not None:
            body["incarnation"] = incarnation
        path = sandbox_path(sandbox_id)
        with translated(f"PUT {path}"):
            response = await self._http.put(path, json=body, headers=self._headers(None, sandbox_id))
            await raise_for_error(response)
        return rm.SandboxObserved.model_validate(response.json()), response.status_code == 201

    async def action(self, sandbox_id: str, action: rm.LifecycleAction) -> rm.SandboxObserved:
        answer = await self._request("POST", sandbox_path(sandbox_id, action), sandbox_id=sandbox_id)
        return rm.SandboxObserved.model_validate(answer)

    async def pause(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "pause")

    async def resume(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "resume")

    async def stop(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "stop")

    async def start(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "start")

    async def delete_sandbox(self, sandbox_id: str, *, incarnation: int | None = None) -> rm.DeleteResult:
        """Delete the node's copy; with `incarnation`, only that copy (Conflict if the node holds another)."""
        params = {"incarnation": incarnation} if incarnation is not None else None
        answer = await self._request("DELETE", sandbox_path(sandbox_id), params=params, sandbox_id=sandbox_id)
        return rm.DeleteResult.model_validate(answer)

    async def get_incarnation(self, sandbox_id: str) -> int | None:
        """The incarnation of the node's copy (None: a copy from before incarnations); NotFound: no copy."""
        answer = await self._request("GET", sandbox_path(sandbox_id, "incarnation"), sandbox_id=sandbox_id)
        return rm.IncarnationHeld.model_validate(answer).incarnation

    async def place_incarnation(self, sandbox_id: str, incarnation: int) -> None:
        """Announce the incarnation of the copy about to be placed on the node (before a restore or a fork
        child): Conflict if the node holds a copy of another incarnation (delete that one first)."""
        path = sandbox_path(sandbox_id, "incarnation")
        await self._request("PUT", path, json_body={"incarnation": incarnation}, sandbox_id=sandbox_id)

    async def create_snapshot(
        self, sandbox_id: str, *, full: bool = False, idempotency_key: str | None = None
    ) -> rm.SnapshotInfo:
        answer = await self._request(
            "POST", sandbox_path(sandbox_id, "snapshots"), json_body={"full": full},
            headers=idempotency_header(idempotency_key), sandbox_id=sandbox_id,
        )  # fmt: skip
        return rm.SnapshotInfo.model_validate(answer)

    async def list_snapshots(self, sandbox_id: str) -> list[rm.SnapshotInfo]:
        answer = await self._request("GET", sandbox_path(sandbox_id, "snapshots"), sandbox_id=sandbox_id)
        return rm.SnapshotList.model_validate(answer).snapshots

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        path = sandbox_path(sandbox_id, "snapshots", snapshot_id)
        await self._request("DELETE", path, sandbox_id=sandbox_id)

    async def set_egress(
        self, sandbox_id: str, policy: Mapping[str, Any], credentials: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Apply a changed egress policy ({"allow", "deny", "version"}) and the names of the credentials now
        bound to the sandbox (their values the node fetches from the control plane itself)."""
        body = {"policy": dict(policy), "credentials": list(credentials)}
        path = sandbox_path(sandbox_id, "egress")
        answer = await self._request("PUT", path, json_body=body, sandbox_id=sandbox_id)
        return dict(answer)

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> rm.SandboxObserved:
        answer = await self._request(
            "POST",
            sandbox_path(sandbox_id, "rollback"),
            json_body={"snapshot_id": snapshot_id},
            sandbox_id=sandbox_id,
        )
        return rm.SandboxObserved.model_validate(answer)

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        snapshot_id: str | None = None,
        child_ids: Sequence[str] | None = None,
        idempotency_key: str | None = None,
    ) -> list[rm.SandboxObserved]:
        body: dict[str, Any] = {"count": count}
        if snapshot_id is not None:
            body["snapshot_id"] = snapshot_id
        if child_ids is not None:
            body["child_ids"] = list(child_ids)
        answer = await self._request(
            "POST",
            sandbox_path(sandbox_id, "fork"),
            json_body=body,
            headers=idempotency_header(idempotency_key),
            sandbox_id=sandbox_id,
        )
        return rm.SandboxList.model_validate(answer).sandboxes
