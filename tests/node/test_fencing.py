"""Fencing without runsc (ADR 0033): the lease logic of the root helper's `node.fence` (space.node.helper.
fence_verbs) and of the agent (space.node.agent.fencing, registration.Reporter), each on its own.

- The helper's lease: armed only by a renewal, fenced when its deadline passes (the node's runtimes are
  swept; runtime-starting verbs are refused until a renewal), never moved backwards, disarmed by `release`;
  its arguments are attacked (extra fields, both or neither, NaN, negative, a deadline past the bound).
- The agent's Fence: a lease is measured from the heartbeat's SEND time; an answer after its own deadline
  renews nothing; without a helper the in-process watchdog stops the sandboxes when the lease ends, and a
  release disarms it.
- Reporter: each acknowledged heartbeat renews the fence with the answer's lease; deregistration names the
  latest heartbeat's `beat` and releases the fence only if the control plane accepted it.
"""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import threading
import time
from typing import Any

import httpx
import pytest

from space.node.agent.agent import NodeAgent
from space.node.agent.fencing import Fence
from space.node.agent.identity import NodeIdentity
from space.node.agent.launch import node_fence
from space.node.agent.registration import Reporter
from space.node.agent.service import NodeService
from space.node.drivers.fake import FakeDriver
from space.node.helper import fence_verbs
from space.node.helper.context import HelperContext
from space.node.helper.server import dispatch
from tests.support.helper_context import ctx  # noqa: F401 - fixture

NO_PROGRESS = print


def call(ctx: HelperContext, verb: str, **args: Any) -> dict[str, Any]:  # noqa: F811
    return dispatch(ctx, {"verb": verb, "args": args}, NO_PROGRESS)


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["ok"] is True, answer
    return dict(answer["result"])


def refused(answer: dict[str, Any], code: str) -> str:
    assert answer["ok"] is False and answer["error"]["code"] == code, answer
    return str(answer["error"]["message"])


def wait_until(check: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "not true in time"
        time.sleep(0.01)


def test_helper_lease_fences_when_it_passes_and_renewal_lifts_it(ctx: HelperContext) -> None:  # noqa: F811
    assert ok(call(ctx, "node.fence_status")) == {
        "armed": False,
        "fenced": False,
        "expires_in_s": None,
        "last": {},
    }
    sandbox = {"sandbox_id": "sb-" + "a" * 26}
    ok(call(ctx, "node.fence", deadline=time.monotonic() + 0.3))
    status = ok(call(ctx, "node.fence_status"))
    assert status["armed"] and not status["fenced"] and 0 < status["expires_in_s"] <= 0.3
    # A renewal never moves the deadline backwards.
    ok(call(ctx, "node.fence", deadline=time.monotonic() + 0.05))
    assert ok(call(ctx, "node.fence_status"))["expires_in_s"] > 0.1
    wait_until(lambda: ok(call(ctx, "node.fence_status"))["fenced"])
    fenced = ok(call(ctx, "node.fence_status"))
    assert fenced["armed"] is False and fenced["last"]["stopped"] == [] and fenced["last"]["left"] == []
    assert 0 <= fenced["last"]["late_s"] < 1.0
    # Fenced: nothing that would make a runtime run gets past the fence (not even to its own checks).
    for verb in ("sandbox.start", "sandbox.resume"):
        assert "fenced" in refused(call(ctx, verb, **sandbox), "unavailable")
    # A stale renewal (its deadline already over) lifts nothing.
    ok(call(ctx, "node.fence", deadline=time.monotonic() - 1))
    assert ok(call(ctx, "node.fence_status"))["fenced"] is True
    renewed = ok(call(ctx, "node.fence", deadline=time.monotonic() + 30))
    assert renewed["was_fenced"] is True
    assert ok(call(ctx, "node.fence_status"))["fenced"] is False
    refused(call(ctx, "sandbox.start", **sandbox), "not_found")  # past the fence: the verb's own check
    assert ok(call(ctx, "node.fence", release=True)) == {"armed": False}
    assert ok(call(ctx, "node.fence_status"))["armed"] is False


def test_a_released_lease_never_fences(ctx: HelperContext) -> None:  # noqa: F811
    ok(call(ctx, "node.fence", deadline=time.monotonic() + 0.1))
    ok(call(ctx, "node.fence", release=True))
    time.sleep(0.3)
    status = ok(call(ctx, "node.fence_status"))
    assert status["fenced"] is False and status["last"] == {}


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"release": False},
        {"deadline": 10.0, "release": True},
        {"deadline": -1.0},
        {"deadline": 0},
        {"deadline": "12"},
        {"deadline": math.nan},
        {"deadline": math.inf},
        {"release": "yes"},
        {"deadline": 10.0, "node": "other"},
    ],
)
def test_helper_fence_arguments_are_checked(ctx: HelperContext, args: dict[str, Any]) -> None:  # noqa: F811
    refused(dispatch(ctx, {"verb": "node.fence", "args": args}, NO_PROGRESS), "invalid_argument")
    assert ok(call(ctx, "node.fence_status"))["armed"] is False


