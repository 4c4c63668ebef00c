"""A checkpoint answers before its runtime resumes (ADR 0077), over the fake driver (fast, no root): a
driver that `resumes_after_checkpoint` leaves the runtime paused by the checkpoint, and the agent resumes it
in the background under the sandbox's lock. So a step asked for right after the checkpoint runs after the
resume (a pause stays a pause), a resume that fails leaves the sandbox recorded as paused (what it is), and
a checkpoint that fails resumes what it paused. The real runsc path:
tests/runtime/test_runsc_checkpoint_floors.py.
"""

from __future__ import annotations

import asyncio

from space.core import errors
from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop
agent = fake_agent.agent


def _apart(agent: NodeAgent) -> FakeDriver:
    driver = agent.driver
    assert isinstance(driver, FakeDriver)
    driver.resumes_after_checkpoint = True  # as the runsc driver: checkpoint(leave_paused) + resume
    return driver


async def _settled(agent: NodeAgent, sandbox_id: str) -> None:
    """Until the background resume (if any) let go of the sandbox."""
    async with agent.get(sandbox_id).lock:
        pass


def test_the_checkpoint_answers_and_the_sandbox_runs_on(loop: BackgroundLoop, agent: NodeAgent) -> None:
    driver = _apart(agent)
    handle = loop.run(agent.create())
    snap = loop.run(agent.checkpoint(handle.sandbox_id))
    assert snap.kind == "full" and handle.state == State.RUNNING
    assert loop.run(handle.session.exec(["true"])).exit_code == 0  # answered once resumed
    loop.run(_settled(agent, handle.sandbox_id))
    assert handle.sandbox_id not in driver.paused


def test_a_pause_asked_right_after_the_checkpoint_runs_after_its_resume(
    loop: BackgroundLoop, agent: NodeAgent
) -> None:
    driver = _apart(agent)
    handle = loop.run(agent.create())
    calls: list[str] = []
    for name in ("pause", "resume"):
        original = getattr(driver, name)

        async def traced(sandbox_id: str, _name: str = name, _original=original) -> None:  # type: ignore[no-untyped-def]
            calls.append(_name)
            await _original(sandbox_id)

        setattr(driver, name, traced)

    async def checkpoint_then_pause() -> None:
        checkpoint = asyncio.create_task(agent.checkpoint(handle.sandbox_id))
        await asyncio.sleep(0)  # the checkpoint holds the lock; the pause queues behind it
        pause = asyncio.create_task(agent.pause(handle.sandbox_id))
        await asyncio.gather(checkpoint, pause)

    loop.run(checkpoint_then_pause())
    assert calls == ["pause", "resume", "pause"]  # the checkpoint's, its resume, then the one asked for
    assert handle.state == State.PAUSED and handle.sandbox_id in driver.paused
    loop.run(agent.resume(handle.sandbox_id))
    assert handle.sandbox_id not in driver.paused


def test_a_resume_that_fails_leaves_the_sandbox_recorded_as_paused(
    loop: BackgroundLoop, agent: NodeAgent
) -> None:
    driver = _apart(agent)
    handle = loop.run(agent.create())
    real_resume = driver.resume

    async def failing(sandbox_id: str) -> None:
        raise errors.RuntimeFailure("runsc resume failed")

    driver.resume = failing  # type: ignore[method-assign]
    loop.run(agent.checkpoint(handle.sandbox_id))
    loop.run(_settled(agent, handle.sandbox_id))
    assert handle.state == State.PAUSED and handle.sandbox_id in driver.paused
    driver.resume = real_resume  # type: ignore[method-assign]
    loop.run(agent.resume(handle.sandbox_id))  # asking again brings it back
    assert handle.state == State.RUNNING and handle.sandbox_id not in driver.paused


def test_a_failed_checkpoint_resumes_what_it_paused(loop: BackgroundLoop, agent: NodeAgent) -> None:
    driver = _apart(agent)
    handle = loop.run(agent.create())

    async def fails_paused(sandbox_id: str, snapshot_id: str) -> None:
        raise errors.RuntimeFailure("the disk filled up")

    driver.disk_snapshot = fails_paused  # type: ignore[method-assign]  # the fake checkpoint's second half
    try:
        loop.run(agent.checkpoint(handle.sandbox_id))
    except errors.RuntimeFailure:
        pass
    else:
        raise AssertionError("the checkpoint did not fail")
    assert handle.state == State.RUNNING and handle.sandbox_id not in driver.paused
    assert loop.run(handle.session.exec(["true"])).exit_code == 0
