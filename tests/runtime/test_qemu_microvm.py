"""Real QEMU microVMs (under TCG on machines without hardware KVM): one template checkpoint per module,
made by a cold boot of the node's `python` template; every sandbox is created by restoring it over a
reflinked disk, and talks to the node over its virtio serial port."""

from __future__ import annotations

import asyncio
import os
import pathlib
from collections.abc import Iterator

import pytest

from space.core import errors, ids
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.helper.microvm import CGROUP_NAME, CGROUP_V1, Machine, MicroVMs, sandbox_uid
from space.node.volumes.templates import guest_environment

pytestmark = pytest.mark.root

TEMPLATE = "python"
SB_A, SB_B, SB_C, SB_D = (ids.new_sandbox_id() for _ in range(4))
BOOT_TIMEOUT_S = 300.0


async def connect(socket_path: str, name: str, timeout: float = 60.0) -> GuestChannel:
    return await GuestChannel.connect_unix(socket_path, timeout=timeout, name=name)


@pytest.fixture(scope="module")
def microvms(node) -> Iterator[MicroVMs]:  # type: ignore[no-untyped-def]
    vms = MicroVMs(node.node.layout, os.geteuid())
    layout = node.node.layout
    vms.build_template_disk(
        TEMPLATE, layout.template(TEMPLATE), guest_environment(layout.templates, TEMPLATE)
    )

    async def boot() -> None:
        channel = await connect(vms.boot_template(TEMPLATE, Machine()), "template", BOOT_TIMEOUT_S)
        await channel.close()

    node.run(boot(), timeout=BOOT_TIMEOUT_S + 30)
    vms.adopt_template(TEMPLATE, Machine())
    made: list[str] = []
    vms.made = made  # type: ignore[attr-defined]
    try:
        yield vms
    finally:
        for sandbox_id in made:
            vms.destroy(sandbox_id)


def test_create_from_checkpoint_exec_files_pause_and_a_real_kernel(node, microvms: MicroVMs) -> None:  # type: ignore[no-untyped-def]
    microvms.made.append(SB_A)  # type: ignore[attr-defined]

    async def scenario() -> None:
        channel = await connect(microvms.create(SB_A, TEMPLATE), "a")
        session = GuestSession(channel)
        result = await session.exec("uname -r; cat /proc/1/cmdline | tr '\\0' ' '; echo; id -u")
        release, init, uid = result.stdout.decode().splitlines()
        assert (
            release.endswith("-amd64") and release != pathlib.Path("/proc/sys/kernel/osrelease").read_text()
        )
        assert init.startswith("/usr/bin/python3 -I -S -B")  # spaced is the guest's PID 1
        assert uid == "0"
        assert (await session.exec(["true"])).exit_code == 0
        await session.write_file("/root/note", b"kept")
        assert await session.read_file("/root/note") == b"kept"
        microvms.pause(SB_A)
        assert microvms.status(SB_A) == "paused"
        microvms.resume(SB_A)
        assert microvms.status(SB_A) == "running"
        assert (await session.exec("cat /root/note")).stdout == b"kept"
        await channel.close()

    node.run(scenario())
    # The QEMU runs as the sandbox's own uid, in cgroups of its own, and not in the host's network namespace.
    info = microvms._holder_info(SB_A)
    assert info is not None
    pid = int(info["runtime_pid"])
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    assert f"Uid:\t{sandbox_uid(SB_A)}\t" in status
    assert os.readlink(f"/proc/{pid}/root") == str(microvms.sandbox_dir(SB_A))
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    if (CGROUP_V1 / "memory").is_dir():
        procs = (CGROUP_V1 / "memory" / CGROUP_NAME / SB_A / "cgroup.procs").read_text().split()
        assert str(pid) in procs
    microvms.destroy(SB_A)
    assert microvms.status(SB_A) == "absent"
    assert not microvms.sandbox_dir(SB_A).exists()
    microvms.destroy(SB_A)  # converges


