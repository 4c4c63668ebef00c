"""Process routes of the data plane: exec (buffered or streamed), background processes, their output,
stdin, signals and terminal size.

Invariants:
- A streamed exec or an output stream is NDJSON whose first event is awaited before the headers go out
  (space.node.agent.streams); an abandoned stream cancels its daemon call, which detaches the process.
- stdin is streamed into the daemon as it arrives, never held whole.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

from fastapi import Query, Request, Response

from space.core import errors
from space.node.agent import rpc_models as rm
from space.node.agent import streams
from space.node.agent.routes.deps import Service, json_answer
from space.node.agent.rpc_auth import resource_router
from space.node.agent.streams import finish_call, ndjson_response
from space.protocol import methods as m

router = resource_router()


@router.post("/sandboxes/{sandbox_id}/exec", response_model=None)
async def exec_command(svc: Service, sandbox_id: str, body: rm.ExecRequest) -> Response:
    handle, session = await svc.session(sandbox_id)
    if body.stream:
        params = body.params()
        stdin = body.stdin
        params["stdin"] = stdin is not None
        call = await session.channel.open(m.PROCESS_START, params)
        if stdin is not None:
            try:
                if stdin:
                    await call.send(stdin)
                await call.send_eof()
            except BaseException:
                await finish_call(call, svc.settings.cancel_grace_s)
                raise
        return await ndjson_response(streams.relay(svc, handle.sandbox_id, call))
    result = await session.exec(
        body.command, env=body.env or None, cwd=body.cwd, user=body.user, timeout=body.timeout,
        stdin=body.stdin, max_output=body.max_output_bytes,
    )  # fmt: skip
    svc.touch(handle.sandbox_id)
    return json_answer(
        rm.ExecResponse(
            exit_code=result.exit_code,
            stdout_b64=base64.b64encode(result.stdout).decode(),
            stderr_b64=base64.b64encode(result.stderr).decode(),
            stdout=result.stdout.decode("utf-8", "replace"),
            stderr=result.stderr.decode("utf-8", "replace"),
            process_id=result.process_id,
            timed_out=result.timed_out,
            signal=result.signal,
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
        )
    )


@router.post("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessStarted, status_code=201)
async def start_process(svc: Service, sandbox_id: str, body: rm.ProcessStartRequest) -> rm.ProcessStarted:
    _, session = await svc.session(sandbox_id)
    started = await session.start_background(
        body.command, env=body.env or None, cwd=body.cwd, user=body.user, timeout=body.timeout,
        tag=body.tag, pty=(body.pty.rows, body.pty.cols) if body.pty else None, stdin=body.stdin,
    )  # fmt: skip
    return rm.ProcessStarted.model_validate(started)


@router.get("/sandboxes/{sandbox_id}/processes", response_model=rm.ProcessList)
async def list_processes(svc: Service, sandbox_id: str, env: bool = False) -> rm.ProcessList:
    """The sandbox's processes; `env`: with the variables each start asked for (the caller decides who may
    see them)."""
    _, session = await svc.session(sandbox_id)
    return rm.ProcessList(processes=await session.processes(env=env))


@router.get("/sandboxes/{sandbox_id}/processes/{process_id}/output", response_model=None)
async def process_output(
    svc: Service,
    sandbox_id: str,
    process_id: str,
    offset: Annotated[int, Query(ge=0)] = 0,
    follow: bool = True,
) -> Response:
    handle, session = await svc.session(sandbox_id)
    call = await session.channel.open(
        m.PROCESS_ATTACH, {"process_id": process_id, "offset": offset, "follow": follow}
    )
    return await ndjson_response(streams.relay(svc, handle.sandbox_id, call))


@router.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", response_model=rm.StdinWritten)
async def process_stdin(
    svc: Service, sandbox_id: str, process_id: str, request: Request, eof: bool = False
) -> rm.StdinWritten:
    handle, session = await svc.session(sandbox_id)
    call = await session.channel.open(m.PROCESS_INPUT, {"process_id": process_id, "eof": eof})
    result = await streams.write_body(svc, call, request.stream(), handle.sandbox_id)
    return rm.StdinWritten(written=int(result.get("written", 0)))


@router.post("/sandboxes/{sandbox_id}/processes/{process_id}/signal")
async def process_signal(
    svc: Service, sandbox_id: str, process_id: str, body: rm.SignalRequest
) -> dict[str, Any]:
    _, session = await svc.session(sandbox_id)
    await session.signal(process_id, body.signal)
    return {}


@router.post("/sandboxes/{sandbox_id}/processes/{process_id}/resize")
async def process_resize(
    svc: Service, sandbox_id: str, process_id: str, body: rm.ResizeRequest
) -> dict[str, Any]:
    """A process started without a PTY has no terminal to resize: 409 (state "no_terminal")."""
    _, session = await svc.session(sandbox_id)
    try:
        await session.resize(process_id, body.rows, body.cols)
    except errors.InvalidState as exc:
        if exc.details.get("guest_code") != "not_a_terminal":
            raise
        raise errors.InvalidState(
            exc.message, state="no_terminal", event="resize", guest_code="not_a_terminal"
        ) from exc
    return {}