def test_a_lease_beyond_the_bound_is_refused(ctx: HelperContext) -> None:  # noqa: F811
    far = time.monotonic() + fence_verbs.MAX_LEASE_S + 60
    assert "at most" in refused(call(ctx, "node.fence", deadline=far), "invalid_argument")
    assert ok(call(ctx, "node.fence_status"))["armed"] is False


# -- the agent's side ------------------------------------------------------------------------------------
class FakeHelper:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, verb: str, args: dict[str, Any] | None = None, **_kw: Any) -> dict[str, Any]:
        self.calls.append((verb, dict(args or {})))
        return {"armed": True}


def test_agent_renews_from_the_send_time_and_ignores_late_answers() -> None:
    async def scenario() -> None:
        helper = FakeHelper()
        fence = Fence(helper)  # type: ignore[arg-type]
        sent = time.monotonic() - 2.0
        assert await fence.renew(sent, 10.0) is True
        assert helper.calls == [("node.fence", {"deadline": sent + 10.0})]
        assert await fence.renew(time.monotonic() - 11.0, 10.0) is False  # its lease is already over
        assert len(helper.calls) == 1
        await fence.release()
        assert helper.calls[-1] == ("node.fence", {"release": True})

    asyncio.run(scenario())


def test_without_a_helper_the_watchdog_fences_and_release_disarms() -> None:
    async def scenario() -> None:
        fenced: list[float] = []

        async def on_expiry() -> None:
            fenced.append(time.monotonic())

        fence = Fence(None, on_expiry)
        sent = time.monotonic()
        await fence.renew(sent, 0.2)
        await asyncio.sleep(0.5)
        assert len(fenced) == 1 and fenced[0] >= sent + 0.2 and fence.fenced
        await fence.renew(time.monotonic(), 0.2)  # reachable again: armed anew
        assert not fence.fenced
        await fence.release()
        await asyncio.sleep(0.4)
        assert len(fenced) == 1  # released: never fenced again
        await fence.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("enforce", [True, False])
def test_a_fake_node_fences_its_sandboxes_only_when_told_to(tmp_path: pathlib.Path, enforce: bool) -> None:
    async def scenario() -> None:
        agent = NodeAgent(FakeDriver(tmp_path))
        await agent.prepare()
        handle = await agent.create()
        fence = node_fence(agent, enforce_in_agent=enforce)
        try:
            assert (await agent.driver.state(handle.sandbox_id)).runtime == "running"
            await fence.renew(time.monotonic(), 0.1)
            for _ in range(50):
                if (await agent.driver.state(handle.sandbox_id)).runtime != "running":
                    break
                await asyncio.sleep(0.02)
            stopped = (await agent.driver.state(handle.sandbox_id)).runtime != "running"
            assert stopped is enforce and fence.fenced is enforce
        finally:
            await fence.close()
            await agent.delete_all()
            await agent.close()

    asyncio.run(scenario())


