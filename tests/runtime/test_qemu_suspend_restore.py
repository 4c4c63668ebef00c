"""A microVM suspended to object storage and restored from it (ADR 0081), real: the session node's root
helper, QEMU under TCG, the S3-protocol server on loopback, an encrypted artifact.

One qemu node (two under TCG would double the slowest part, the template's cold boot): the sandbox is
suspended, deleted on the node, and restored on the same node from the artifact alone. A file on its disk,
a value in /dev/shm and a Python process's in-memory secret and counter survive. Tampered artifacts (a
flipped stored byte, a truncated memory image, a memory image of the right size without QEMU's header,
an extra entry) are refused with typed errors and leave nothing on the node; an agent of another
isolation refuses the artifact from its runtime descriptor before downloading anything.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import tempfile
import time

import pytest

from space.core import errors, ids
from space.crypto.envelope import DataKey
from space.node.agent import transfer
from space.node.agent.agent import NodeAgent
from space.node.agent.guest import GuestSession
from space.node.agent.helper_client import HelperClient
from space.node.drivers.base import SandboxSpec
from space.node.drivers.fake import FakeDriver
from space.node.drivers.qemu import QemuDriver
from space.objectstore.artifacts import read_manifest
from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore
from tests.support.realnode import RealNode
from tests.support.s3server import S3Server
from tests.support.sandboxes import delete_quietly, eventually

pytestmark = pytest.mark.root

TEMPLATE = "python"
SECRET_PROCESS = (
    "import os, time\n"
    "secret = os.urandom(8).hex()\n"  # only ever in this process's memory (and the beat it writes)
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    with open('/dev/shm/beat.tmp', 'w') as f: f.write(f'{secret} {i}')\n"
    "    os.replace('/dev/shm/beat.tmp', '/dev/shm/beat')\n"
    "    time.sleep(0.1)\n"
)


async def beat(session: GuestSession) -> tuple[str, int]:
    secret, count = (await session.read_file("/dev/shm/beat")).decode().split()
    return secret, int(count)


def left_on_node(layout_fs: pathlib.Path, staging: pathlib.Path, sandbox_id: str) -> list[str]:
    """Whatever of `sandbox_id` the microVM layout and the staging directory still hold."""
    found = [
        str(p)
        for p in (
            layout_fs / "microvm" / "sandboxes" / sandbox_id,
            layout_fs / "microvm" / "checkpoints" / sandbox_id,
        )
        if p.exists()
    ]
    if staging.is_dir():
        found += [str(p) for p in staging.iterdir() if sandbox_id in p.name]
    return found


def tampered_copy(objects: ObjectStore, prefix: str, key: bytes, target: str, change: str) -> None:
    """A consistent artifact (its manifest matches its parts) whose content is wrong: downloaded with the
    right key, changed, uploaded again under `target` (what a writer of the bucket could do)."""
    manifest = read_manifest(objects, prefix)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        transfer.download(objects, manifest, root, data_key=key, skip={"sandbox.json"})
        memory = root / "image" / "memory"
        if change == "truncated":
            with memory.open("r+b") as f:
                f.truncate(memory.stat().st_size // 2)
        elif change == "header":
            with memory.open("r+b") as f:
                f.write(b"XEVM")
        elif change == "extra":
            (root / "image" / "extra").write_bytes(b"not part of a checkpoint")
        files = {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
        data_key = DataKey(key_id="test-key", wrapped=b"wrapped", plaintext=key)
        transfer.upload(objects, target, root, files, data_key=data_key, metadata=dict(manifest.metadata))


def test_a_microvm_survives_suspend_to_s3_and_restore_from_it(
    node: RealNode, s3_server: S3Server, tmp_path: pathlib.Path
) -> None:
    layout = node.node.layout
    objects = open_store(s3_server.bucket_url("space-node-tests", f"microvm-{os.getpid()}"))
    key = DataKey(key_id="test-key", wrapped=b"wrapped", plaintext=os.urandom(32))

    async def scenario() -> None:
        agent = NodeAgent(QemuDriver(layout, HelperClient(str(layout.helper_socket))))
        sid = ""
        try:
            await agent.driver.ensure_template(TEMPLATE)
            handle = await agent.create(TEMPLATE)
            sid = handle.sandbox_id
            session = handle.session
            payload = os.urandom(1 << 20)
            await session.write_file("/root/kept.bin", payload)
            await session.write_file("/dev/shm/value", b"in-guest-memory")
            await session.start_background(["python3", "-c", SECRET_PROCESS], tag="secret")
            await eventually(lambda: _beats(session, 3), what="the secret process beating", timeout=60)
            secret, before = await beat(session)

            prefix, snap = f"sandboxes/{sid}/suspend", ids.new_snapshot_id()
            result = await agent.suspend(sid, store=objects, prefix=prefix, snapshot_id=snap, data_key=key)
            assert result["stored_bytes"] > 0
            manifest = read_manifest(objects, prefix)
            assert manifest.encrypted
            assert manifest.metadata["runtime"]["driver"] == "qemu"  # placement and check_restore read it
            assert manifest.metadata["microvm"]["accel"] in {"kvm", "tcg"}
            assert set(manifest.entries) == {
                "image/memory",
                "image/disk.img",
                "image/meta.json",
                "sandbox.json",
            }
            print(f"\nmicroVM artifact: memory {manifest.entries['image/memory'].size} B, disk "
                  f"{manifest.entries['image/disk.img'].size} B, stored {manifest.total_stored_bytes} B, "
                  f"timings {result['timings']}")  # fmt: skip
            await agent.delete(sid)
            assert left_on_node(layout.fs, layout.staging, sid) == []
            spec = SandboxSpec(sid, TEMPLATE)

            # Another isolation's agent refuses it from the artifact's runtime descriptor, fetching no part.
            other = NodeAgent(FakeDriver(tmp_path / "fake"))
            try:
                with pytest.raises(errors.RuntimeIncompatible):
                    await other.restore_from_store(sid, store=objects, prefix=prefix, data_key=key.plaintext,
                                                   spec=spec)  # fmt: skip
            finally:
                await other.close()

            # Tampered artifacts: typed refusals, nothing left behind.
            stored = manifest.entries["image/memory"].parts[0].key
            original = objects.get(stored)
            objects.put(stored, original[:100] + bytes([original[100] ^ 1]) + original[101:])
            with pytest.raises(errors.ArtifactCorrupt):
                await agent.restore_from_store(sid, store=objects, prefix=prefix, data_key=key.plaintext,
                                               spec=spec)  # fmt: skip
            assert left_on_node(layout.fs, layout.staging, sid) == [] and sid not in agent.sandboxes
            objects.put(stored, original)
            for change in ("truncated", "header", "extra"):
                bad = f"sandboxes/{sid}/{change}"
                await asyncio.to_thread(tampered_copy, objects, prefix, key.plaintext, bad, change)
                with pytest.raises(errors.ArtifactCorrupt) as caught:
                    await agent.restore_from_store(sid, store=objects, prefix=bad, data_key=key.plaintext,
                                                   spec=spec)  # fmt: skip
                assert caught.value.details.get("part") == "image", (change, caught.value)
                assert left_on_node(layout.fs, layout.staging, sid) == [], change
                assert sid not in agent.sandboxes

            started = time.monotonic()
            restored = await agent.restore_from_store(
                sid, store=objects, prefix=prefix, data_key=key.plaintext, spec=spec
            )
            print(f"microVM restore from the artifact: {time.monotonic() - started:.2f}s")
            session = restored.session
            assert await session.read_file("/root/kept.bin") == payload
            assert await session.read_file("/dev/shm/value") == b"in-guest-memory"
            again, after = await beat(session)
            assert again == secret and after >= before, (secret, before, again, after)
            await eventually(lambda: _beats(session, after + 3), what="the process running on", timeout=30)
        finally:
            if sid:
                await delete_quietly(agent, sid)
            await agent.close()
        assert left_on_node(layout.fs, layout.staging, sid) == []

    node.run(scenario(), timeout=900)


async def _beats(session: GuestSession, at_least: int) -> bool:
    try:
        return (await beat(session))[1] >= at_least
    except (errors.NotFound, ValueError):
        return False
