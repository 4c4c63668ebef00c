"""The single flight of space.node.agent.template_travel.fetch_template (fast, no node): concurrent first
uses share one fetch, a failed fetch reaches every waiter and is forgotten so the next call retries, and
each agent (node) has its own flights; templates that arrive (fetched, built-ins built on first use) join
what the node reports (fake driver)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from space.core import errors
from space.node.agent import template_start, template_travel
from space.node.agent.agent import NodeAgent
from space.node.agent.pools import WarmPools
from space.node.agent.runtime_names import RuntimeNames
from space.node.agent.service_core import ServiceCore
from space.node.drivers.base import SandboxSpec
from space.node.drivers.fake import FakeDriver


class Agent:
    """Only an identity: the flights are keyed by the agent object."""


def test_concurrent_fetches_share_one_flight_and_failure_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    outcomes = ["fail", "ok"]

    async def fake_fetch(agent: Any, name: str) -> dict[str, Any]:
        calls.append(name)
        await asyncio.sleep(0.05)
        if outcomes.pop(0) == "fail":
            raise errors.ArtifactCorrupt("a part did not verify", reason="sha256")
        return {"name": name}

    monkeypatch.setattr(template_travel, "_fetch", fake_fetch)

    async def scenario() -> None:
        agent = Agent()
        first = await asyncio.gather(
            *(template_travel.fetch_template(agent, "tpl-0123456789abcdef") for _ in range(5)),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        assert calls == ["tpl-0123456789abcdef"]
        assert all(isinstance(item, errors.ArtifactCorrupt) for item in first)
        second = await asyncio.gather(
            *(template_travel.fetch_template(agent, "tpl-0123456789abcdef") for _ in range(5))  # type: ignore[arg-type]
        )
        assert len(calls) == 2 and second == [{"name": "tpl-0123456789abcdef"}] * 5

    asyncio.run(scenario())


def test_a_cancelled_waiter_does_not_cancel_the_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    finished: list[str] = []

    async def fake_fetch(agent: Any, name: str) -> dict[str, Any]:
        await asyncio.sleep(0.1)
        finished.append(name)
        return {"name": name}

    monkeypatch.setattr(template_travel, "_fetch", fake_fetch)

    async def scenario() -> None:
        agent = Agent()
        impatient = asyncio.create_task(template_travel.fetch_template(agent, "tpl-a"))  # type: ignore[arg-type]
        patient = asyncio.create_task(template_travel.fetch_template(agent, "tpl-a"))  # type: ignore[arg-type]
        await asyncio.sleep(0.02)
        impatient.cancel()
        assert await patient == {"name": "tpl-a"} and finished == ["tpl-a"]

    asyncio.run(scenario())


def test_names_outside_user_templates_are_left_to_the_create() -> None:
    class NoStore:
        store = None
        driver = object()

    asyncio.run(template_travel.ensure_template_here(NoStore(), "python"))  # type: ignore[arg-type]
    asyncio.run(template_travel.ensure_template_here(NoStore(), "tpl-0123456789abcdef"))  # type: ignore[arg-type]


def test_a_pool_fetches_its_template_before_filling_and_backs_off_when_it_cannot() -> None:
    """WarmPools' before_fill (wired to ensure_template_here by launch.start_pools): awaited before each
    fill, and a failure is a failed fill (backed off), not a member."""

    class Channel:
        on_lost = None

        async def close(self) -> None:
            pass

    class Driver:
        name = "stand-in"

        def __init__(self) -> None:
            self.names = RuntimeNames(None)
            self.created: list[str] = []

        async def warm_ready(self, template: str) -> bool:
            return True

        async def create_pooled(self, spec: SandboxSpec) -> Channel:
            assert fetched == [spec.template] * len(fetched) and fetched, "filled before the fetch"
            self.created.append(spec.sandbox_id)
            return Channel()

        async def destroy(self, sandbox_id: str) -> None:
            pass

    fetched: list[str] = []
    attempts = {"n": 0}

    async def before_fill(template: str) -> None:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise errors.NotFound(f"template {template!r} is neither on this node nor published")
        fetched.append(template)

    async def scenario() -> None:
        driver = Driver()
        pools = WarmPools(lambda: driver, {"tpl-0123456789abcdef": 1}, fill_yield_s=0.0,  # type: ignore[arg-type,return-value]
                          before_fill=before_fill)  # fmt: skip
        pools.start()
        async with asyncio.timeout(20):
            while pools.counts() != {"tpl-0123456789abcdef": 1}:
                await asyncio.sleep(0.01)
        assert pools.stats["fill_failures"] == 1 and len(driver.created) == 1
        await pools.close(destroy=True)

    asyncio.run(scenario())


def test_templates_that_arrive_join_what_the_node_reports(tmp_path: pathlib.Path) -> None:
    """A built-in built on its first create, and a user template fetched on first use (the hook its fetch
    calls; the real fetch: test_template_travel_runsc), join the node's info (its heartbeat's templates)."""

    async def body() -> None:
        agent = NodeAgent(FakeDriver(tmp_path))
        await agent.prepare(templates=())
        service = ServiceCore(agent, templates=("python",))
        try:
            await agent.create("base")  # not prepared: built on this first use
            assert service.info().templates == ["python", "base"]
            await agent.create("base")
            assert agent.template_arrived is not None
            agent.template_arrived("tpl-0123456789abcdef")
            agent.template_arrived("tpl-0123456789abcdef")
            assert service.info().templates == ["python", "base", "tpl-0123456789abcdef"]
        finally:
            await agent.delete_all()
            await agent.close()

    asyncio.run(body())


def test_a_pool_member_booted_cold_runs_the_start_command_one_from_the_warm_start_does_not() -> None:
    """A member restored from the warm start holds what the command started; one booted cold (the template
    has no warm start) runs it itself, as a cold create does."""

    class Channel:
        on_lost = None

        def __init__(self) -> None:
            self.calls: list[tuple[str, dict[str, Any]]] = []

        async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
            self.calls.append((method, params))
            return {"process_id": "p-1", "pid": 7}

        async def close(self) -> None:
            pass

    class Driver:
        name = "stand-in"
        start_log = "/tmp/space-start.log"

        def __init__(self, warm: bool) -> None:
            self.names = RuntimeNames(None)
            self.warm = warm
            self.channels: list[Channel] = []

        async def warm_ready(self, template: str) -> bool:
            return self.warm

        async def start_command(self, template: str) -> str | None:
            return "serve --port 8000 &"

        async def create_pooled(self, spec: SandboxSpec) -> Channel:
            self.channels.append(Channel())
            return self.channels[-1]

        async def destroy(self, sandbox_id: str) -> None:
            pass

    async def fill(driver: Driver) -> None:
        pools = WarmPools(lambda: driver, {"tpl-0123456789abcdef": 1}, fill_yield_s=0.0)  # type: ignore[arg-type,return-value]
        pools.start()
        async with asyncio.timeout(20):
            while pools.counts() != {"tpl-0123456789abcdef": 1}:
                await asyncio.sleep(0.01)
        await pools.close(destroy=True)

    cold, warm = Driver(warm=False), Driver(warm=True)
    asyncio.run(fill(cold))
    asyncio.run(fill(warm))
    ((method, params),) = cold.channels[0].calls
    assert method == "process.start" and params["background"] is True
    assert params["tag"] == template_start.START_TAG and params["argv"][-1].endswith("serve --port 8000 &")
    assert "user" not in params and "cwd" not in params and "env" not in params  # the template's defaults
    assert warm.channels[0].calls == []
