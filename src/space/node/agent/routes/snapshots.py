"""Snapshot routes, and moving sandboxes through object storage (docs/adr/0012-suspend-restore-on-nodes.md):
snapshots, suspend, upload, restore, recover, rollback, fork.

Invariants:
- Snapshot and fork are not idempotent by themselves: an Idempotency-Key makes a repeat return the first
  run's answer (space.node.agent.idempotency).
- POST /sandboxes/restore names its sandbox in the body: its capability is checked against that id.
"""

from __future__ import annotations

from typing import Any

from space.node.agent import rpc_models as rm
from space.node.agent.routes.deps import IdempotencyKey, Service
from space.node.agent.rpc_auth import resource_router

router = resource_router()


@router.post("/sandboxes/{sandbox_id}/snapshots", response_model=rm.SnapshotInfo, status_code=201)
async def create_snapshot(
    svc: Service, sandbox_id: str, body: rm.SnapshotRequest, idempotency_key: IdempotencyKey = None
) -> rm.SnapshotInfo:
    result: rm.SnapshotInfo = await svc.replays.run(
        idempotency_key, f"snapshot:{sandbox_id}", body.model_dump(),
        lambda: svc.snapshot(sandbox_id, body.full),
    )  # fmt: skip
    return result


@router.get("/sandboxes/{sandbox_id}/snapshots", response_model=rm.SnapshotList)
async def list_snapshots(svc: Service, sandbox_id: str) -> rm.SnapshotList:
    return await svc.snapshots(sandbox_id)


# suspend / restore / recover through object storage
@router.post("/sandboxes/restore", response_model=rm.SandboxObserved)
async def restore_sandbox(svc: Service, body: rm.RestoreRequest) -> rm.SandboxObserved:
    return await svc.restore(body)


@router.post("/sandboxes/{sandbox_id}/suspend", response_model=rm.TransferResult)
async def suspend_sandbox(svc: Service, sandbox_id: str, body: rm.SuspendRequest) -> rm.TransferResult:
    return await svc.suspend(sandbox_id, body)


@router.post("/sandboxes/{sandbox_id}/snapshots/{snapshot_id}/upload", response_model=rm.TransferResult)
async def upload_snapshot(
    svc: Service, sandbox_id: str, snapshot_id: str, body: rm.UploadRequest
) -> rm.TransferResult:
    return await svc.upload(sandbox_id, snapshot_id, body)


@router.post("/sandboxes/{sandbox_id}/recover", response_model=rm.SandboxObserved)
async def recover_sandbox(svc: Service, sandbox_id: str, body: rm.RecoverRequest) -> rm.SandboxObserved:
    return await svc.recover(sandbox_id, body)


@router.delete("/sandboxes/{sandbox_id}/snapshots/{snapshot_id}")
async def delete_snapshot(svc: Service, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
    await svc.delete_snapshot(sandbox_id, snapshot_id)
    return {}


@router.post("/sandboxes/{sandbox_id}/rollback", response_model=rm.SandboxObserved)
async def rollback(svc: Service, sandbox_id: str, body: rm.RollbackRequest) -> rm.SandboxObserved:
    return await svc.rollback(sandbox_id, body.snapshot_id)


@router.post("/sandboxes/{sandbox_id}/fork", response_model=rm.SandboxList, status_code=201)
async def fork(
    svc: Service, sandbox_id: str, body: rm.ForkRequest, idempotency_key: IdempotencyKey = None
) -> rm.SandboxList:
    children: list[rm.SandboxObserved] = await svc.replays.run(
        idempotency_key, f"fork:{sandbox_id}", body.model_dump(), lambda: svc.fork(sandbox_id, body)
    )
    return rm.SandboxList(sandboxes=children)
