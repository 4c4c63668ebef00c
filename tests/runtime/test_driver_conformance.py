"""The same behaviour from every isolating driver, through the Driver interface and the node's real root
helper: gVisor (`runsc`) and QEMU microVMs (`qemu`, under TCG where the host has no hardware KVM). Each
case runs once per driver; the qemu cases share the module's one template checkpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from space.core import ids
from space.node.agent.guest import GuestSession
from space.node.agent.helper_client import HelperClient
from space.node.drivers.base import Driver, SandboxSpec
from space.node.drivers.qemu import QemuDriver
from space.node.drivers.runsc import RunscDriver

pytestmark = pytest.mark.root

DRIVERS = ("runsc", "qemu")


@pytest.fixture(scope="module")
def drivers(node) -> Iterator[dict[str, Driver]]:  # type: ignore[no-untyped-def]
    layout = node.node.layout
    made = {
        "runsc": RunscDriver(layout, HelperClient(str(layout.helper_socket))),
        "qemu": QemuDriver(layout, HelperClient(str(layout.helper_socket))),
    }
    node.run(made["qemu"].ensure_template("python"), timeout=900)
    yield made
    for driver in made.values():
        node.run(driver.close())


@pytest.mark.parametrize("name", DRIVERS)
def test_exec_env_streams_stdin_and_files(node, drivers: dict[str, Driver], name: str) -> None:  # type: ignore[no-untyped-def]
    driver = drivers[name]
    sandbox_id = ids.new_sandbox_id()

    async def scenario() -> None:
        channel = await driver.create_warm(SandboxSpec(sandbox_id, "python", env={"OWN": "value"}))
        assert channel is not None
        try:
            session = GuestSession(channel)
            await session.reseed()  # as NodeAgent does after every warm start
            await session.configure({"OWN": "value"})
            result = await session.exec("echo $OWN $CALL; echo err >&2; exit 3", env={"CALL": "call"})
            assert (result.exit_code, result.stdout, result.stderr) == (3, b"value call\n", b"err\n")
            result = await session.exec(
                ["python3", "-c", "import sys; print(len(sys.stdin.read()))"], stdin=b"x" * 5000
            )
            assert result.stdout == b"5000\n"
            assert (await session.exec("kill -9 $$")).signal == 9
            payload = os.urandom(300_000)
            await session.write_file("/tmp/blob", payload)
            assert await session.read_file("/tmp/blob") == payload
            assert (await session.exec("pwd; id -un", cwd="/tmp", user="user")).stdout == b"/tmp\nuser\n"
            await channel.close()
        finally:
            await driver.destroy(sandbox_id)

    node.run(scenario())


@pytest.mark.parametrize("name", DRIVERS)
def test_pause_resume_checkpoint_and_rollback(node, drivers: dict[str, Driver], name: str) -> None:  # type: ignore[no-untyped-def]
    driver = drivers[name]
    sandbox_id, snapshot_id = ids.new_sandbox_id(), ids.new_snapshot_id()

    async def scenario() -> None:
        channel = await driver.create_warm(SandboxSpec(sandbox_id, "python"))
        assert channel is not None
        try:
            session = GuestSession(channel)
            await session.exec("echo one > /root/state")
            await driver.pause(sandbox_id)
            assert (await driver.state(sandbox_id)).runtime == "paused"
            await driver.resume(sandbox_id)
            assert (await driver.state(sandbox_id)).runtime == "running"
            info, replaced = await driver.checkpoint(sandbox_id, snapshot_id)
            assert info.image_bytes > 0
            listed = {snap["snapshot_id"]: snap for snap in await driver.list_snapshots(sandbox_id)}
            assert listed[snapshot_id]["kind"] == "full"
            space_left = await driver.disk_space()
            assert space_left is not None and 0 < space_left["free_bytes"] <= space_left["total_bytes"]
            if replaced is not None:
                channel, session = replaced, GuestSession(replaced)
            await session.exec("echo two > /root/state")
            await channel.close()
            channel = await driver.restore(sandbox_id, snapshot_id)
            assert (await GuestSession(channel).exec("cat /root/state")).stdout == b"one\n"
            await channel.close()
            await driver.delete_snapshot(sandbox_id, snapshot_id)
            assert snapshot_id not in {
                snap["snapshot_id"] for snap in await driver.list_snapshots(sandbox_id)
            }
        finally:
            await driver.destroy(sandbox_id)
        assert (await driver.state(sandbox_id)).exists is False

    node.run(scenario())


@pytest.mark.parametrize("name", DRIVERS)
def test_sandboxes_from_one_checkpoint_draw_different_randomness(
    node, drivers: dict[str, Driver], name: str
) -> None:  # type: ignore[no-untyped-def]
    """Every sandbox of a template starts from the same checkpoint (the guest kernel's entropy pool
    included): after the agent's reseed, two of them must not read the same bytes."""
    driver = drivers[name]
    sandbox_ids = [ids.new_sandbox_id(), ids.new_sandbox_id()]

    async def scenario() -> None:
        drawn = []
        try:
            for sandbox_id in sandbox_ids:
                channel = await driver.create_warm(SandboxSpec(sandbox_id, "python"))
                assert channel is not None
                session = GuestSession(channel)
                await session.reseed()
                drawn.append((await session.exec("head -c 32 /dev/urandom | od -An -tx1")).stdout)
                drawn.append(
                    (await session.exec(["python3", "-c", "import os; print(os.urandom(16).hex())"])).stdout
                )
                await channel.close()
        finally:
            for sandbox_id in sandbox_ids:
                await driver.destroy(sandbox_id)
        assert drawn[0] != drawn[2] and drawn[1] != drawn[3], drawn

    node.run(scenario())
