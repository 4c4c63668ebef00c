"""The terminal WebSocket of the data plane: a process with a PTY, bridged to one client.

Client binary frames are the terminal's input and its output goes back as binary frames; a client text
frame {"resize": [rows, cols]} resizes it (anything else earns a {"type": "warning"} and is ignored). The
server also sends text frames {"type": "started", ...} and {"type": "exit", ...} (or {"type": "error",
"error": {...}}) and then closes (4000 + status on error, 1011 on a bug, else 1000).

Invariants:
- A client that goes away while the process runs hangs up the terminal: SIGHUP to its process group,
  repeated after each of `pty_hangup_grace_s` (a shell still setting itself up can miss the first); a
  process that ignores SIGHUP on purpose keeps running (detached, listed, attachable by id).
- Whatever ends the bridge, both pumps are cancelled and the daemon call finished (shielded), so no call is
  left open in the channel.
- Every frame either way records the sandbox's activity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import anyio
from fastapi import WebSocket
from pydantic import ValidationError

from space.core import errors
from space.node.agent import rpc_models as rm
from space.node.agent.channel_call import Call
from space.node.agent.guest import GuestSession
from space.node.agent.routes.deps import Service
from space.node.agent.rpc_auth import resource_router
from space.node.agent.service import NodeService
from space.node.agent.streams import finish_call
from space.protocol import Channel, FrameType
from space.protocol import methods as m
from space.rest import errors as rest_errors

log = logging.getLogger("space.node.rpc")

router = resource_router()


@router.websocket("/sandboxes/{sandbox_id}/pty")
async def pty(
    svc: Service,
    websocket: WebSocket,
    sandbox_id: str,
    *,
    rows: int = 24,
    cols: int = 80,
    cmd: str = "/bin/bash",
) -> None:
    await websocket.accept()
    try:
        size = rm.PtySize(rows=rows, cols=cols)
        handle, session = await svc.session(sandbox_id)
        call = await session.channel.open(
            m.PROCESS_START, {"cmd": cmd, "pty": size.model_dump(), "stdin": True}
        )
    except (errors.SpaceError, ValidationError) as exc:
        error = rest_errors.request_invalid(exc) if isinstance(exc, ValidationError) else exc
        with contextlib.suppress(Exception):
            await _send_error(websocket, error)
            await websocket.close(code=4000 + rest_errors.status_for(error), reason=error.code)
        return
    await _PtyBridge(svc, websocket, handle.sandbox_id, session, call).run()


async def _send_error(websocket: WebSocket, error: errors.SpaceError) -> None:
    await websocket.send_text(json.dumps(rest_errors.body_of(error) | {"type": "error"}))


class _PtyBridge:
    """One terminal session: output and input pumped concurrently until either ends."""

    def __init__(
        self, svc: NodeService, websocket: WebSocket, sandbox_id: str, session: GuestSession, call: Call
    ) -> None:
        self.svc = svc
        self.websocket = websocket
        self.sandbox_id = sandbox_id
        self.session = session
        self.call = call
        self.started = asyncio.Event()
        self.process_id = ""

    async def output(self) -> None:
        """The process's output and events to the client, then its exit."""
        async for item in self.call.events():
            self.svc.touch(self.sandbox_id)
            if item.kind == FrameType.DATA and item.channel in (Channel.STDOUT, Channel.STDERR):
                await self.websocket.send_bytes(item.data)
            elif item.kind == FrameType.EVENT:
                if item.event.get("type") == "started":
                    self.process_id = str(item.event.get("process_id", ""))
                    self.started.set()
                await self.websocket.send_text(json.dumps(item.event))
        result = await self.call.result()
        await self.websocket.send_text(json.dumps({"type": "exit", **result}))

    async def input(self) -> None:
        """The client's frames to the process (bytes) or its terminal size (text), until it disconnects."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.svc.touch(self.sandbox_id)
            if message.get("bytes"):
                await self.call.send(message["bytes"])
            elif message.get("text"):
                await self.resize(message["text"])

    async def resize(self, text: str) -> None:
        try:
            request = json.loads(text)
            new_rows, new_cols = request["resize"]
            resize = rm.ResizeRequest(rows=new_rows, cols=new_cols)
        except (ValueError, KeyError, TypeError, ValidationError):
            await self.websocket.send_text(
                json.dumps({"type": "warning", "message": 'expected {"resize": [rows, cols]}'})
            )
            return
        await self.started.wait()
        await self.session.resize(self.process_id, resize.rows, resize.cols)

    async def run(self) -> None:
        out_task = asyncio.create_task(self.output())
        in_task = asyncio.create_task(self.input())
        close_code = 1000
        try:
            await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
            close_code = await self.report(out_task, in_task)
            if not self.call.done and self.process_id:
                await self.hang_up()
        finally:
            for task in (in_task, out_task):
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(in_task, out_task, return_exceptions=True)
                await finish_call(self.call, self.svc.settings.cancel_grace_s)
                with contextlib.suppress(Exception):
                    await self.websocket.close(code=close_code)

    async def report(self, out_task: asyncio.Task[None], in_task: asyncio.Task[None]) -> int:
        """The close code for how the pumps ended, after telling the client of a failure."""
        failure = out_task.exception() if out_task.done() else None
        if isinstance(failure, errors.SpaceError):
            with contextlib.suppress(Exception):
                await _send_error(self.websocket, failure)
            return 4000 + rest_errors.status_for(failure)
        if failure is not None and not in_task.done():
            # Not the client going away (that ends in_task, and sends then fail): a bug worth a log line.
            log.error("pty of %s failed", self.sandbox_id, exc_info=failure)
            return 1011
        return 1000

    async def hang_up(self) -> None:
        """The client hung up while the process runs: so does the terminal, as a closed one would."""
        for grace in self.svc.settings.pty_hangup_grace_s:
            with contextlib.suppress(errors.SpaceError):
                await self.session.signal(self.process_id, "SIGHUP")
            with contextlib.suppress(TimeoutError, errors.SpaceError):
                await asyncio.wait_for(self.call.result(), grace)
            if self.call.done:
                break
