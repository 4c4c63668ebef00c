"""Suspend on one node, restore on another: two real nodes (own data dirs, btrfs images, helpers, runsc
roots, cgroups) on this machine, sharing one object store in a local directory.

What is checked, for real (runsc, btrfs send/receive, the artifact format):
- every file's SHA-256 survives the move, a background counter continues from where it stopped, and two
  restores of one artifact read different bytes from /dev/urandom;
- a flipped bit or a truncated part is detected before anything boots, and a suspend without a manifest is
  never restored;
- SIGKILL of the node agent in the middle of a suspend and of a restore, then a new agent repeating the step,
  converges: one runtime, no orphaned subvolumes, no staging leftovers;
- node B got the template base from the object store (its own rootfs cache stays empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core import errors
from space.core.ids import new_snapshot_id
from space.core.lifecycle import State
from space.crypto.envelope import DataKey
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.service import NodeService
from space.node.drivers.base import SandboxSpec
from space.node.local import LocalNode
from space.objectstore.artifacts import read_manifest, verify
from space.objectstore.backends import open_store
from tests.support.host import cgroups_under
from tests.support.loop import BackgroundLoop
from tests.support.nodes import AgentProcess, NodeOnMachine, StoreDir
from tests.support.realnode import assert_no_leaks, require_root, sandbox_ids_in
from tests.support.s3server import S3Server
from tests.support.sandboxes import COUNTER, delete_quietly, eventually, read_int, start_counter

pytestmark = pytest.mark.root

MiB = 1 << 20
# Varied files: sizes from bytes to megabytes, random and repetitive content, nested directories.
FILES = {
    "/work/tiny.txt": b"hello\n",
    "/work/empty": b"",
    "/work/text/lines.txt": b"".join(b"line %d\n" % i for i in range(20000)),
    "/work/bin/random-1m": os.urandom(MiB),
    "/work/bin/random-3m": os.urandom(3 * MiB),
    "/work/bin/zeros-512k": bytes(512 * 1024),
    "/work/deep/a/b/c/d.json": b'{"k": "v"}' * 1000,
}
HASH_ALL = "cd /work && find . -type f -print0 | sort -z | xargs -0 sha256sum"


@pytest.fixture(scope="module")
def store() -> Iterator[StoreDir]:
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-test-store-", dir="/var/tmp"))
    yield StoreDir(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes(loop: BackgroundLoop, store: StoreDir) -> Iterator[tuple[NodeOnMachine, NodeOnMachine]]:
    """Node A (base from the machine's rootfs cache, publishes it to the store) and node B (an empty rootfs
    cache: its base can only come from the store)."""
    require_root()
    made: list[NodeOnMachine] = []
    empty_cache = pathlib.Path(tempfile.mkdtemp(prefix="space-test-emptycache-", dir="/var/tmp"))
    try:
        for name, cache in (("a", None), ("b", empty_cache)):
            data_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"space-test-node{name}-", dir="/var/tmp"))
            local = LocalNode(
                data_dir, store_url=store.url, cgroup_parent=f"space-t{name}", rootfs_cache=cache
            )
            try:
                agent = loop.run(local.start(progress=lambda line: None), timeout=900)
            except BaseException:
                loop.run(local.stop(purge=True), timeout=300)
                raise
            made.append(NodeOnMachine(name, local, agent))
        assert list(empty_cache.iterdir()) == [], "node B wrote a rootfs cache: it did not use the store"
        yield made[0], made[1]
    finally:
        problems: list[BaseException] = []
        for item in made:  # every node is torn down even if an earlier one fails its leak check
            try:
                _teardown(loop, item)
            except BaseException as exc:
                problems.append(exc)
        shutil.rmtree(empty_cache, ignore_errors=True)
        if problems:
            raise problems[0]


def _teardown(loop: BackgroundLoop, item: NodeOnMachine) -> None:
    data_dir = item.layout.data_dir
    ids = sandbox_ids_in(data_dir) | set(item.agent.sandboxes)
    try:
        loop.run(item.agent.delete_all(), timeout=300)
    finally:
        loop.run(item.node.stop(purge=True), timeout=300)
    assert_no_leaks(data_dir, ids)
    assert [g for g in cgroups_under(item.node.cgroup_parent) if "sb-" in g] == []
    for parent in pathlib.Path("/sys/fs/cgroup").glob(f"*/{item.node.cgroup_parent}"):
        for attempt in range(50):  # the node's own (now empty) cgroup parent; the kernel may lag a moment
            try:
                parent.rmdir()
                break
            except FileNotFoundError:
                break  # the same hierarchy under another name (cpu and cpuacct are one directory)
            except OSError:
                if attempt == 49:
                    raise
                time.sleep(0.1)


def _hashes(files: dict[str, bytes]) -> dict[str, str]:
    return {f"./{p.removeprefix('/work/')}": hashlib.sha256(d).hexdigest() for p, d in files.items()}


async def _guest_hashes(handle: SandboxHandle) -> dict[str, str]:
    result = await handle.session.exec(HASH_ALL)
    assert result.exit_code == 0, result.stderr
    pairs = (line.split(maxsplit=1) for line in result.stdout.decode().splitlines())
    return {name: digest for digest, name in pairs if not name.startswith("./counter")}


async def _urandom(handle: SandboxHandle) -> bytes:
    result = await handle.session.exec("head -c 32 /dev/urandom | od -An -tx1")
    assert result.exit_code == 0
    return result.stdout


async def _prepared_sandbox(agent: NodeAgent, *, counter: bool = True) -> SandboxHandle:
    # A warm start (the default): its root filesystem is a snapshot of the template's warm disk, not of the
    # template, and its delta against the base must still apply on the other node.
    assert agent.driver.warm_supported and await agent.driver.warm_ready("python")
    handle = await agent.create("python")
    for path, data in FILES.items():
        await handle.session.write_file(path, data)
    if counter:
        await start_counter(handle.session)
    return handle


def _spec(handle: SandboxHandle) -> SandboxSpec:
    return SandboxSpec(handle.sandbox_id, handle.spec.template, handle.spec.limits, dict(handle.spec.env))


def test_suspend_on_a_restore_on_b(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine], store: StoreDir
) -> None:
    a, b = nodes
    objects = store.open()

    async def scenario() -> None:
        source = await _prepared_sandbox(a.agent)
        sid = source.sandbox_id
        try:
            await asyncio.sleep(1.0)
            expected = _hashes(FILES)
            assert await _guest_hashes(source) == expected
            before = await read_int(source.session, "/work/counter")
            prefix = f"sandboxes/{sid}/suspend-1"
            snap = new_snapshot_id()
            started = time.monotonic()
            result = await a.agent.suspend(sid, store=objects, prefix=prefix, snapshot_id=snap, data_key=None)
            suspend_s = time.monotonic() - started
            assert source.state == State.SUSPENDED
            assert (await a.agent.driver.state(sid)).runtime == "paused", "the source is kept, paused"
            manifest = read_manifest(objects, prefix)
            meta = manifest.metadata
            # The delta is the guest layer + what the sandbox wrote, never the template.
            written = sum(len(d) for d in FILES.values())
            assert written <= meta["disk_stream_bytes"] <= written + 8 * MiB, meta
            assert result["stored_bytes"] == manifest.total_stored_bytes
            # A repeat is the same result, not a second upload.
            again = await a.agent.suspend(sid, store=objects, prefix=prefix, snapshot_id=snap, data_key=None)
            assert again["stored_bytes"] == result["stored_bytes"]

            started = time.monotonic()
            restored = await b.agent.restore_from_store(
                sid, store=objects, prefix=prefix, data_key=None, spec=_spec(source)
            )
            first = await read_int(restored.session, "/work/counter")
            restore_s = time.monotonic() - started
            delta_mib, stored_mib = meta["disk_stream_bytes"] / MiB, result["stored_bytes"] / MiB
            print(f"suspend {suspend_s * 1000:.0f} ms, restore to first answer {restore_s * 1000:.0f} ms, "
                  f"delta {delta_mib:.1f} MiB, stored {stored_mib:.1f} MiB")  # fmt: skip
            assert restored.state == State.RUNNING
            assert before <= first <= before + 5, f"counter restarted or jumped: {before} -> {first}"
            await eventually(
                lambda: _above(restored, first + 5), what="the counter counts on node B", timeout=15
            )
            assert await _guest_hashes(restored) == expected
            # The source is deleted only now (the caller verified); the copy on B is independent of it.
            await a.agent.delete(sid)
            assert a.subvolumes_of(sid) == []
            # A second restore of the same artifact (on A) is its own copy: different kernel randomness.
            again_on_a = await a.agent.restore_from_store(
                sid, store=objects, prefix=prefix, data_key=None, spec=_spec(source)
            )
            assert await _urandom(again_on_a) != await _urandom(restored)
            assert await _guest_hashes(again_on_a) == expected
            assert b.staging_entries() == [] and a.staging_entries() == []
            assert [p.rsplit("/", 1)[-1] for p in b.subvolumes_of(sid)] == sorted(["rootfs", snap])

            # And back: the copy on B (whose disk was received) suspends and restores on A again.
            await a.agent.delete(sid)
            await restored.session.write_file("/work/written-on-b", b"from node b")
            back = f"sandboxes/{sid}/suspend-2"
            on_b = await read_int(restored.session, "/work/counter")
            await b.agent.suspend(
                sid, store=objects, prefix=back, snapshot_id=new_snapshot_id(), data_key=None
            )
            await b.agent.delete(sid)
            home = await a.agent.restore_from_store(
                sid, store=objects, prefix=back, data_key=None, spec=_spec(source)
            )
            assert await home.session.read_file("/work/written-on-b") == b"from node b"
            assert await read_int(home.session, "/work/counter") >= on_b
            assert await _guest_hashes(home) == {
                **expected,
                "./written-on-b": hashlib.sha256(b"from node b").hexdigest(),
            }
        finally:
            await delete_quietly(a.agent, sid)
            await delete_quietly(b.agent, sid)
        assert a.subvolumes_of(sid) == [] and b.subvolumes_of(sid) == []

    loop.run(scenario(), timeout=240)


async def _above(handle: SandboxHandle, value: int) -> bool:
    return await read_int(handle.session, "/work/counter") >= value


def _flip_bit(path: pathlib.Path) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return original


def test_corrupt_or_incomplete_artifacts_never_boot(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine], store: StoreDir
) -> None:
    a, b = nodes
    objects = store.open()

    async def scenario() -> None:
        source = await a.agent.create("python")
        sid = source.sandbox_id
        try:
            await source.session.write_file("/work/data", os.urandom(2 * MiB))
            prefix = f"sandboxes/{sid}/suspend-1"
            await a.agent.suspend(
                sid, store=objects, prefix=prefix, snapshot_id=new_snapshot_id(), data_key=None
            )
            parts = [p for p in store.files(prefix) if "/parts/" in str(p)]
            assert parts, "the artifact has parts"
            victim = max(parts, key=lambda p: p.stat().st_size)

            async def refused(kind: type[errors.SpaceError]) -> errors.SpaceError:
                with pytest.raises(kind) as caught:
                    await b.agent.restore_from_store(
                        sid, store=objects, prefix=prefix, data_key=None, spec=_spec(source)
                    )
                assert sid not in b.agent.sandboxes
                assert b.subvolumes_of(sid) == [], "a refused restore left subvolumes"
                assert not b.layout.bundle(sid).exists() and b.staging_entries() == []
                assert b.containers(sid) == [], "a refused restore started a runtime"
                return caught.value

            original = _flip_bit(victim)
            corrupt = await refused(errors.ArtifactCorrupt)
            assert corrupt.details.get("reason") in {"checksum_mismatch", "decompression_failed"}
            victim.write_bytes(original[: len(original) // 2])
            truncated = await refused(errors.ArtifactCorrupt)
            assert truncated.details.get("reason") == "truncated"
            victim.write_bytes(original)
            verify(objects, read_manifest(objects, prefix))  # intact again: the refusals were the parts

            (store.root / prefix / "manifest.json").unlink()  # an upload that never finished
            missing = await refused(errors.NotFound)
            assert "restorable" in missing.message
        finally:
            await delete_quietly(a.agent, sid)

    loop.run(scenario(), timeout=180)


def _post_in_thread(call: Any) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the agent was killed under the request: the point
            call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(check: Any, timeout: float, what: str, interval: float = 0.001) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout}s: {what}")
        time.sleep(interval)


# Where the agent is SIGKILLed: (during suspend, during restore). Each is recognised on disk, so the kill
# lands inside the step, not before or after it (asserted).
KILL_POINTS = [("checkpoint", "import"), ("upload", "download")]


@pytest.mark.parametrize(("suspend_kill", "restore_kill"), KILL_POINTS)
def test_agent_killed_mid_suspend_and_mid_restore_converges(
    loop: BackgroundLoop,
    nodes: tuple[NodeOnMachine, NodeOnMachine],
    store: StoreDir,
    tmp_path: pathlib.Path,
    suspend_kill: str,
    restore_kill: str,
) -> None:
    a, b = nodes
    objects = store.open()
    agent_a = AgentProcess(a.layout, store.url, tmp_path, "agent-a")
    agent_b = AgentProcess(b.layout, store.url, tmp_path, "agent-b")
    sid = ""
    try:
        agent_a.start()
        sid = loop.run(_create_over_rpc(agent_a.client()), timeout=120)
        prefix = f"sandboxes/{sid}/suspend-kill"
        snap = new_snapshot_id()
        body = {"store_url": store.url, "prefix": prefix, "snapshot_id": snap, "data_key": None}
        thread = _post_in_thread(lambda: agent_a.post(f"/sandboxes/{sid}/suspend", body))
        if suspend_kill == "checkpoint":  # runsc is saving the sandbox: the image directory exists
            image = a.layout.checkpoint_image(sid, snap)
            _wait_for(image.exists, 60, "the checkpoint started")
        else:  # parts in the store, no manifest yet
            parts_dir = store.root / prefix / "parts"
            _wait_for(lambda: parts_dir.exists() and any(parts_dir.rglob("*")), 60, "the upload started")
        agent_a.kill()
        thread.join(10)
        assert not (store.root / prefix / "manifest.json").exists(), "the kill came after the upload"

        agent_a = AgentProcess(a.layout, store.url, tmp_path, "agent-a2")
        agent_a.start()
        answer = agent_a.post(f"/sandboxes/{sid}/suspend", body)
        assert answer.status_code == 200, answer.text
        manifest = read_manifest(objects, prefix)
        verify(objects, manifest)
        assert manifest.metadata["snapshot_id"] == snap
        assert len(a.containers(sid)) == 1, "one runtime for the suspended source"
        assert a.staging_entries() == []
        assert [p.rsplit("/", 1)[-1] for p in a.subvolumes_of(sid)] == sorted(["rootfs", snap])
        agent_a.stop()

        agent_b.start()
        restore_body = {"sandbox_id": sid, "store_url": store.url, "prefix": prefix, "template": "python"}
        thread = _post_in_thread(lambda: agent_b.post("/sandboxes/restore", restore_body))
        if restore_kill == "download":  # entries arriving in the staging directory
            import_dir = b.layout.import_dir(sid, snap)
            _wait_for(lambda: import_dir.exists() and any(import_dir.rglob("*")), 60, "the download started")
        else:  # the helper is receiving the disk delta (in staging beside its destination, ADR 0023)
            disk = b.layout.snapshot(sid, snap)
            staged = lambda: disk.parent.is_dir() and any(disk.parent.glob(".receive-*"))  # noqa: E731
            _wait_for(lambda: disk.exists() or staged(), 60, "the import started")
        agent_b.kill()
        thread.join(10)

        agent_b = AgentProcess(b.layout, store.url, tmp_path, "agent-b2")
        agent_b.start()
        answer = agent_b.post("/sandboxes/restore", restore_body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["state"] == "running"
        repeat = agent_b.post("/sandboxes/restore", restore_body)
        assert repeat.status_code == 200 and repeat.json()["state"] == "running", "restore is idempotent"
        assert len(b.containers(sid)) == 1, "exactly one runtime after the repeated restore"
        assert b.staging_entries() == []
        assert [p.rsplit("/", 1)[-1] for p in b.subvolumes_of(sid)] == sorted(["rootfs", snap])
        # The counter rewrites its file (truncate, then write): one read may land in between, so the
        # claim is that a positive count shows up, not that the first read sees one.
        deadline = time.monotonic() + 15
        counter = loop.run(_counter_over_rpc(agent_b, sid), timeout=60)
        while counter <= 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            counter = loop.run(_counter_over_rpc(agent_b, sid), timeout=60)
        assert counter > 0, "the counter started on node A runs on node B"
    finally:
        for proc, node in ((agent_a, a), (agent_b, b)):
            proc.stop()
            if sid:
                loop.run(_forget(node.agent, sid), timeout=120)
    assert a.subvolumes_of(sid) == [] and b.subvolumes_of(sid) == []


async def _create_over_rpc(client: Any) -> str:
    from space.core.ids import new_sandbox_id

    sid = new_sandbox_id()
    async with client:
        await client.create_sandbox(sid)
        await client.write_file(sid, "/work/big", os.urandom(24 * MiB))
        await client.start_process(sid, COUNTER.format(path="/work/counter"), tag="counter")
    return sid


async def _counter_over_rpc(agent: AgentProcess, sid: str) -> int:
    async with agent.client() as client:
        text = await client.read_file(sid, "/work/counter")
    return int(text.decode().strip() or 0)


async def _forget(agent: NodeAgent, sid: str) -> None:
    """Delete what the killed/stopped agent processes left for `sid` through the node's own agent."""
    await agent.recover()
    await delete_quietly(agent, sid)
    await agent.driver.destroy(sid)


