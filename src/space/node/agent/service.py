"""The node service: the verbs the RPC routes run, over one NodeAgent (lifecycle, snapshots, suspend,
upload, restore, recovery, rollback, fork).

Invariants:
- Lifecycle verbs are idempotent in their outcome so a reconciler may repeat any call after a crash:
  `create` makes the sandbox with the id the control plane chose or returns it as it is (created or not);
  an action whose target state already holds returns the state; `delete` of an absent sandbox succeeds and
  also removes anything the driver still keeps under that id; a repeated fork with chosen ids returns the
  children that exist. A request the lifecycle table refuses is InvalidState naming the current state.
- Every verb on an existing sandbox first waits for a lifecycle step in flight to settle.
- A node writes only to the object store it was configured with: suspend, upload and restore naming any
  other store are InvalidArgument (`store_for`).
- An egress policy in a create or restore is validated (InvalidArgument) and remembered before the
  sandbox comes up, so it is in force from its first packet.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable

from space.core import errors
from space.core.ids import parse_sandbox_id, parse_snapshot_id
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.crypto.envelope import DataKey
from space.node.agent import rpc_models as rm
from space.node.agent.egress_settings import EgressRequest
from space.node.agent.service_core import ServiceCore, public_url, snapshot_info
from space.node.drivers.base import SandboxSpec
from space.objectstore.base import ObjectStore

log = logging.getLogger("space.node.rpc")

#: The lifecycle actions of POST /sandboxes/{id}/{action}, each with the state it leads to.
ACTION_TARGETS: dict[str, State] = {
    "pause": State.PAUSED,
    "resume": State.RUNNING,
    "stop": State.STOPPED,
    "start": State.RUNNING,
}


class NodeService(ServiceCore):
    """The node's verbs (see the module docstring); `NodeService(agent, templates, settings)`."""

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, body: rm.CreateSandboxRequest) -> tuple[rm.SandboxObserved, bool]:
        sandbox_id = parse_sandbox_id(sandbox_id)
        for attempt in range(2):
            existing = self.agent.sandboxes.get(sandbox_id)
            if existing is not None:
                await self.settle(existing)
                return await self.observe_one(existing), False
            if self.egress is not None and body.egress is not None:
                self.egress.remember(sandbox_id, _egress_request(body.egress), body.egress.credentials)
            try:
                handle = await self.agent.create(
                    body.template, limits=body.limits, env=body.env, sandbox_id=sandbox_id
                )
            except errors.AlreadyExists:
                # Either a concurrent PUT registered it (the loop returns it), or the driver still held
                # files of a half-done earlier attempt, which the failed create just destroyed: retry once.
                if attempt == 1:
                    raise
                continue
            return await self.observe_one(handle), True
        raise errors.Internal("unreachable")  # pragma: no cover

    async def act(self, sandbox_id: str, action: str) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        target = ACTION_TARGETS[action]
        operation: Callable[[str], Awaitable[None]] = getattr(self.agent, action)
        await self.settle(handle)
        self._registered(handle)
        if handle.state != target:
            try:
                await operation(handle.sandbox_id)
            except errors.InvalidState:
                # A concurrent identical request may have got there first; that is success, not a 409.
                if handle.state != target:
                    raise
        if action in {"resume", "start"}:
            self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def delete(self, sandbox_id: str) -> rm.DeleteResult:
        sandbox_id = parse_sandbox_id(sandbox_id)
        handle = self.agent.sandboxes.get(sandbox_id)
        existed = handle is not None
        if handle is None:
            # Unknown to the agent; the driver may still hold leftovers of a half-done step under this id.
            await self.agent.driver.destroy(sandbox_id)
        else:
            try:
                await self.agent.delete(sandbox_id)
            except (errors.InvalidState, errors.NotFound):
                if sandbox_id in self.agent.sandboxes:  # not a concurrent delete that won: a real refusal
                    raise
        self.activity.pop(sandbox_id, None)
        return rm.DeleteResult(id=sandbox_id, existed=existed)

    async def snapshot(self, sandbox_id: str, full: bool) -> rm.SnapshotInfo:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        record = await (self.agent.checkpoint if full else self.agent.disk_snapshot)(handle.sandbox_id)
        return snapshot_info(handle.sandbox_id, record)

    async def snapshots(self, sandbox_id: str) -> rm.SnapshotList:
        handle = self.agent.get(sandbox_id)
        records = sorted(handle.snapshots.values(), key=lambda r: r.created_at)
        listed = []
        for record in records:
            info = snapshot_info(handle.sandbox_id, record)
            try:
                usage = await self.agent.snapshot_usage(handle.sandbox_id, record.snapshot_id)
                info.exclusive_bytes = usage.get("exclusive_bytes")
            except errors.SpaceError as exc:
                log.debug("usage of snapshot %s unavailable: %s", record.snapshot_id, exc)
            listed.append(info)
        return rm.SnapshotList(snapshots=listed)

    # -- suspend / restore / recover ---------------------------------------------------------------------
    def store_for(self, url: str) -> ObjectStore:
        """The node's configured object store, if `url` names it: a node writes only where it was told to."""
        store = self.agent.store
        if store is None:
            raise errors.InvalidArgument("this node has no object store configured", field="store_url")
        if url != store.url:
            raise errors.InvalidArgument(
                "store_url is not this node's object store", field="store_url", expected=public_url(store.url)
            )
        return store

    async def suspend(self, sandbox_id: str, body: rm.SuspendRequest) -> rm.TransferResult:
        store = self.store_for(body.store_url)
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        result = await self.agent.suspend(
            handle.sandbox_id, store=store, prefix=body.prefix, snapshot_id=body.snapshot_id,
            data_key=_data_key(body.data_key),
        )  # fmt: skip
        return rm.TransferResult.model_validate(result)

    async def upload(self, sandbox_id: str, snapshot_id: str, body: rm.UploadRequest) -> rm.TransferResult:
        store = self.store_for(body.store_url)
        handle = self.agent.get(sandbox_id)
        result = await self.agent.upload_snapshot(
            handle.sandbox_id, parse_snapshot_id(snapshot_id), store=store, prefix=body.prefix,
            data_key=_data_key(body.data_key),
        )  # fmt: skip
        return rm.TransferResult.model_validate(result)

    async def restore(self, body: rm.RestoreRequest) -> rm.SandboxObserved:
        store = self.store_for(body.store_url)
        spec = SandboxSpec(
            sandbox_id=body.sandbox_id, template=body.template,
            limits=body.limits or SandboxLimits(), env=dict(body.env),
        )  # fmt: skip
        key = base64.b64decode(body.data_key_b64) if body.data_key_b64 is not None else None
        if self.egress is not None and body.egress is not None:
            self.egress.remember(body.sandbox_id, _egress_request(body.egress), body.egress.credentials)
        handle = await self.agent.restore_from_store(
            body.sandbox_id, store=store, prefix=body.prefix, data_key=key, spec=spec
        )
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def recover(self, sandbox_id: str, body: rm.RecoverRequest) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        if handle.state == State.RUNNING:
            return await self.observe_one(handle)  # already recovered (a repeated request)
        await self.agent.recover_from_checkpoint(handle.sandbox_id, body.snapshot_id)
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> rm.SandboxObserved:
        handle = self.agent.get(sandbox_id)
        await self.settle(handle)
        await self.agent.rollback(handle.sandbox_id, snapshot_id)
        self.touch(handle.sandbox_id)
        return await self.observe_one(handle)

    async def fork(self, sandbox_id: str, body: rm.ForkRequest) -> list[rm.SandboxObserved]:
        parent = self.agent.get(sandbox_id)
        await self.settle(parent)
        if body.child_ids is None:
            children = await self.agent.fork(
                parent.sandbox_id, snapshot_id=body.snapshot_id, count=body.count
            )
        else:
            children = await self.agent.fork_with_ids(parent, body.snapshot_id, body.child_ids)
        return list(await asyncio.gather(*(self.observe_one(child) for child in children)))

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        handle = self.agent.get(sandbox_id)
        snapshot_id = parse_snapshot_id(snapshot_id)
        if snapshot_id not in handle.snapshots:
            return  # already gone: a repeated delete converges
        with contextlib.suppress(errors.NotFound):
            await self.agent.delete_snapshot(handle.sandbox_id, snapshot_id)


def _egress_request(body: rm.EgressBody) -> EgressRequest:
    wanted = EgressRequest(allow=body.allow, deny=body.deny, version=body.version)
    wanted.policy()  # InvalidArgument (400) for a malformed entry, before anything is created
    return wanted


def _data_key(body: rm.DataKeyBody | None) -> DataKey | None:
    if body is None:
        return None
    return DataKey(
        key_id=body.key_id,
        wrapped=base64.b64decode(body.wrapped_b64),
        plaintext=base64.b64decode(body.plaintext_b64),
    )
