"""Running code in a sandbox's Jupyter kernels: the control plane's side of the kernel bridge (ADR 0058),
shared by SPACE's `POST /v1/sandboxes/{id}/code` and the E2B front's port-49999 routes.

Invariants:
- The control plane never talks to the sandbox's network: every call runs the template's bridge program
  (`space.node.code_interpreter.spec.BRIDGE_ARGV`) through the node's exec calls, the request as JSON on
  the process's stdin, the answers as JSON lines on its stdout. An execution is a streamed (foreground)
  exec, so the daemon holds the bridge's output for it: a flooding cell is slowed down, never loses lines.
- Context ids fullmatch CONTEXT_ID before they reach the bridge (which checks them again).
- An execution's output is bounded: a line longer than MAX_LINE_BYTES or more than MAX_OUTPUT_BYTES in all
  ends it (the bridge is told to interrupt the kernel, and the caller gets an `OutputLimitExceeded` error
  event then `end_of_execution`).
- An execution never outlives its caller: when the consumer of `execute` stops (a client that goes away,
  a cancelled request), the bridge gets SIGTERM (it interrupts the kernel) and, DRAIN_S later, SIGKILL;
  every execution also carries a deadline (MAX_EXECUTION_S at most) after which the bridge interrupts
  the kernel itself.
- A sandbox whose template has no bridge answers `conflict` (409) naming the template.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

from space.core import errors
from space.node.code_interpreter.spec import BRIDGE_ARGV, BRIDGE_PATH
from space.node.rpc_client import NodeClient

CONTEXT_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
DEFAULT_CONTEXT: Final = "default"
MAX_LINE_BYTES: Final = 4 << 20
MAX_OUTPUT_BYTES: Final = 20 << 20
MAX_CODE_BYTES: Final = 1 << 20
MAX_ENV_VARS: Final = 64
MAX_EXECUTION_S: Final = 3600.0
#: A context call (start a kernel, list, remove, restart) takes at most this long.
CALL_TIMEOUT_S: Final = 180.0
DRAIN_S: Final = 8.0
_CODES: Final[dict[str, type[errors.SpaceError]]] = {
    "not_found": errors.NotFound,
    "invalid_argument": errors.InvalidArgument,
    "deadline_exceeded": errors.Timeout,
}
#: Strong references to the clean-ups of abandoned executions (a task nobody holds may be collected).
_CLEANUPS: set[asyncio.Task[None]] = set()


def check_context_id(value: str, field: str = "context_id") -> str:
    if not isinstance(value, str) or CONTEXT_ID.fullmatch(value) is None:
        raise errors.InvalidArgument(f"invalid {field}", field=field)
    return value


def _bridge_error(answer: Mapping[str, Any]) -> errors.SpaceError:
    problem = answer.get("error") or {}
    kind = _CODES.get(str(problem.get("code")), errors.Internal)
    return kind(str(problem.get("message", "the kernel bridge failed"))[:1000])


def _missing_bridge(stderr: str, template: str) -> errors.SpaceError | None:
    if BRIDGE_PATH in stderr and ("No such file" in stderr or "can't open" in stderr):
        return errors.Conflict(
            f"template {template!r} has no code interpreter (use the code-interpreter template)"
        )
    return None


class KernelBridge:
    """The bridge of one sandbox, run through its node."""

    def __init__(self, node: NodeClient, sandbox_id: str, template: str) -> None:
        self.node = node
        self.sandbox_id = sandbox_id
        self.template = template

    async def call(self, command: str, request: Mapping[str, Any]) -> Any:
        """One context call: the bridge's `ok` value, or its error as a typed error."""
        result = await self.node.exec(
            self.sandbox_id, [*BRIDGE_ARGV, command], timeout=CALL_TIMEOUT_S,
            stdin=json.dumps(dict(request)).encode(),
        )  # fmt: skip
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if not lines:
            missing = _missing_bridge(result.stderr, self.template)
            if missing is not None:
                raise missing
            raise errors.Internal(f"the kernel bridge answered nothing: {result.stderr[-500:]}")
        answer = json.loads(lines[-1])
        if "ok" not in answer:
            raise _bridge_error(answer)
        return answer["ok"]

    async def execute(
        self,
        code: str,
        *,
        context_id: str | None,
        env_vars: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Start an execution; raises before yielding anything if it cannot start (unknown context, no
        bridge), then yields its events (E2B's shapes) up to and including `end_of_execution`."""
        request = execute_request(code, context_id, env_vars, timeout)
        # A foreground exec: the daemon holds the bridge's output for this reader (a fast cell is slowed
        # down, never loses output), and the first event names the process for the clean-up.
        stream = self.node.exec_stream(
            self.sandbox_id, [*BRIDGE_ARGV, "execute"], stdin=json.dumps(request).encode()
        )
        started = await anext(stream, None)
        process_id = str((started or {}).get("process_id") or "")
        if not process_id:
            raise errors.Internal("the sandbox did not start the kernel bridge")
        try:
            lines = _Lines(stream)
            first = await anext(lines, None)
            if first is None or "ok" not in first:
                raise self._start_error(first, lines)
        except BaseException:
            self._abandon(process_id)
            raise
        return self._events(process_id, lines)

    def _start_error(self, first: dict[str, Any] | None, lines: AsyncIterator[dict[str, Any]]) -> Exception:
        if first is not None and "error" in first:
            return _bridge_error(first)
        stderr = getattr(lines, "stderr_tail", "")
        return _missing_bridge(stderr, self.template) or errors.Internal("the kernel bridge did not start")

    async def _events(
        self, process_id: str, lines: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        finished = False
        try:
            async for item in lines:
                yield item
                if item.get("type") == "end_of_execution":
                    finished = True
                    return
            yield {"type": "error", "name": "KernelBridgeError", "value": "the execution ended early",
                   "traceback": ""}  # fmt: skip
            yield {"type": "end_of_execution"}
        except errors.TooLarge as exc:
            yield {"type": "error", "name": "OutputLimitExceeded", "value": str(exc), "traceback": ""}
            yield {"type": "end_of_execution"}
        except errors.SpaceError as exc:  # the node call failed mid-way: the caller still gets an ending
            yield {"type": "error", "name": "KernelBridgeError", "value": str(exc), "traceback": ""}
            yield {"type": "end_of_execution"}
        finally:
            if not finished:
                self._abandon(process_id)

    def _abandon(self, process_id: str) -> None:
        """SIGTERM now (the bridge interrupts the kernel), SIGKILL after DRAIN_S; never awaited by the
        caller, whose request may be gone already."""
        task = asyncio.get_running_loop().create_task(self._stop(process_id))
        _CLEANUPS.add(task)
        task.add_done_callback(_CLEANUPS.discard)

    async def _stop(self, process_id: str) -> None:
        for number, wait in ((signal.SIGTERM, DRAIN_S), (signal.SIGKILL, 0.0)):
            try:
                await self.node.signal(self.sandbox_id, process_id, int(number))
            except errors.SpaceError:
                return  # gone already (or the sandbox is): nothing left to stop
            await asyncio.sleep(wait)


def execute_request(
    code: str, context_id: str | None, env_vars: Mapping[str, str] | None, timeout: float | None
) -> dict[str, Any]:
    """The bridge's execute request, checked."""
    if len(code.encode()) > MAX_CODE_BYTES:
        raise errors.TooLarge(f"code of more than {MAX_CODE_BYTES} bytes", field="code", limit=MAX_CODE_BYTES)
    env = dict(env_vars or {})
    if len(env) > MAX_ENV_VARS or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise errors.InvalidArgument(f"env_vars: at most {MAX_ENV_VARS} string values", field="env_vars")
    deadline = MAX_EXECUTION_S if timeout is None or timeout <= 0 else min(float(timeout), MAX_EXECUTION_S)
    return {
        "code": code,
        "context_id": check_context_id(context_id) if context_id else DEFAULT_CONTEXT,
        "env_vars": env,
        "timeout": deadline,
        # The bridge stops a flood at the kernel below the front's own bound, which stays as the backstop.
        "max_output_bytes": MAX_OUTPUT_BYTES - MAX_LINE_BYTES,
    }


class _Lines:
    """The bridge's stdout as JSON objects, one per line, within MAX_LINE_BYTES and MAX_OUTPUT_BYTES;
    keeps the tail of its stderr (for errors)."""

    def __init__(self, items: AsyncIterator[dict[str, Any]]) -> None:
        self.items = items
        self.buffer = b""
        self.total = 0
        self.pending: list[dict[str, Any]] = []
        self.stderr_tail = ""
        self.done = False

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self.pending:
            if self.done:
                raise StopAsyncIteration
            item = await anext(self.items, None)
            if item is None or item.get("type") in ("exit", "end"):
                self.done = True
                continue
            self._take(item)
        return self.pending.pop(0)

    def _take(self, item: dict[str, Any]) -> None:
        data = base64.b64decode(item.get("data_b64", "")) if "data_b64" in item else b""
        if item.get("type") == "stderr":
            self.stderr_tail = (self.stderr_tail + data.decode("utf-8", "replace"))[-2000:]
            return
        if item.get("type") != "stdout":
            return
        self.total += len(data)
        if self.total > MAX_OUTPUT_BYTES:
            raise errors.TooLarge(f"the execution's output exceeds {MAX_OUTPUT_BYTES} bytes")
        if b"\n" not in data:  # a long line in many chunks: no re-split of what is buffered
            self.buffer += data
            if len(self.buffer) > MAX_LINE_BYTES:
                raise errors.TooLarge(f"an output of more than {MAX_LINE_BYTES} bytes")
            return
        *complete, self.buffer = (self.buffer + data).split(b"\n")
        if len(self.buffer) > MAX_LINE_BYTES:
            raise errors.TooLarge(f"an output of more than {MAX_LINE_BYTES} bytes")
        for line in complete:
            if line.strip():
                self.pending.append(_parsed(line))


def _parsed(line: bytes) -> dict[str, Any]:
    try:
        found = json.loads(line)
    except ValueError as exc:
        raise errors.Internal("the kernel bridge wrote a malformed line") from exc
    if not isinstance(found, dict):
        raise errors.Internal("the kernel bridge wrote a malformed line")
    return found