def test_node_b_took_the_template_base_from_the_store(
    nodes: tuple[NodeOnMachine, NodeOnMachine], store: StoreDir, loop: BackgroundLoop
) -> None:
    a, b = nodes
    status_a = loop.run(a.agent.driver.template_base_status())
    status_b = loop.run(b.agent.driver.template_base_status())
    assert status_a is not None and status_b is not None
    assert status_b["source"] == "objectstore"
    assert status_a["identity"] == status_b["identity"], "both nodes hold the same base"
    assert not status_b["publishable"], "B holds no original stream of the base"
    manifest = read_manifest(store.open(), f"templates/{status_a['name']}/{status_a['version']}")
    assert manifest.metadata["base_identity"] == status_a["identity"]


def test_snapshot_listing_reports_exclusive_bytes(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine]
) -> None:
    a, _b = nodes
    service = NodeService(a.agent)

    async def scenario() -> None:
        handle = await a.agent.create("python")
        sid = handle.sandbox_id
        try:
            await handle.session.write_file("/work/ten", os.urandom(10 * MiB))
            first = await a.agent.disk_snapshot(sid)
            second = await a.agent.disk_snapshot(sid)  # nothing written in between
            listed = {s.snapshot_id: s for s in (await service.snapshots(sid)).snapshots}
            one, two = listed[first.snapshot_id].exclusive_bytes, listed[second.snapshot_id].exclusive_bytes
            assert one is not None and two is not None
            assert 10 * MiB <= one <= 11 * MiB, f"{one / MiB:.2f} MiB for 10 MiB written"
            assert two <= MiB, f"{two / MiB:.2f} MiB for nothing written"
        finally:
            await delete_quietly(a.agent, sid)

    loop.run(scenario(), timeout=120)


