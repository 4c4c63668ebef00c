"""Suspend and restore through the API on the real runsc node (`real_cluster`: root helper, node agent as the
`space` user, control plane with a local-directory object store under its data directory).

- suspend: the node is freed (no runtime left for the sandbox), the checkpoint and filesystem delta are in
  the object store, encrypted, with a manifest; restore: every file's SHA-256 matches and a process that
  counts in the background continues from where it stopped (not from zero);
- a flipped bit in a stored part is detected on restore: the sandbox stays suspended with the error on its
  record and nothing runs; with the part repaired, restore succeeds.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import pytest

from space.core.lifecycle import State
from space.objectstore.artifacts import read_manifest
from space.objectstore.backends import open_store
from space.sdk import NotFound, Sandbox, SpaceError
from tests.support import cluster as c
from tests.support.host import processes_mentioning

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

COUNTER = "i=0; while true; do echo $i > /work/counter; i=$((i+1)); sleep 0.1; done"


def counter(sb: Sandbox) -> int:
    """The background counter's value (0 before its first write; a torn read of the rewritten file is
    retried)."""
    for _ in range(50):
        try:
            text = sb.files.read("/work/counter").decode().strip()
        except NotFound:
            return 0
        if text.isdigit():
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the counter file never held a number")


def digests(sb: Sandbox, paths: list[str]) -> dict[str, str]:
    return {p: hashlib.sha256(sb.files.read(p)).hexdigest() for p in paths}


def put_as_agent(real_cluster: c.RealCluster, key: str, data: bytes) -> None:
    """Overwrite a stored object (as the test, root) and give it back to the store's owner (the agent user),
    as if the bytes had changed at rest."""
    root = real_cluster.data_dir / "objects"
    open_store(root.as_uri()).put(key, data)
    owner = root.stat()
    os.chown(root / key, owner.st_uid, owner.st_gid)


def test_suspend_and_restore_keep_files_and_processes(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            files = {"/work/big.bin": os.urandom(3 << 20), "/work/small.txt": b"hello\n"}
            for path, data in files.items():
                sb.files.write(path, data)
            sb.processes.start(COUNTER, tag="counter")
            c.wait_for(lambda: counter(sb) >= 5, timeout=20, what="the counter counting")
            before = digests(sb, list(files))

            started = time.monotonic()
            assert sb.suspend().state == "suspended"
            suspend_s = time.monotonic() - started
            view = sb.refresh().data
            assert view["node_id"] is None and view["suspended_snapshot_id"]
            listed = {s.id: s for s in sb.snapshots.list()}
            snap = listed[view["suspended_snapshot_id"]]
            assert snap.locations == ["objectstore"] and snap.data["restorable"]
            objects = open_store((real_cluster.data_dir / "objects").as_uri())
            prefix = f"sandboxes/{view['project_id']}/{sb.id}/{snap.id}"
            manifest = read_manifest(objects, prefix)
            assert manifest.encryption is not None, "what leaves the node is encrypted"
            node_view = real_cluster.local.node  # the in-process LocalNode of the installation
            assert node_view is not None
            c.wait_for(
                lambda: sb.id not in c.sandbox_ids_in(real_cluster.data_dir), timeout=30, interval=0.1,
                what="the node's copy gone",
            )  # fmt: skip

            started = time.monotonic()
            assert sb.restore().state == "running"
            restore_s = time.monotonic() - started
            stopped_at = counter(sb)
            assert digests(sb, list(files)) == before
            c.wait_for(lambda: counter(sb) > stopped_at, timeout=20, what="the counter going on")
            assert stopped_at >= 5, "continued from where it stopped, not from zero"
            print(f"\nrunsc: suspend {suspend_s:.2f}s, restore {restore_s:.2f}s (3 MB of files)")
        finally:
            sb.delete()


def test_snapshot_listing_shows_exclusive_bytes_and_location(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            sb.snapshots.create()
            sb.files.write("/work/ten.bin", os.urandom(10 << 20))
            second = sb.snapshots.create()
            listed = {s.id: s for s in sb.snapshots.list()}
            entry = listed[second.id]
            node_id = sb.refresh().data["node_id"]
            assert entry.locations == [f"node:{node_id}"]
            assert entry.exclusive_bytes is not None
            print(f"\nexclusive bytes of a disk snapshot after writing 10 MiB: {entry.exclusive_bytes}")
            assert 10 << 20 <= entry.exclusive_bytes <= 11 << 20
        finally:
            sb.delete()


def test_a_flipped_bit_is_detected_and_never_booted(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            sb.files.write("/work/data.bin", os.urandom(1 << 20))
            sb.suspend()
            view = sb.refresh().data
            objects = open_store((real_cluster.data_dir / "objects").as_uri())
            prefix = f"sandboxes/{view['project_id']}/{sb.id}/{view['suspended_snapshot_id']}"
            part = next(k for k in objects.list(prefix + "/") if "/parts/" in k)
            original = objects.get(part)
            flipped = bytearray(original)
            flipped[len(flipped) // 2] ^= 0x04
            put_as_agent(real_cluster, part, bytes(flipped))

            with pytest.raises(SpaceError) as refused:
                sb.restore()
            assert refused.value.code == "artifact_corrupt", refused.value  # 502, a typed error
            after = sb.refresh()
            assert after.state == State.SUSPENDED.value and after.data["node_id"] is None
            assert after.data["error"] and after.data["error"].startswith("artifact_corrupt")
            assert sb.id not in c.sandbox_ids_in(real_cluster.data_dir), "nothing of it was booted"

            put_as_agent(real_cluster, part, original)  # repaired: asking again retries
            assert sb.restore().state == "running"
            assert len(sb.files.read("/work/data.bin")) == 1 << 20
        finally:
            sb.delete()


def test_a_killed_runtime_is_recovered_from_its_checkpoint(real_cluster: c.RealCluster) -> None:
    """The sandbox's gVisor runtime is SIGKILLed: the node reports it crashed, the control plane recovers it
    from its newest full checkpoint (processes included) and says so on the record."""
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            sb.files.write("/work/state.txt", b"checkpointed")
            sb.processes.start(COUNTER, tag="counter")
            c.wait_for(lambda: counter(sb) >= 3, timeout=20, what="counting")
            snap = sb.snapshots.create(full=True)
            sb.files.write("/work/state.txt", b"lost with the runtime")
            runtimes = [line for line in processes_mentioning(sb.id) if "runsc" in line and "boot" in line]
            assert runtimes, processes_mentioning(sb.id)
            for line in runtimes:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)

            def recovered() -> dict[str, Any] | None:
                view = sb.refresh().data
                return view if view["state"] == "running" and view["recovered_at"] else None

            view = c.wait_for(recovered, timeout=120, interval=0.2, what="recovered after the crash")
            assert view is not None and view["recovered_from"] == snap.id and view["crash_count"] >= 1
            assert view["notice"] and "same node" in str(view["notice"])
            assert sb.files.read("/work/state.txt") == b"checkpointed"
            at = counter(sb)
            c.wait_for(lambda: counter(sb) > at, timeout=20, what="the checkpointed counter running again")
        finally:
            sb.delete()
