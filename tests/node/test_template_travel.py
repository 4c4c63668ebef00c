"""The single flight of space.node.agent.template_travel.fetch_template (fast, no node): concurrent first
uses share one fetch, a failed fetch reaches every waiter and is forgotten so the next call retries, and
each agent (node) has its own flights."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from space.core import errors
from space.node.agent import template_travel


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