def test_crashed_runtime_recovers_from_its_newest_checkpoint(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine]
) -> None:
    a, _b = nodes

    async def scenario() -> None:
        handle = await a.agent.create("python")
        sid = handle.sandbox_id
        try:
            await handle.session.write_file("/work/state", b"at the checkpoint")
            await start_counter(handle.session)
            await asyncio.sleep(0.5)
            checkpoint = await a.agent.checkpoint(sid)
            at_checkpoint = await read_int(handle.session, "/work/counter")
            await handle.session.write_file("/work/state", b"after the checkpoint")
            holder = json.loads((a.layout.run_dir(sid) / "holder.json").read_text())
            os.kill(int(holder["runtime_pid"]), signal.SIGKILL)  # the runtime dies under the sandbox
            await eventually(lambda: _is_crashed(handle), what="the agent notices the crash", timeout=20)
            recovered = await a.agent.recover_from_checkpoint(sid)
            assert recovered.state == State.RUNNING
            assert await handle.session.read_file("/work/state") == b"at the checkpoint"
            first = await read_int(handle.session, "/work/counter")
            assert at_checkpoint - 2 <= first <= at_checkpoint + 5, (at_checkpoint, first)
            await eventually(lambda: _above(handle, first + 5), what="counting after recovery", timeout=15)
            assert checkpoint.snapshot_id in handle.snapshots
        finally:
            await delete_quietly(a.agent, sid)

    loop.run(scenario(), timeout=120)


