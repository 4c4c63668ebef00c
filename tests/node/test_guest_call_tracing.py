"""A guest call's span and spaced's own time (ADR 0072), at the agent's end of the private channel: a valid
`spaced_ns` becomes spaced's span under the call's, a hostile one (a guest is untrusted) is dropped, and
either way the key never reaches the call's result."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from space.core import tracing
from space.node.agent import channel, channel_call
from space.protocol import Frame, FrameType


@pytest.fixture(autouse=True)
def _traced() -> None:
    tracing.configure("test")


def _call_answered(result: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    host = SimpleNamespace(name="sb-t", flow_control=False, receive_window=0, send_window=0)

    async def run() -> tuple[dict[str, Any], str]:
        with tracing.Layer("space.test").span("request", root=True) as root:
            call = channel_call.Call(host, 1, "process.start")  # type: ignore[arg-type]
            call.span = channel.LAYER.start("guest.process.start", guest_method="process.start")
        assert call.deliver(Frame(FrameType.RESULT, 1, json.dumps(result).encode()))
        return await call.result(), f"{root.get_span_context().trace_id:032x}"

    answer, trace_id = asyncio.run(run())
    return answer, tracing.RING.trace(trace_id)


def test_spaced_s_time_is_a_span_under_the_guest_call() -> None:
    answer, spans = _call_answered({"exit_code": 0, "spaced_ns": 2_500_000})
    assert answer == {"exit_code": 0}
    by_name = {s["name"]: s for s in spans}
    spaced, call = by_name["spaced.process.start"], by_name["guest.process.start"]
    assert spaced["parent_id"] == call["span_id"] and spaced["layer"] == "space.guest"
    assert spaced["end_ns"] - spaced["start_ns"] == 2_500_000


@pytest.mark.parametrize("hostile", [-1, 10**30, 1.5, True, "5", None, [1], {"ns": 1}])
def test_a_hostile_time_is_dropped(hostile: Any) -> None:
    answer, spans = _call_answered({"exit_code": 0, "spaced_ns": hostile})
    assert answer == {"exit_code": 0}
    assert sorted(s["name"] for s in spans) == ["guest.process.start", "request"]