# -- the reporter --------------------------------------------------------------------------------------
def reporter_world(tmp_path: pathlib.Path, control_plane: Any) -> tuple[NodeAgent, NodeService, FakeHelper]:
    agent = NodeAgent(FakeDriver(tmp_path))
    service = NodeService(agent)
    service.identity = NodeIdentity.load(tmp_path / "identity" / "node.json")
    service.identity.set("node-x", "identity-" + "s" * 32)
    return agent, service, FakeHelper()


@pytest.mark.parametrize("deregistration", [200, 409, 503])
def test_reporter_renews_per_heartbeat_and_deregisters_with_the_latest_beat(
    tmp_path: pathlib.Path, deregistration: int
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    beats = iter(range(1000))

    def control_plane(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        seen.append((request.url.path, body))
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"node_id": "node-x"})
        if request.url.path.endswith("/heartbeat"):
            return httpx.Response(200, json={"ok": True, "fence_after_s": 7.5, "beat": f"beat-{next(beats)}"})
        return httpx.Response(deregistration, json={"error": {"code": "x", "message": "no"}})

    async def scenario() -> None:
        agent, service, helper = reporter_world(tmp_path, control_plane)
        await agent.prepare()
        fence = Fence(helper)  # type: ignore[arg-type]
        reporter = Reporter(
            service, "http://cp", None, "http://node:7070", "rpc-token", fence=fence, interval=0.01,
            transport=httpx.MockTransport(control_plane),
        )  # fmt: skip
        started = time.monotonic()
        task = asyncio.create_task(reporter.run())
        try:
            for _ in range(500):
                if len([c for c in helper.calls if "deadline" in c[1]]) >= 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadlines = [args["deadline"] for verb, args in helper.calls if "deadline" in args]
        assert len(deadlines) >= 3 and deadlines == sorted(deadlines)
        assert all(started + 7.5 <= d <= time.monotonic() + 7.5 for d in deadlines)
        last_beat = reporter.beat
        assert await reporter.deregister() is (deregistration == 200)
        path, body = seen[-1]
        assert path == "/v1/nodes/node-x/deregister" and body == {"beat": last_beat}
        released = ("node.fence", {"release": True}) in helper.calls
        assert released is (deregistration == 200)  # refused: the fence stays armed
        await agent.close()

    asyncio.run(scenario())


def test_a_stopped_reporter_finishes_the_heartbeat_in_flight_and_deregisters_with_its_beat(
    tmp_path: pathlib.Path,
) -> None:
    """`space down` stops the reporter while a heartbeat is in flight: the control plane records that beat,
    so the node must read its answer before it deregisters (else it names an older beat: 409 stale)."""
    recorded: list[str] = []
    in_flight = threading.Event()

    async def control_plane(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"node_id": "node-x"})
        if request.url.path.endswith("/heartbeat"):
            recorded.append(f"beat-{len(recorded)}")  # recorded on arrival, answered later
            in_flight.set()
            await asyncio.sleep(0.3)
            return httpx.Response(200, json={"ok": True, "fence_after_s": 7.5, "beat": recorded[-1]})
        body = json.loads(request.content)
        return httpx.Response(200 if body["beat"] == recorded[-1] else 409, json={})

    async def scenario() -> None:
        agent, service, helper = reporter_world(tmp_path, control_plane)
        await agent.prepare()
        reporter = Reporter(
            service, "http://cp", None, "http://node:7070", "rpc-token", fence=Fence(helper),  # type: ignore[arg-type]
            interval=0.01, transport=httpx.MockTransport(control_plane),
        )  # fmt: skip
        task = asyncio.create_task(reporter.run())
        while not in_flight.is_set():
            await asyncio.sleep(0.01)
        reporter.stop()  # while the first heartbeat waits for its answer
        await asyncio.wait_for(task, 5)
        assert reporter.beat == recorded[-1]
        assert await reporter.deregister() is True
        await agent.close()

    asyncio.run(scenario())


def test_no_deregistration_without_an_acknowledged_heartbeat(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        agent, service, helper = reporter_world(tmp_path, None)
        reporter = Reporter(service, "http://cp", None, "http://node:7070", "rpc-token", fence=Fence(helper))  # type: ignore[arg-type]
        assert await reporter.deregister() is False
        assert helper.calls == []
        await agent.close()

    asyncio.run(scenario())
