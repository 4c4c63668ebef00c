"""The code interpreter's pieces without a sandbox (ADR 0058): the template's spec, the kernel bridge's
translation of Jupyter messages into E2B's events (checked with E2B's own parser), the control plane's
bounds on what the bridge writes, SPACE's SDK model of an execution and the MCP rendering of it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from e2b_code_interpreter.models import Execution, parse_output

from space.controlplane import code_runs
from space.core import errors
from space.core.template_spec import FileStep, PipStep, parse_build_spec
from space.mcp.code import execution_text
from space.node.code_interpreter import kernel_bridge as kb
from space.node.code_interpreter import kernel_launcher as kl
from space.node.code_interpreter.spec import (
    BRIDGE_PATH,
    KERNEL_LAUNCHER_PATH,
    TEMPLATE_NAME,
    bridge_source,
    code_interpreter_spec,
    launcher_source,
)
from space.sdk.code import CodeExecution


def _msg(kind: str, **content: Any) -> dict[str, Any]:
    return {"msg_type": kind, "content": content, "parent_header": {"msg_id": "m"}}


def test_the_spec_carries_the_bridge_and_starts_the_default_kernel() -> None:
    spec = code_interpreter_spec()
    assert spec.from_ == "base" and spec.user == "user" and TEMPLATE_NAME == "code-interpreter"
    files = [s.file for s in spec.steps if isinstance(s, FileStep)]
    assert [(f.path, f.mode, f.content()) for f in files] == [
        (BRIDGE_PATH, 0o755, bridge_source()),
        (KERNEL_LAUNCHER_PATH, 0o644, launcher_source()),
    ]
    assert kb.KERNEL_LAUNCHER.endswith("/kernel_launcher.py")  # the bridge runs it from beside itself
    assert KERNEL_LAUNCHER_PATH.rsplit("/", 1)[0] == BRIDGE_PATH.rsplit("/", 1)[0]
    pips = [req for s in spec.steps if isinstance(s, PipStep) for req in s.pip]
    assert {r.split("==")[0] for r in pips} >= {"ipykernel", "jupyter_client", "matplotlib", "numpy"}
    assert all("==" in r for r in pips)  # pinned: the spec hash changes only with this file or the bridge
    assert spec.start_cmd is not None and BRIDGE_PATH in spec.start_cmd and " start" in spec.start_cmd
    assert parse_build_spec(spec.wire()).spec_hash() == spec.spec_hash()


def test_bridge_events_are_what_e2bs_parser_reads() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n...").decode()
    messages = [
        _msg("execute_input", execution_count=3, code="x"),
        _msg("stream", name="stdout", text="out\n"),
        _msg("stream", name="stderr", text="err\n"),
        _msg("display_data", data={"image/png": png, "text/plain": "<Figure>", "application/x-custom": 1}),
        _msg("execute_result", data={"text/plain": "42", "text/html": "<b>42</b>"}, execution_count=3),
        _msg("error", ename="ValueError", evalue="bad", traceback=["line 1", "ValueError: bad"]),
        _msg("status", execution_state="idle"),
    ]
    events = [e for e in (kb.translate(m) for m in messages) if e is not None]
    assert len(events) == 6  # status shows nothing
    execution = Execution()
    for event in [*events, {"type": "end_of_execution"}]:
        parse_output(execution, json.dumps(event))
    assert execution.execution_count == 3
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["err\n"]
    assert execution.text == "42" and execution.results[1].html == "<b>42</b>"
    display = execution.results[0]
    assert display.png == png and not display.is_main_result and display.extra == {"application/x-custom": 1}
    assert execution.error is not None and execution.error.name == "ValueError"
    assert execution.error.traceback == "line 1\nValueError: bad"


@pytest.mark.parametrize("hostile", ["..", "../x", "a/b", "", "x" * 65, "-x", "a\x00", "ü", " a"])
def test_hostile_context_ids_are_refused(hostile: str) -> None:
    with pytest.raises(kb.BridgeError):
        kb.context_dir(hostile)
    with pytest.raises(errors.InvalidArgument):
        code_runs.check_context_id(hostile)


def test_env_code_sets_and_restores_exactly_the_given_values() -> None:
    scope: dict[str, Any] = {}
    import os

    os.environ.pop("SPACE_T_NEW", None)
    os.environ["SPACE_T_OLD"] = "before"
    try:
        env = {"SPACE_T_NEW": 'it\'s "quoted"\n', "SPACE_T_OLD": "during"}
        exec(kb.env_set_code(env), scope)
        assert os.environ["SPACE_T_NEW"] == env["SPACE_T_NEW"] and os.environ["SPACE_T_OLD"] == "during"
        exec(kb.ENV_RESTORE, scope)
        assert "SPACE_T_NEW" not in os.environ and os.environ["SPACE_T_OLD"] == "before"
    finally:
        os.environ.pop("SPACE_T_OLD", None)


def test_execute_request_bounds() -> None:
    with pytest.raises(errors.TooLarge):
        code_runs.execute_request("x" * (code_runs.MAX_CODE_BYTES + 1), None, None, None)
    with pytest.raises(errors.InvalidArgument):
        code_runs.execute_request("1", None, {f"K{i}": "v" for i in range(code_runs.MAX_ENV_VARS + 1)}, None)
    assert code_runs.execute_request("1", None, None, None)["timeout"] == code_runs.MAX_EXECUTION_S
    assert code_runs.execute_request("1", None, None, 10**9)["timeout"] == code_runs.MAX_EXECUTION_S
    assert code_runs.execute_request("1", "ctx-1", None, 2)["context_id"] == "ctx-1"


async def _items(chunks: list[bytes]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield {"type": "stdout", "data_b64": base64.b64encode(chunk).decode()}
    yield {"type": "exit", "exit_code": 0}


async def _all(lines: code_runs._Lines) -> list[dict[str, Any]]:
    return [item async for item in lines]


def test_bridge_lines_split_across_chunks_and_are_bounded() -> None:
    chunks = [b'{"ok":', b'{}}\n{"type":"stdout","text":"a"}\n{"type":"end', b'_of_execution"}\n']
    got = asyncio.run(_all(code_runs._Lines(_items(chunks))))
    assert [g.get("type") for g in got] == [None, "stdout", "end_of_execution"]
    endless = [b"x" * (1 << 20)] * ((code_runs.MAX_LINE_BYTES >> 20) + 2)
    with pytest.raises(errors.TooLarge):
        asyncio.run(_all(code_runs._Lines(_items(endless))))
    many = [b'{"type":"stdout","text":"' + b"y" * (1 << 20) + b'"}\n'] * (
        (code_runs.MAX_OUTPUT_BYTES >> 20) + 2
    )
    with pytest.raises(errors.TooLarge):
        asyncio.run(_all(code_runs._Lines(_items(many))))
    with pytest.raises(errors.Internal):
        asyncio.run(_all(code_runs._Lines(_items([b"not json\n"]))))


def test_sdk_execution_and_mcp_text() -> None:
    execution = CodeExecution()
    for event in (
        {"type": "number_of_executions", "execution_count": 1},
        {"type": "stdout", "text": "hi\n", "timestamp": 1},
        {"type": "result", "png": "aGVsbG8=", "text": "<Figure>", "is_main_result": False},
        {"type": "result", "text": "2", "is_main_result": True},
        {"type": "exception", "name": "E", "value": "v", "traceback": "\x1b[31mTrace\x1b[39m"},
        {"type": "something_new"},
        {"type": "end_of_execution"},
    ):
        execution.take(event)
    assert execution.text == "2" and execution.stdout == ["hi\n"] and execution.finished
    assert execution.execution_count == 1 and execution.error is not None and not execution.timed_out
    text = execution_text(execution)
    assert text.startswith("error: E: v") and "hi" in text and "[png image: 8 characters of base64]" in text
    assert "Trace" in text and "\x1b" not in text


def test_the_bridge_stops_showing_a_flood_at_its_budget() -> None:
    run = kb.Execution(client=None, context_id="no-such-context", timeout=None, max_output=200)
    shown = [e for _ in range(10) for e in run.admit({"type": "stdout", "text": "x" * 50, "timestamp": 1})]
    assert [e["type"] for e in shown] == ["stdout", "stdout", "error"]
    assert shown[-1]["name"] == "OutputLimitExceeded" and run.flooded and run.interrupted_at is not None


class _OutStream:
    """ipykernel's OutStream as `bound_streams` sees it: write buffers, flush sends what is buffered."""

    def __init__(self) -> None:
        self.buffer = ""
        self.sent: list[str] = []

    def write(self, string: str) -> int:
        if not isinstance(string, str):
            raise TypeError(f"write() argument must be str, not {type(string)}")
        self.buffer += string
        return len(string)

    def flush(self) -> None:
        if self.buffer:
            self.sent.append(self.buffer)
            self.buffer = ""


