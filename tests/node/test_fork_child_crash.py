"""A forked child whose runtime dies is seen to crash, like any other sandbox (found by the lifecycle model,
tests/model/test_lifecycle_model.py: a fork child's channel was assigned without `attach`, so its death went
unnoticed and the child stayed `running` forever with no processes)."""

from __future__ import annotations

import os
import signal
import time

from space.core.ids import new_sandbox_id
from space.core.lifecycle import State
from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver
from tests.support import fake_agent
from tests.support.loop import BackgroundLoop

loop = fake_agent.loop  # a fresh BackgroundLoop per test (not the session loop)
agent = fake_agent.agent  # a NodeAgent over the fake driver


def test_a_fork_childs_runtime_death_is_a_crash(loop: BackgroundLoop, agent: NodeAgent) -> None:
    parent = loop.run(agent.create())
    # fork_with_ids: the path of the control plane's fork (it names the child), not `fork`
    (child,) = loop.run(agent.fork_with_ids(parent, None, [new_sandbox_id()]))
    assert child.state == State.RUNNING
    driver = agent.driver
    assert isinstance(driver, FakeDriver)
    os.kill(driver.processes[child.sandbox_id].pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while child.state != State.CRASHED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.state == State.CRASHED, f"the child's runtime died but it is '{child.state}'"
    assert parent.state == State.RUNNING
