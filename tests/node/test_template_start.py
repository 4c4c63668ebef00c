"""A template's start command (space.node.agent.template_start, ADR 0054): started by a cold create as a
tagged background process of the sandbox's daemon with its output in the start log, never by a build's
sandbox, its failures recorded and never fatal. Fake driver (the real warm path:
test_template_start_runsc)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable

from space.node.agent import template_start
from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver


async def _until(predicate: Callable[[], bool], wait_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + wait_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_cold_create_runs_the_start_command_detached(tmp_path: pathlib.Path) -> None:
    async def body() -> None:
        driver = FakeDriver(tmp_path)
        # It leaves a server behind and exits; the server outlives it and writes a marker in the workdir.
        driver.start_commands["python"] = (
            "sh -c 'echo $$ > server.pid; exec sleep 300' & echo start-ran; echo oops >&2"
        )
        agent = NodeAgent(driver)
        await agent.prepare(templates=())
        try:
            handle = await agent.create("python")
            assert handle.created_from == "cold" and handle.start_error is None
            assert handle.start_process is not None
            work = tmp_path / "sandboxes" / handle.sandbox_id / "work"
            await _until((work / "server.pid").exists)
            assert await template_start.settle(handle.session, "python", handle.start_process) is None
            table = {p["process_id"]: p for p in await handle.session.processes()}
            entry = table[handle.start_process]
            assert entry["tag"] == template_start.START_TAG and entry["background"] is True
            assert entry["exit_code"] == 0 and entry["cwd"] == str(work)  # the daemon's default workdir
            assert (tmp_path / "start.log").read_text() == "start-ran\noops\n"  # never the daemon's buffer
            server = ["sh", "-c", "ps -o args= -p $(cat server.pid)"]
            for _ in range(200):  # the server still runs after the command exited (once it is exec'd)
                if (await handle.session.exec(server)).stdout.decode().strip() == "sleep 300":
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the server the start command left is not running")
            # A fake sandbox is host processes and the server left its daemon's tree: stop it here.
            assert (await handle.session.exec(["sh", "-c", "kill $(cat server.pid)"])).exit_code == 0

            plain = await agent.create("python", start=False)  # a build's sandbox: no start command
            assert plain.start_process is None and plain.start_error is None
            assert not (tmp_path / "sandboxes" / plain.sandbox_id / "work" / "server.pid").exists()
        finally:
            await agent.delete_all()
            await agent.close()

    asyncio.run(body())


def test_a_failing_start_command_is_recorded_never_fatal(tmp_path: pathlib.Path) -> None:
    async def body() -> None:
        driver = FakeDriver(tmp_path)
        driver.start_commands["python"] = "echo failing; exit 3"
        agent = NodeAgent(driver)
        await agent.prepare(templates=())
        try:
            handle = await agent.create("python")
            assert handle.start_process is not None
            why = await template_start.settle(handle.session, "python", handle.start_process)
            assert why is not None and "exited with 3" in why
            assert (await handle.session.exec(["true"])).exit_code == 0  # the sandbox works

            del driver.start_commands["python"]  # none: nothing started, nothing recorded
            other = await agent.create("python")
            assert other.start_process is None and other.start_error is None
            assert [p for p in await other.session.processes() if p["tag"] == template_start.START_TAG] == []
        finally:
            await agent.delete_all()
            await agent.close()

    asyncio.run(body())


def test_settle_gives_up_on_a_command_that_keeps_running(tmp_path: pathlib.Path) -> None:
    async def body() -> None:
        driver = FakeDriver(tmp_path)
        driver.start_commands["python"] = "exec sleep 300"  # the command is the server itself
        agent = NodeAgent(driver)
        await agent.prepare(templates=())
        try:
            handle = await agent.create("python")
            assert handle.start_process is not None
            assert await template_start.settle(handle.session, "python", handle.start_process, 0.5) is None
            running = {p["process_id"]: p["running"] for p in await handle.session.processes()}
            assert running[handle.start_process] is True  # kept running
            await handle.session.signal(handle.start_process, 9)
        finally:
            await agent.delete_all()
            await agent.close()

    asyncio.run(body())
