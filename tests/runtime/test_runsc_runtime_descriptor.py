"""Checkpoints describe their runtime, on a real runsc node (ADR 0035): the node reports the descriptor of
the runsc its helper runs (platform, network mode, `runsc --version`, template base), every full checkpoint
image carries the descriptor of the runsc that wrote it, and a restore of an image made on another runtime
is refused with a typed error naming the difference, leaving nothing behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from space.core import errors, runtimes
from space.node.agent.agent import NodeAgent
from space.node.agent.service_core import ServiceCore
from space.node.volumes.template_base import BASE_VERSION
from tests.support.sandboxes import new_sandbox

pytestmark = pytest.mark.root


def test_the_runtime_is_recorded_and_an_incompatible_restore_is_refused(node) -> None:
    agent: NodeAgent = node.agent
    layout = node.node.layout
    version = subprocess.run(["runsc", "--version"], capture_output=True, text=True, check=True).stdout
    described = agent.node_runtime()
    assert described is not None
    assert described["driver"] == "runsc" and described["platform"] == node.node.platform
    assert described["network"] in {"none", "sandbox"}
    assert described["runtime_version"] is not None and described["runtime_version"] in version.split()
    assert described["template_base"] is not None and described["template_base"].endswith(f"@{BASE_VERSION}")
    info = ServiceCore(agent).info()
    assert info.runtime == described
    assert ServiceCore(agent).registration("http://node.test:1", "t" * 32).runtime == described

    async def scenario() -> None:
        async with new_sandbox(agent) as parent:
            record = await agent.checkpoint(parent.sandbox_id)
            image = layout.checkpoint_image(parent.sandbox_id, record.snapshot_id)
            recorded = json.loads((image / "runtime.json").read_text())
            assert recorded == described
            # The same image restores (a fork child comes up from it and answers) ...
            [child] = await agent.fork(parent.sandbox_id, snapshot_id=record.snapshot_id)
            assert (await child.session.exec("echo forked", timeout=30)).stdout == b"forked\n"
            await agent.delete(child.sandbox_id)
            # ... but not once it says another runsc made it.
            (image / "runtime.json").write_text(json.dumps({**described, "platform": "systrap"}))
            before = set(agent.sandboxes)
            with pytest.raises(errors.RuntimeIncompatible) as caught:
                await agent.fork(parent.sandbox_id, snapshot_id=record.snapshot_id)
            assert caught.value.details["field"] == "platform", caught.value.details
            assert "gVisor platform 'systrap'" in caught.value.details["reason"]
            assert f"this node has '{described['platform']}'" in caught.value.details["reason"]
            assert set(agent.sandboxes) == before  # the refused child left nothing behind
            # A hostile descriptor is refused as unreadable, not trusted and not a crash.
            (image / "runtime.json").write_text(json.dumps({"driver": "x" * 100_000}))
            with pytest.raises(errors.RuntimeIncompatible) as hostile:
                await agent.fork(parent.sandbox_id, snapshot_id=record.snapshot_id)
            assert "unreadable" in hostile.value.message and len(hostile.value.message) < 400
            # The parent was never touched.
            assert (await parent.session.exec("echo parent", timeout=30)).stdout == b"parent\n"
            assert runtimes.restore_problem(described, recorded) is None

    node.run(scenario())