def test_kernel_streams_send_a_flood_in_bounded_pieces() -> None:
    kl.bound_streams(_OutStream)
    kl.bound_streams(_OutStream)  # idempotent: not wrapped twice
    out = _OutStream()
    big = "y" * (5 * kl.STREAM_CHUNK + 7)
    assert out.write("a" * 10) == 10 and out.sent == []  # small output waits for ipykernel's timed flush
    assert out.write(big) == len(big)  # one huge write goes out in pieces, the first topping up the buffer
    for _ in range(200):
        print("x" * 1000, file=out)
    assert out.sent and all(len(message) <= kl.STREAM_CHUNK for message in out.sent)
    assert len(out.buffer) < kl.STREAM_CHUNK
    assert "".join(out.sent) + out.buffer == "a" * 10 + big + ("x" * 1000 + "\n") * 200  # nothing lost
    assert out.write("") == 0
    with pytest.raises(TypeError):
        out.write(b"bytes")  # type: ignore[arg-type]


def test_the_kernel_forgets_each_executions_outputs() -> None:
    class Events:
        def __init__(self) -> None:
            self.callbacks: dict[str, list[Any]] = {}

        def register(self, event: str, callback: Any) -> None:
            self.callbacks.setdefault(event, []).append(callback)

    class History:
        outputs = {3: ["x" * 100]}
        exceptions = {3: {"ename": "KeyboardInterrupt"}}
        output_hist = {3: "kept"}  # Out[3]: the user's own cache, kept

    class Shell:
        history_manager = History()
        events = Events()

    shell = Shell()
    kl.forget_outputs(shell)
    for callback in shell.events.callbacks["post_execute"]:
        callback()
    assert shell.history_manager.outputs == {} and shell.history_manager.exceptions == {}
    assert shell.history_manager.output_hist == {3: "kept"}
