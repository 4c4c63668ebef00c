"""A control plane world for reconciler tests without real nodes: a migrated SQLite store, a local object
store, real artifacts and keys, and `FakeNodeApi` nodes that implement the node RPC contract in memory
(suspend writes a real artifact with the data key it is given; restore verifies every part with the key
it is given). A node call can be made to raise `Killed` (a BaseException, like a SIGKILL of the control
plane) after its side effect happened, so the tests can check that the reconciler converges."""

from __future__ import annotations

import asyncio
import pathlib
import time
from typing import Any

from space.controlplane.keys import OrgDataKeys
from space.controlplane.reconciler.deletion import is_orphan_copy
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.snapshots import SnapshotKeeper
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.controlplane.store.store import Store, open_store
from space.core import errors
from space.core.ids import new_snapshot_id
from space.core.lifecycle import State
from space.crypto.envelope import DataKey
from space.node.agent import rpc_models as rm
from space.objectstore.artifacts import ArtifactWriter, read_entry_bytes, read_manifest, verify
from space.objectstore.backends import open_store as open_objects
from space.objectstore.base import ObjectStore


class Killed(BaseException):
    """The control plane died right after this node call returned (its side effect happened)."""


class FakeNodeApi:
    """One node's RPC surface (the NodeClient methods the control plane calls), in memory."""

    def __init__(self, node_id: str, objects: ObjectStore, store_url: str) -> None:
        self.node_id = node_id
        self.objects = objects
        self.store_url = store_url
        self.sandboxes: dict[str, dict[str, Any]] = {}
        # sandbox id -> incarnation of the copy here (or announced for the copy being placed), as the node
        # agent keeps it (space.node.agent.incarnations): requests naming another one are refused.
        self.incarnations: dict[str, int] = {}
        self.kill_after: set[str] = set()  # method names: raise Killed after the side effect
        self.fail: dict[str, errors.SpaceError] = {}  # method name -> raised before any side effect
        self.calls: list[str] = []
        self.uploaded_from: list[str] = []  # the sandbox's state at each upload_snapshot

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail.pop(name)

    def _leave(self, name: str) -> None:
        if name in self.kill_after:
            self.kill_after.discard(name)
            raise Killed(name)

    def _get(self, sandbox_id: str) -> dict[str, Any]:
        if sandbox_id not in self.sandboxes:
            raise errors.NotFound(f"sandbox {sandbox_id} not on {self.node_id}")
        return self.sandboxes[sandbox_id]

    def _observed(self, sandbox_id: str) -> rm.SandboxObserved:
        sb = self._get(sandbox_id)
        return rm.SandboxObserved(
            id=sandbox_id, state=sb["state"], template="python", limits=sb["limits"], created_at=sb["at"]
        )

    def _stale(self, sandbox_id: str, named: int | None, *, placing: bool) -> None:
        held = self.incarnations.get(sandbox_id)
        if named is None or held is None or held == named:
            return
        if placing and sandbox_id not in self.sandboxes:
            return
        raise errors.Conflict(
            f"holds incarnation {held}, not {named}",
            reason="stale_incarnation",
            incarnation=held,
            named=named,
        )

    async def place_incarnation(self, sandbox_id: str, incarnation: int) -> None:
        self._enter("place_incarnation")
        self._stale(sandbox_id, incarnation, placing=True)
        self.incarnations[sandbox_id] = incarnation

    async def get_incarnation(self, sandbox_id: str) -> int | None:
        self._get(sandbox_id)
        return self.incarnations.get(sandbox_id)

    async def create_sandbox(
        self, sandbox_id: str, *, template: str, env: Any, limits: Any, incarnation: int | None = None
    ) -> Any:
        self._enter("create_sandbox")
        self._stale(sandbox_id, incarnation, placing=True)
        if incarnation is not None:
            self.incarnations[sandbox_id] = incarnation
        self.sandboxes.setdefault(
            sandbox_id,
            {"state": "running", "files": {}, "snapshots": {}, "limits": limits, "at": time.time()},
        )
        self._leave("create_sandbox")
        return self._observed(sandbox_id), True

    async def get_sandbox(self, sandbox_id: str) -> rm.SandboxObserved:
        return self._observed(sandbox_id)

    async def list_sandboxes(self, *, guest: bool = True) -> rm.SandboxList:
        return rm.SandboxList(sandboxes=[self._observed(i) for i in self.sandboxes])

    async def pause(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "paused"
        return self._observed(sandbox_id)

    async def resume(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "running"
        return self._observed(sandbox_id)

    async def stop(self, sandbox_id: str) -> rm.SandboxObserved:
        self._enter("stop")
        self._get(sandbox_id)["state"] = "stopped"
        self._leave("stop")
        return self._observed(sandbox_id)

    async def start(self, sandbox_id: str) -> rm.SandboxObserved:
        self._get(sandbox_id)["state"] = "running"
        return self._observed(sandbox_id)

    async def delete_sandbox(self, sandbox_id: str, *, incarnation: int | None = None) -> rm.DeleteResult:
        self._enter("delete_sandbox")
        self._stale(sandbox_id, incarnation, placing=False)
        existed = self.sandboxes.pop(sandbox_id, None) is not None
        self.incarnations.pop(sandbox_id, None)
        self._leave("delete_sandbox")
        return rm.DeleteResult(id=sandbox_id, existed=existed)

    async def create_snapshot(self, sandbox_id: str, *, full: bool = False) -> rm.SnapshotInfo:
        sb = self._get(sandbox_id)
        snapshot_id = new_snapshot_id()
        sb["snapshots"][snapshot_id] = {"kind": "full" if full else "disk", "files": dict(sb["files"])}
        return rm.SnapshotInfo(
            snapshot_id=snapshot_id, sandbox_id=sandbox_id, kind="full" if full else "disk",
            created_at=time.time(), image_bytes=123,
        )  # fmt: skip

    async def list_snapshots(self, sandbox_id: str) -> list[rm.SnapshotInfo]:
        return []

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        self._get(sandbox_id)["snapshots"].pop(snapshot_id, None)

    async def fork(
        self, sandbox_id: str, *, count: int, snapshot_id: str | None, child_ids: list[str]
    ) -> list[rm.SandboxObserved]:
        """Children of a full checkpoint held here (idempotent by child id)."""
        self._enter("fork")
        assert snapshot_id is not None and count == len(child_ids)
        files = self._get(sandbox_id)["snapshots"][snapshot_id]["files"]
        for child in child_ids:
            self.sandboxes.setdefault(
                child,
                {"state": "running", "files": dict(files), "snapshots": {}, "limits": {}, "at": time.time()},
            )
        self._leave("fork")
        return [self._observed(child) for child in child_ids]

    def _write(self, prefix: str, files: dict[str, bytes], data_key: DataKey | None) -> dict[str, Any]:
        if self.objects.exists(f"{prefix}/manifest.json"):
            return {"prefix": prefix}  # idempotent repeat
        writer = ArtifactWriter(self.objects, prefix, data_key=data_key, metadata={"files": sorted(files)})
        for name, data in files.items():
            writer.add_bytes(name, data)
        manifest = writer.commit()
        return {"prefix": prefix, "stored_bytes": manifest.total_stored_bytes}

    async def suspend(
        self, sandbox_id: str, *, store_url: str, prefix: str, snapshot_id: str, data_key: DataKey | None
    ) -> dict[str, Any]:
        self._enter("suspend")
        assert store_url == self.store_url
        sb = self._get(sandbox_id)
        sb["state"] = "paused"
        sb["snapshots"][snapshot_id] = {"kind": "full", "files": dict(sb["files"])}
        answer = self._write(prefix, sb["files"] or {"empty": b""}, data_key)
        self._leave("suspend")
        return {"snapshot_id": snapshot_id, **answer}

    async def upload_snapshot(
        self, sandbox_id: str, snapshot_id: str, *, store_url: str, prefix: str, data_key: DataKey | None
    ) -> dict[str, Any]:
        self._enter("upload_snapshot")
        self.uploaded_from.append(self._get(sandbox_id)["state"])
        snap = self._get(sandbox_id)["snapshots"][snapshot_id]
        answer = self._write(prefix, snap["files"] or {"empty": b""}, data_key)
        self._leave("upload_snapshot")
        return answer

    async def restore(
        self, sandbox_id: str, *, store_url: str, prefix: str, data_key: bytes | None, template: str,
        limits: Any, env: Any,
    ) -> rm.SandboxObserved:  # fmt: skip
        self._enter("restore")
        assert store_url == self.store_url
        if sandbox_id in self.sandboxes and self.sandboxes[sandbox_id]["state"] == "running":
            return self._observed(sandbox_id)
        manifest = read_manifest(self.objects, prefix)
        verify(self.objects, manifest, data_key=data_key)  # every part, before anything "boots"
        files = {
            name: read_entry_bytes(self.objects, manifest, name, data_key=data_key)
            for name in manifest.entries
        }
        files.pop("empty", None)
        self.sandboxes[sandbox_id] = {
            "state": "running", "files": files, "snapshots": {}, "limits": limits, "at": time.time()
        }  # fmt: skip
        self._leave("restore")
        return self._observed(sandbox_id)

    async def recover(self, sandbox_id: str, *, snapshot_id: str | None = None) -> rm.SandboxObserved:
        self._enter("recover")
        sb = self._get(sandbox_id)
        assert snapshot_id is not None
        sb["files"] = dict(sb["snapshots"][snapshot_id]["files"])
        sb["state"] = "running"
        self._leave("recover")
        return self._observed(sandbox_id)


class FakePool:
    def __init__(self, nodes: dict[str, FakeNodeApi]) -> None:
        self.nodes = nodes

    def client(self, node_id: str) -> FakeNodeApi:
        if node_id not in self.nodes:
            raise errors.Unavailable(f"node {node_id} unreachable")
        return self.nodes[node_id]

    async def aclose(self) -> None:
        pass


class World:
    def __init__(self, root: pathlib.Path) -> None:
        self.store: Store = open_store(sqlite_url(root / "db"))
        (root / "objects").mkdir()
        self.store_url = f"file://{root / 'objects'}"
        self.objects = open_objects(self.store_url)
        self.keys = OrgDataKeys.local(self.store, root / "keys")
        org = self.store.create_org("acme")
        self.org_id = org.id
        self.project = self.store.create_project(org.id, "p").id
        self.node_ids = []
        self.api: dict[str, FakeNodeApi] = {}
        for i in range(2):
            node = self.store.register_node(
                f"http://node{i}", "tok", capacity={"cpus": 4, "memory_mb": 4096, "sandboxes": 64}
            )
            self.node_ids.append(node.id)
            self.api[node.id] = FakeNodeApi(node.id, self.objects, self.store_url)
        self.pool = FakePool(dict(self.api))
        self.reconciler = Reconciler(
            self.store,
            self.pool,  # type: ignore[arg-type]  # the NodeClient surface, in memory
            objects=self.objects,
            store_url=self.store_url,
            data_keys=self.keys,
            node_fresh_s=None,  # the in-memory nodes never heartbeat: ready is enough here
        )
        self.keeper = SnapshotKeeper(self.reconciler)
        # Background tasks a step started (freeing a suspended sandbox's node copy) that already ended and
        # so left the reconciler's `_freeing` map: their Killed must still reach the test.
        self.finished: list[asyncio.Task[None]] = []
        forget_task = self.reconciler._freed

        def keep_finished(sandbox_id: str, task: asyncio.Task[None]) -> None:
            self.finished.append(task)
            forget_task(sandbox_id, task)

        self.reconciler._freed = keep_finished  # type: ignore[method-assign]

    def run(self, sandbox_id: str, *, rounds: int = 6) -> SandboxRecord:
        """Reconcile until settled (a few rounds, as the claim loop would); Killed propagates."""

        async def go() -> None:
            for _ in range(rounds):
                sb = self.store.load_sandbox(sandbox_id)
                assert sb is not None
                if sb.state == sb.desired_state and not sb.state.endswith("ing"):
                    return
                if sb.error_permanent:
                    return
                self.store.update_observed(sandbox_id, next_attempt_at=self.store.now())
                try:
                    await self.reconciler.reconcile(sb)
                finally:
                    # Background work the steps started (freeing a suspended sandbox's node copy) ends
                    # before this "process" does, as it would in a long-running control plane.
                    running = [task for _node, task in self.reconciler._freeing.values()]
                    try:
                        await asyncio.gather(*running, *self.finished)
                    finally:
                        self.finished = []  # all done now, and their loop ends with this "process"

        asyncio.run(go())
        sb = self.store.load_sandbox(sandbox_id)
        assert sb is not None
        return sb

    def running_sandbox(self, files: dict[str, bytes] | None = None) -> SandboxRecord:
        sb = self.store.create_sandbox(self.project, "python")
        sb = self.run(sb.id)
        assert sb.state == State.RUNNING and sb.node_id is not None
        self.api[sb.node_id].sandboxes[sb.id]["files"] = dict(files or {"a.txt": b"hello"})
        return sb

    def copies(self, sandbox_id: str) -> dict[str, str]:
        """node id -> state of the copies of this sandbox the nodes hold."""
        return {
            node_id: api.sandboxes[sandbox_id]["state"]
            for node_id, api in self.api.items()
            if sandbox_id in api.sandboxes
        }

    def objects_of(self, sb: SandboxRecord) -> list[str]:
        return self.objects.list(f"sandboxes/{sb.project_id}/{sb.id}/")

    def collect_orphans(self) -> None:
        """What Reconciler.collect_orphans does, over the fake nodes."""
        for node_id, api in self.api.items():
            for sandbox_id in list(api.sandboxes):
                record = self.store.load_sandbox(sandbox_id)
                if record is None or is_orphan_copy(record, node_id, suspended_grace_s=0):
                    del api.sandboxes[sandbox_id]
                    api.incarnations.pop(sandbox_id, None)

    def use_nodes(self, node_type: type[FakeNodeApi]) -> None:
        """Every node of this world replaced by one of `node_type` (a FakeNodeApi that plays a part)."""
        for node_id, old in list(self.api.items()):
            self.api[node_id] = self.pool.nodes[node_id] = node_type(node_id, old.objects, old.store_url)

    def close(self) -> None:
        self.store.close()
