"""The DevTools (CDP) WebSocket of a `browser` sandbox: one client bridged to Chromium inside (ADR 0064).

The node starts the guest's port relay (space/guest/port_relay.py, run by the template's python3) as a
process with stdin, through the sandbox's own channel: it starts Chromium if needed, prints Chromium's
/json/version document as its first line, then carries raw bytes to and from 127.0.0.1:9222 inside the
sandbox. Here the node speaks the WebSocket client side of that byte stream (websockets' sans-I/O protocol)
to Chromium's browser endpoint, and relays whole messages to and from the client: text as text, binary as
binary.

Invariants:
- Nothing outside the sandbox connects to the sandbox's network: the bytes travel in its channel, as a
  process's stdin/stdout do.
- The handshake with Chromium is made here with Host 127.0.0.1 and no Origin (Chromium refuses others);
  the client's own headers never reach Chromium.
- Whatever ends the bridge, both pumps are cancelled, the relay process is killed (a process outlives
  its call; a relay left behind would keep its Chromium session) and the call finished (shielded).
- A sandbox whose template has no browser ends the socket with 4409 and a typed error text frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import anyio
from fastapi import WebSocket
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from space.core import errors
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

CDP_PORT = 9222  # space.node.volumes.templates.BROWSER_CDP_PORT (the agent does not import volumes)
BROWSER_START = "/opt/space/browser/start"  # ... .BROWSER_START
RELAY = "/opt/space/lib/space/guest/port_relay.py"
MAX_VERSION_LINE = 64 << 10


def relay_argv(mode: str) -> list[str]:
    """The guest relay's command line (`version` or `pipe`)."""
    return ["/usr/bin/python3", "-I", "-S", "-B", RELAY, mode, str(CDP_PORT), BROWSER_START]


def no_browser(detail: str) -> errors.InvalidState:
    return errors.InvalidState(
        f"this sandbox has no browser answering (the `browser` template has one): {detail[:500]}",
        state="running",
        feature="browser",
    )


@router.websocket("/sandboxes/{sandbox_id}/cdp")
async def cdp(svc: Service, websocket: WebSocket, sandbox_id: str) -> None:
    await websocket.accept()
    try:
        _handle, session = await svc.session(sandbox_id)
        call = await session.channel.open(m.PROCESS_START, {"argv": relay_argv("pipe"), "stdin": True})
    except errors.SpaceError as exc:
        await _refuse(websocket, exc)
        return
    await _CdpBridge(svc, websocket, sandbox_id, session, call).run()


async def _refuse(websocket: WebSocket, error: errors.SpaceError) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_text(json.dumps(rest_errors.body_of(error) | {"type": "error"}))
        await websocket.close(code=4000 + rest_errors.status_for(error), reason=error.code)


class _CdpBridge:
    def __init__(
        self, svc: NodeService, websocket: WebSocket, sandbox_id: str, session: GuestSession, call: Call
    ) -> None:
        self.svc = svc
        self.session = session
        self.process_id = ""
        self.websocket = websocket
        self.sandbox_id = sandbox_id
        self.call = call
        self.protocol: ClientProtocol | None = None
        self.open = asyncio.Event()
        self.stderr = b""
        self.pending = b""  # the relay's first line (Chromium's /json/version), until complete
        self.fragments: list[bytes] = []
        self.fragment_text = False

    async def _flush(self) -> None:
        assert self.protocol is not None
        for chunk in self.protocol.data_to_send():
            if chunk:
                await self.call.send(chunk)
            else:  # the protocol's end of stream: the relay closes its TCP connection on stdin's EOF
                await self.call.send_eof()

    async def _handshake(self, line: bytes) -> None:
        try:
            url = json.loads(line)["webSocketDebuggerUrl"]
            path = "/" + url.split("/", 3)[3]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise no_browser("the DevTools endpoint did not name its WebSocket") from exc
        self.protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{CDP_PORT}{path}"), max_size=None)
        request = self.protocol.connect()
        self.protocol.send_request(request)
        await self._flush()

    async def _deliver(self, frame: Frame) -> None:
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self.fragments, self.fragment_text = [bytes(frame.data)], frame.opcode == Opcode.TEXT
        elif frame.opcode == Opcode.CONT:
            self.fragments.append(bytes(frame.data))
        else:
            return  # ping/pong/close: answered by the protocol itself
        if frame.fin:
            data = b"".join(self.fragments)
            self.fragments = []
            if self.fragment_text:
                await self.websocket.send_text(data.decode())
            else:
                await self.websocket.send_bytes(data)

    async def _stdout(self, data: bytes) -> bool:
        """One piece of the relay's stdout; False once the WebSocket with Chromium is closed."""
        if self.protocol is None:
            self.pending += data
            if b"\n" not in self.pending:
                if len(self.pending) > MAX_VERSION_LINE:
                    raise no_browser("the relay's first line is too long")
                return True
            line, _, data = self.pending.partition(b"\n")
            await self._handshake(line)
            if not data:
                return True
        assert self.protocol is not None
        self.protocol.receive_data(data)
        for event in self.protocol.events_received():
            if isinstance(event, Response):
                if self.protocol.handshake_exc is not None:
                    raise no_browser(f"Chromium refused the handshake: {self.protocol.handshake_exc}")
                self.open.set()
            elif isinstance(event, Frame):
                await self._deliver(event)
        await self._flush()
        return self.protocol.state != State.CLOSED

    async def output(self) -> None:
        """Chromium's messages to the client, until Chromium or the relay ends."""
        async for item in self.call.events():
            self.svc.touch(self.sandbox_id)
            if item.kind == FrameType.EVENT and item.event.get("type") == "started":
                self.process_id = str(item.event.get("process_id", ""))
            if item.kind != FrameType.DATA:
                continue
            if item.channel == Channel.STDERR:
                self.stderr = (self.stderr + item.data)[-4096:]
            elif item.channel == Channel.STDOUT and not await self._stdout(item.data):
                return
        if not self.open.is_set():
            raise no_browser(self.stderr.decode(errors="replace").strip() or "the relay ended")

    async def input(self) -> None:
        """The client's messages to Chromium, until the client disconnects."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.svc.touch(self.sandbox_id)
            await self.open.wait()
            assert self.protocol is not None
            if message.get("text") is not None:
                self.protocol.send_text(message["text"].encode())
            elif message.get("bytes") is not None:
                self.protocol.send_binary(message["bytes"])
            await self._flush()

    async def run(self) -> None:
        out_task = asyncio.create_task(self.output())
        in_task = asyncio.create_task(self.input())
        close_code = 1000
        try:
            await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
            failure = out_task.exception() if out_task.done() else None
            if isinstance(failure, errors.SpaceError):
                await _refuse(self.websocket, failure)
            elif failure is not None:
                log.error("cdp of %s failed", self.sandbox_id, exc_info=failure)
                close_code = 1011
        finally:
            for task in (in_task, out_task):
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(in_task, out_task, return_exceptions=True)
                # A process outlives its call: the relay must end, or Chromium keeps this client's session
                # (and its auto-attach, which pauses every new page until a debugger that left resumes it).
                if not self.call.done and self.process_id:
                    with contextlib.suppress(errors.SpaceError):
                        await self.session.signal(self.process_id, "SIGKILL")
                await finish_call(self.call, self.svc.settings.cancel_grace_s)
                with contextlib.suppress(Exception):
                    await self.websocket.close(code=close_code)
