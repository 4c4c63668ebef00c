"""envd's `process.Process` service over SPACE's node calls (E2B's generated service class, our methods).

Invariants:
- Every RPC resolves the caller and its running sandbox first (`caller.target_of`): reading (List) needs a
  read-only key, anything else a member key or the sandbox's envd token.
- Start = `start_process` then `attach` from offset 0: the process lives in the daemon's table like any
  SPACE process (listable, attachable, signallable through SPACE's API too). `Connect-Timeout-Ms` on Start
  is the process's deadline (the daemon kills it then); a client that goes away does not kill it.
- Connect replays what the daemon still holds of the process's output, then follows it: a reconnecting
  client misses nothing the daemon kept (envd itself streams only what comes after).
- `stdin: false` gives the process /dev/null; `stdin: true` or absent a pipe for SendInput / CloseStdin
  (envd's backwards-compatible default).
- Unary RPCs that name a pid resolve it at call time (`process_events.process_of_pid`).
- Start, Connect and StreamInput hold one of the caller's stream slots while they last (`limits`).
- List shows each process's command, working directory and tag, and the variables its start asked for
  only to callers that may start processes (a read-only key sees an empty `envs`: they may hold secrets).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import Process

from space.controlplane.api.deps import Services
from space.controlplane.e2b.envd import process_events as ev
from space.controlplane.e2b.envd.caller import Target, target_of
from space.controlplane.e2b.envd.keepalive import interval_of, with_keepalive
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.e2b.envd.rpc_errors import translated, translated_stream
from space.core import errors

#: Longest input one SendInput / StreamInput message may carry (E2B's SDK sends small chunks).
MAX_INPUT_BYTES = 1 << 20


def _deadline_s(ctx: RequestContext[Any, Any]) -> float | None:
    timeout_ms = ctx.timeout_ms
    return timeout_ms / 1000.0 if timeout_ms and timeout_ms > 0 else None


def _pty_size(request: pb.StartRequest) -> tuple[int, int] | None:
    if request.pty is None:
        return None
    size = request.pty.size
    rows, cols = (size.rows, size.cols) if size is not None else (24, 80)
    if not (0 < rows <= 1000 and 0 < cols <= 1000):
        raise errors.InvalidArgument("PTY rows and cols must be 1..1000", field="pty")
    return rows, cols


def _input_bytes(value: pb.ProcessInput | None) -> tuple[str, bytes]:
    if value is None or value.input is None:
        raise errors.InvalidArgument("input (stdin or pty) is required", field="input")
    data = bytes(value.input.value)
    if len(data) > MAX_INPUT_BYTES:
        raise errors.TooLarge(f"input of {len(data)} bytes exceeds {MAX_INPUT_BYTES}")
    return str(value.input.field), data


class ProcessService(Process):
    def __init__(self, services: Services, limits: EnvdLimits) -> None:
        self.services = services
        self.limits = limits

    async def _target(self, ctx: RequestContext[Any, Any], *, mutating: bool = True) -> Target:
        return await target_of(self.services, self.limits, ctx.request_headers, mutating=mutating)

    def start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse], /
    ) -> AsyncIterator[pb.StartResponse]:
        return self._start(request, ctx)

    @translated_stream
    async def _start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse]
    ) -> AsyncIterator[pb.StartResponse]:
        config = request.process
        if config is None or not config.cmd:
            raise errors.InvalidArgument("process.cmd is required", field="process.cmd")
        target = await self._target(ctx)
        pty = _pty_size(request)
        stdin = request.stdin if request.has_field("stdin") else True
        started = await target.node.start_process(
            target.sandbox_id, [config.cmd, *config.args], env=dict(config.envs),
            cwd=config.cwd if config.has_field("cwd") and config.cwd else None, user=target.user,
            timeout=_deadline_s(ctx), tag=request.tag or None, pty=pty, stdin=stdin and pty is None,
        )  # fmt: skip
        if started.pid is None:
            raise errors.Internal("the sandbox's daemon did not report the process's pid")
        async with self.limits.stream(target.who):
            yield pb.StartResponse(event=ev.start_event(started.pid))
            events = self._follow(target, started.process_id, pty=pty is not None)
            async for event in with_keepalive(events, interval_of(ctx.request_headers), ev.keepalive_event):
                yield pb.StartResponse(event=event)

    def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse], /
    ) -> AsyncIterator[pb.ConnectResponse]:
        return self._connect(request, ctx)

    @translated_stream
    async def _connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse]
    ) -> AsyncIterator[pb.ConnectResponse]:
        pid = ev.selected_pid(request.process)
        target = await self._target(ctx, mutating=False)
        record = await ev.process_of_pid(target.node, target.sandbox_id, pid)
        async with self.limits.stream(target.who):
            yield pb.ConnectResponse(event=ev.start_event(pid))
            events = self._follow(target, str(record["process_id"]), pty=bool(record.get("pty")))
            async for event in with_keepalive(events, interval_of(ctx.request_headers), ev.keepalive_event):
                yield pb.ConnectResponse(event=event)

    def _follow(self, target: Target, process_id: str, *, pty: bool) -> AsyncIterator[pb.ProcessEvent]:
        items = target.node.attach(target.sandbox_id, process_id, offset=0, follow=True)
        return ev.process_events(items, pty=pty)

    @translated
    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[pb.ListRequest, pb.ListResponse], /
    ) -> pb.ListResponse:
        target = await self._target(ctx, mutating=False)
        # A process's variables may hold secrets: shown to callers that may run processes (member and up,
        # an envd token), not to read-only keys.
        env = target.who.role != "read-only"
        records = await target.node.list_processes(target.sandbox_id, env=env)
        return pb.ListResponse(processes=[ev.process_info(r) for r in records if r.get("running")])

    async def _process_id(self, target: Target, selector: pb.ProcessSelector | None) -> str:
        record = await ev.process_of_pid(target.node, target.sandbox_id, ev.selected_pid(selector))
        return str(record["process_id"])

    @translated
    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext[pb.SendInputRequest, pb.SendInputResponse], /
    ) -> pb.SendInputResponse:
        _kind, data = _input_bytes(request.input)
        target = await self._target(ctx)
        process_id = await self._process_id(target, request.process)
        await target.node.write_stdin(target.sandbox_id, process_id, data)
        return pb.SendInputResponse()

    @translated
    async def stream_input(
        self,
        request: AsyncIterator[pb.StreamInputRequest],
        ctx: RequestContext[pb.StreamInputRequest, pb.StreamInputResponse],
        /,
    ) -> pb.StreamInputResponse:
        target = await self._target(ctx)
        async with self.limits.stream(target.who):  # a client stream may last as long as its client likes
            await self._pump_input(target, request)
        return pb.StreamInputResponse()

    async def _pump_input(self, target: Target, request: AsyncIterator[pb.StreamInputRequest]) -> None:
        process_id: str | None = None
        async for message in request:
            event = message.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                process_id = await self._process_id(target, event.value.process)
                continue
            if process_id is None:
                raise errors.InvalidArgument("the first input message must be start", field="event")
            _kind, data = _input_bytes(event.value.input)
            await target.node.write_stdin(target.sandbox_id, process_id, data)

    @translated
    async def send_signal(
        self,
        request: pb.SendSignalRequest,
        ctx: RequestContext[pb.SendSignalRequest, pb.SendSignalResponse],
        /,
    ) -> pb.SendSignalResponse:
        number = int(request.signal) if request.signal is not None else 0
        if number not in (signal.SIGKILL, signal.SIGTERM):
            raise errors.InvalidArgument("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM", field="signal")
        target = await self._target(ctx)
        process_id = await self._process_id(target, request.process)
        await target.node.signal(target.sandbox_id, process_id, number)
        return pb.SendSignalResponse()

    @translated
    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[pb.UpdateRequest, pb.UpdateResponse], /
    ) -> pb.UpdateResponse:
        size = request.pty.size if request.pty is not None else None
        if size is None:
            return pb.UpdateResponse()  # envd: an update without a PTY size changes nothing
        if not (0 < size.rows <= 1000 and 0 < size.cols <= 1000):
            raise errors.InvalidArgument("PTY rows and cols must be 1..1000", field="pty")
        target = await self._target(ctx)
        process_id = await self._process_id(target, request.process)
        await target.node.resize(target.sandbox_id, process_id, size.rows, size.cols)
        return pb.UpdateResponse()

    @translated
    async def close_stdin(
        self,
        request: pb.CloseStdinRequest,
        ctx: RequestContext[pb.CloseStdinRequest, pb.CloseStdinResponse],
        /,
    ) -> pb.CloseStdinResponse:
        target = await self._target(ctx)
        process_id = await self._process_id(target, request.process)
        await target.node.write_stdin(target.sandbox_id, process_id, b"", eof=True)
        return pb.CloseStdinResponse()
