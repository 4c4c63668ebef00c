"""The agent's lifecycle logic over the fake driver (fast, no root): every operation goes through the
transition table, refusals name the current state, and failures roll the state back per the table."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop  # a fresh BackgroundLoop per test (not the session loop)
agent = fake_agent.agent  # a NodeAgent over the fake driver


def test_fake_driver_says_it_does_not_isolate(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    driver = FakeDriver(tmp_path)
    assert driver.isolating is False
    assert "WITHOUT isolation" in caplog.text


def test_create_exec_files_and_delete(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create(env={"GREETING": "hi"}))
    assert handle.state == State.RUNNING
    result = loop.run(handle.session.exec('printf "$GREETING"'))
    assert (result.exit_code, result.stdout) == (0, b"hi")
    loop.run(handle.session.write_file("notes.txt", b"abc"))
    assert loop.run(handle.session.read_file("notes.txt")) == b"abc"
    loop.run(agent.delete(handle.sandbox_id))
    with pytest.raises(errors.NotFound):
        agent.get(handle.sandbox_id)


def test_requests_the_table_refuses_name_the_current_state(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create())
    loop.run(agent.stop(handle.sandbox_id))
    with pytest.raises(errors.InvalidState) as caught:
        loop.run(agent.pause(handle.sandbox_id))
    assert caught.value.state == "stopped"
    assert "'stopped'" in caught.value.message
    with pytest.raises(errors.InvalidState):
        loop.run(agent.resume(handle.sandbox_id))
    loop.run(agent.start(handle.sandbox_id))
    assert handle.state == State.RUNNING


def test_pause_resume_and_stop_start(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create())
    loop.run(agent.pause(handle.sandbox_id))
    assert handle.state == State.PAUSED
    loop.run(agent.resume(handle.sandbox_id))
    assert loop.run(handle.session.exec(["true"])).exit_code == 0
    loop.run(handle.session.write_file("kept.txt", b"disk survives stop"))
    loop.run(agent.stop(handle.sandbox_id))
    assert handle.state == State.STOPPED
    with pytest.raises(errors.InvalidState):
        _ = handle.session
    loop.run(agent.start(handle.sandbox_id))
    assert loop.run(handle.session.read_file("kept.txt")) == b"disk survives stop"


def test_disk_rollback_restores_files(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create())
    loop.run(handle.session.write_file("a.txt", b"v1"))
    snap = loop.run(agent.disk_snapshot(handle.sandbox_id))
    loop.run(handle.session.write_file("a.txt", b"v2"))
    loop.run(agent.rollback(handle.sandbox_id, snap.snapshot_id))
    assert handle.state == State.RUNNING
    assert loop.run(handle.session.read_file("a.txt")) == b"v1"
    with pytest.raises(errors.NotFound):
        loop.run(agent.rollback(handle.sandbox_id, "snap-" + "a" * 26))


def test_failed_step_follows_the_table(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create())

    async def broken_pause(sandbox_id: str) -> None:
        raise errors.RuntimeFailure("injected")

    agent.driver.pause = broken_pause  # type: ignore[method-assign]
    with pytest.raises(errors.RuntimeFailure):
        loop.run(agent.pause(handle.sandbox_id))
    assert handle.state == State.RUNNING  # pausing --fail--> running


def test_failed_create_leaves_nothing(loop: BackgroundLoop, agent: NodeAgent, tmp_path: pathlib.Path) -> None:
    async def broken_start(sandbox_id: str) -> None:
        raise errors.RuntimeFailure("injected")

    agent.driver.start = broken_start  # type: ignore[method-assign,assignment]
    with pytest.raises(errors.RuntimeFailure):
        loop.run(agent.create())
    assert agent.sandboxes == {}
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_fork_gives_children_their_own_copy(loop: BackgroundLoop, agent: NodeAgent) -> None:
    parent = loop.run(agent.create())
    loop.run(parent.session.write_file("shared.txt", b"from parent"))
    children = loop.run(agent.fork(parent.sandbox_id, count=2))
    assert len({c.sandbox_id for c in children}) == 2
    for child in children:
        assert loop.run(child.session.read_file("shared.txt")) == b"from parent"
    loop.run(children[0].session.write_file("shared.txt", b"child zero"))
    assert loop.run(children[1].session.read_file("shared.txt")) == b"from parent"
    assert loop.run(parent.session.read_file("shared.txt")) == b"from parent"
    with pytest.raises(errors.InvalidArgument):
        loop.run(agent.fork(parent.sandbox_id, count=0))


def test_operations_on_one_sandbox_are_serialised(loop: BackgroundLoop, agent: NodeAgent) -> None:
    handle = loop.run(agent.create())

    async def race() -> list[object]:
        return await asyncio.gather(
            agent.pause(handle.sandbox_id), agent.pause(handle.sandbox_id), return_exceptions=True
        )

    outcomes = loop.run(race())
    assert sum(1 for o in outcomes if o is None) == 1
    assert sum(1 for o in outcomes if isinstance(o, errors.InvalidState)) == 1
    assert handle.state == State.PAUSED