def test_checkpoint_rollback_and_fork(node, microvms: MicroVMs) -> None:  # type: ignore[no-untyped-def]
    microvms.made.extend([SB_B, SB_C])  # type: ignore[attr-defined]

    async def scenario() -> None:
        channel = await connect(microvms.create(SB_B, TEMPLATE), "b")
        session = GuestSession(channel)
        await session.exec("echo before > /root/state; echo 1 > /dev/shm/memory-only")
        info = microvms.checkpoint(SB_B, "cp-1")
        assert info["image_bytes"] > 0
        await session.exec("echo after > /root/state; rm /dev/shm/memory-only")
        await channel.close()

        # rollback: both the disk and the memory (a tmpfs file) are back as at the checkpoint
        channel = await connect(microvms.restore(SB_B, "cp-1"), "b")
        session = GuestSession(channel)
        result = await session.exec("cat /root/state /dev/shm/memory-only")
        assert result.stdout == b"before\n1\n"
        await session.exec("echo parent > /root/state")

        # fork: another sandbox from the same memory image, on its own reflinked disk
        child_channel = await connect(microvms.restore(SB_C, "cp-1", source_sandbox_id=SB_B), "c")
        child = GuestSession(child_channel)
        assert (await child.exec("cat /root/state")).stdout == b"before\n"
        await child.exec("echo child > /root/state")
        assert (await session.exec("cat /root/state")).stdout == b"parent\n"
        assert (await child.exec("cat /root/state")).stdout == b"child\n"
        await asyncio.gather(channel.close(), child_channel.close())

    node.run(scenario())
    with pytest.raises(errors.NotFound):
        microvms.restore(SB_B, "cp-missing")
    with pytest.raises(errors.NotFound):
        microvms.create(SB_D, "no-such-template")


def test_qemu_driver_through_the_helper_verbs(node, microvms: MicroVMs) -> None:  # type: ignore[no-untyped-def]
    """The agent-side driver: every step is a `microvm.*` verb of the node's real root helper."""
    from space.node.agent.helper_client import HelperClient
    from space.node.drivers.base import SandboxSpec
    from space.node.drivers.qemu import QemuDriver

    sandbox_id, snapshot_id = ids.new_sandbox_id(), ids.new_snapshot_id()
    microvms.made.append(sandbox_id)  # type: ignore[attr-defined]
    layout = node.node.layout

    async def scenario() -> None:
        driver = QemuDriver(layout, HelperClient(str(layout.helper_socket)))
        try:
            described = await driver.ensure_template(TEMPLATE)  # the module's checkpoint is already there
            assert described["microvm"]["accel"] == microvms.accel
            channel = await driver.create_warm(SandboxSpec(sandbox_id, TEMPLATE, env={"OWN": "mine"}))
            assert channel is not None
            session = GuestSession(channel)
            await session.reseed()  # as NodeAgent does after every warm start
            await session.configure({"OWN": "mine"})
            assert (await session.exec("echo $OWN")).stdout == b"mine\n"
            assert (await driver.state(sandbox_id)).runtime == "running"
            await driver.pause(sandbox_id)
            assert (await driver.state(sandbox_id)).runtime == "paused"
            with pytest.raises(errors.InvalidState):
                await driver.pause("sb-" + "a" * 25 + "a")  # no such microVM
            await driver.resume(sandbox_id)
            info, replaced = await driver.checkpoint(sandbox_id, snapshot_id)
            assert replaced is None and info.image_bytes > 0
            assert (await session.exec(["true"])).exit_code == 0
            await channel.close()
            channel = await driver.restore(sandbox_id, snapshot_id)
            assert (await GuestSession(channel).exec("echo $OWN")).stdout == b"mine\n"
            await channel.close()
            await driver.destroy(sandbox_id)
            state = await driver.state(sandbox_id)
            assert (state.exists, state.runtime) == (False, "absent")
        finally:
            await driver.close()

    node.run(scenario())