async def _is_crashed(handle: SandboxHandle) -> bool:
    return handle.state == State.CRASHED


def test_suspend_to_s3_encrypted_restore_on_the_other_node(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine], s3_server: S3Server
) -> None:
    """The same move through a real S3-protocol server (moto on loopback), with a per-artifact data key:
    what is stored is ciphertext, and only the right key restores it."""
    a, b = nodes
    objects = open_store(s3_server.bucket_url("space-node-tests", "suspended"))
    key = DataKey(key_id="test-key", wrapped=b"wrapped", plaintext=os.urandom(32))

    async def scenario() -> None:
        source = await _prepared_sandbox(a.agent)
        sid = source.sandbox_id
        try:
            expected = _hashes(FILES)
            before = await read_int(source.session, "/work/counter")
            prefix = f"sandboxes/{sid}/s3"
            snap = new_snapshot_id()
            await a.agent.suspend(sid, store=objects, prefix=prefix, snapshot_id=snap, data_key=key)
            manifest = read_manifest(objects, prefix)
            assert manifest.encrypted
            part = manifest.entries["sandbox.json"].parts[0]
            assert b'"template"' not in objects.get(part.key), "the spec is stored encrypted"
            with pytest.raises(errors.ArtifactCorrupt):
                await b.agent.restore_from_store(
                    sid, store=objects, prefix=prefix, data_key=os.urandom(32), spec=_spec(source)
                )
            assert b.subvolumes_of(sid) == [] and b.staging_entries() == []
            await a.agent.delete(sid)
            restored = await b.agent.restore_from_store(
                sid, store=objects, prefix=prefix, data_key=key.plaintext, spec=_spec(source)
            )
            assert await _guest_hashes(restored) == expected
            assert await read_int(restored.session, "/work/counter") >= before
        finally:
            await delete_quietly(a.agent, sid)
            await delete_quietly(b.agent, sid)

    loop.run(scenario(), timeout=180)