def test_node_agent_runs_microvm_sandboxes_with_the_qemu_driver(node, microvms: MicroVMs) -> None:  # type: ignore[no-untyped-def]
    """A node configured with the qemu driver: the unchanged NodeAgent creates (a warm start: restore,
    reseed, env), runs, pauses, resumes, checkpoints and deletes microVM sandboxes."""
    from space.node.agent.agent import NodeAgent
    from space.node.agent.helper_client import HelperClient
    from space.node.drivers.qemu import QemuDriver

    layout = node.node.layout

    async def scenario() -> None:
        agent = NodeAgent(QemuDriver(layout, HelperClient(str(layout.helper_socket))))
        try:
            handle = await agent.create("python", env={"WHO": "agent"})
            microvms.made.append(handle.sandbox_id)  # type: ignore[attr-defined]
            assert handle.created_from == "warm"
            result = await handle.session.exec("echo $WHO; uname -r")
            assert result.stdout.decode().startswith("agent\n") and result.stdout.decode().strip().endswith(
                "-amd64"
            )
            await agent.pause(handle.sandbox_id)
            await agent.resume(handle.sandbox_id)
            assert (await handle.session.exec("echo kept > /root/file")).exit_code == 0
            # a restarted agent adopts the running microVM (driver.list + connect)
            adopter = NodeAgent(QemuDriver(layout, HelperClient(str(layout.helper_socket))))
            try:
                assert handle.sandbox_id in await adopter.recover()
                adopted = adopter.sandboxes[handle.sandbox_id]
                assert (await adopted.session.exec("cat /root/file")).stdout == b"kept\n"
            finally:
                await adopter.close()
            # stop ends the VM and keeps its disk; start boots it cold from that disk
            await agent.stop(handle.sandbox_id)
            assert (await agent.driver.state(handle.sandbox_id)).runtime == "stopped"
            await agent.start(handle.sandbox_id)
            assert (await handle.session.exec("cat /root/file")).stdout == b"kept\n"
            # the agent's checkpoint, rollback and fork (one memory image, reflinked disks)
            record = await agent.checkpoint(handle.sandbox_id)
            await handle.session.exec("echo changed > /root/file")
            await agent.rollback(handle.sandbox_id, record.snapshot_id)
            assert (await handle.session.exec("cat /root/file")).stdout == b"kept\n"
            children = await agent.fork(handle.sandbox_id, snapshot_id=record.snapshot_id, count=2)
            for child in children:
                microvms.made.append(child.sandbox_id)  # type: ignore[attr-defined]
            drawn = [
                (await child.session.exec("head -c 16 /dev/urandom | od -An -tx1")).stdout
                for child in children
            ]
            assert drawn[0] != drawn[1]  # the agent reseeded each child (RNDRESEEDCRNG in the guest)
            assert (await children[0].session.exec("cat /root/file")).stdout == b"kept\n"
            for child in children:
                await agent.delete(child.sandbox_id)
            await agent.delete(handle.sandbox_id)
            assert not microvms.sandbox_dir(handle.sandbox_id).exists()
        finally:
            await agent.close()

    node.run(scenario())


def test_node_teardown_ends_microvms_the_agent_left_running(loop) -> None:  # type: ignore[no-untyped-def]
    """`space down --purge` (node.teardown) ends every QEMU of the node, also one no agent deleted."""
    from space.node.agent.helper_client import HelperClient
    from space.node.drivers.base import SandboxSpec
    from space.node.drivers.qemu import QemuDriver
    from space.node.local import LocalNode
    from tests.support.realnode import make_data_dir

    local = LocalNode(make_data_dir("qemu-teardown"), network="none")
    loop.run(local.start(progress=lambda _line: None), timeout=900)
    driver = QemuDriver(local.layout, HelperClient(str(local.layout.helper_socket)))
    try:
        loop.run(driver.ensure_template(TEMPLATE), timeout=900)
        channel = loop.run(driver.create_warm(SandboxSpec(ids.new_sandbox_id(), TEMPLATE)))
        assert channel is not None
        loop.run(channel.close())
    finally:
        loop.run(driver.close())
        loop.run(local.stop(purge=True), timeout=300)
    left = [p for p in pathlib.Path("/proc").glob("[0-9]*/cmdline") if _names(p, str(local.layout.data_dir))]
    assert left == []
    assert not local.layout.data_dir.exists() or not any(local.layout.fs.iterdir())


def _names(cmdline: pathlib.Path, text: str) -> bool:
    try:
        return text.encode() in cmdline.read_bytes()
    except OSError:
        return False


def test_a_damaged_memory_image_leaves_no_qemu_behind(node, microvms: MicroVMs) -> None:  # type: ignore[no-untyped-def]
    sandbox_id = ids.new_sandbox_id()
    microvms.made.append(sandbox_id)  # type: ignore[attr-defined]

    async def scenario() -> None:
        channel = await connect(microvms.create(sandbox_id, TEMPLATE), "damaged")
        await channel.close()

    node.run(scenario())
    microvms.checkpoint(sandbox_id, "cp-damaged")
    image = microvms.checkpoint_dir(sandbox_id, "cp-damaged") / "memory"
    with image.open("r+b") as damaged:
        damaged.truncate(image.stat().st_size // 3)
    with pytest.raises(errors.SpaceError):
        microvms.restore(sandbox_id, "cp-damaged")
    assert microvms.status(sandbox_id) == "absent"
    microvms.destroy(sandbox_id)