def test_uploaded_checkpoint_of_a_running_sandbox_restores_elsewhere(
    loop: BackgroundLoop, nodes: tuple[NodeOnMachine, NodeOnMachine], store: StoreDir
) -> None:
    """What a lost node's sandbox is restored from: a full checkpoint uploaded while it kept running."""
    a, b = nodes
    objects = store.open()

    async def scenario() -> None:
        source = await _prepared_sandbox(a.agent)
        sid = source.sandbox_id
        try:
            await asyncio.sleep(0.5)
            record = await a.agent.checkpoint(sid)
            at_checkpoint = await read_int(source.session, "/work/counter")
            prefix = f"sandboxes/{sid}/checkpoint-1"
            result = await a.agent.upload_snapshot(
                sid, record.snapshot_id, store=objects, prefix=prefix, data_key=None
            )
            again = await a.agent.upload_snapshot(
                sid, record.snapshot_id, store=objects, prefix=prefix, data_key=None
            )
            assert again["stored_bytes"] == result["stored_bytes"]
            assert source.state == State.RUNNING, "an upload leaves the sandbox running"
            await source.session.write_file("/work/after", b"not in the checkpoint")
            await a.agent.delete(sid)  # the node is "lost"
            restored = await b.agent.restore_from_store(
                sid, store=objects, prefix=prefix, data_key=None, spec=_spec(source)
            )
            assert await _guest_hashes(restored) == _hashes(FILES)
            first = await read_int(restored.session, "/work/counter")
            assert at_checkpoint - 3 <= first <= at_checkpoint + 5, (at_checkpoint, first)
        finally:
            await delete_quietly(a.agent, sid)
            await delete_quietly(b.agent, sid)

    loop.run(scenario(), timeout=120)
