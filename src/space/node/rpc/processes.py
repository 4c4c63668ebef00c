"""The data plane's processes over RPC: exec (collected or streamed), background processes, stdin, PTY.

Invariants:
- Output is never buffered whole here: a streamed exec and `attach` come back as NDJSON events, one dict at
  a time; stdin goes out from bytes or an async iterable.
- A command is described once (space.protocol.commands.command_params), as the guest receives it.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
from websockets.asyncio.client import connect as ws_connect

from space.core import request_ids
from space.node.agent import rpc_models as rm
from space.node.rpc.transport import API_PREFIX, STREAM_TIMEOUT, Body, NodeTransport, sandbox_path
from space.protocol.commands import command_params


def _stdin(stdin: bytes | None) -> dict[str, Any]:
    return {} if stdin is None else {"stdin_b64": base64.b64encode(stdin).decode()}


class ProcessCalls(NodeTransport):
    async def exec(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> rm.ExecResponse:
        body = command_params(command, env, cwd, user, timeout) | _stdin(stdin)
        answer = await self._request(
            "POST",
            sandbox_path(sandbox_id, "exec"),
            json_body=body,
            timeout=STREAM_TIMEOUT,
            sandbox_id=sandbox_id,
        )
        return rm.ExecResponse.model_validate(answer)

    async def exec_stream(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: started, stdout/stderr (data_b64), then exit."""
        body = command_params(command, env, cwd, user, timeout) | _stdin(stdin) | {"stream": True}
        path = sandbox_path(sandbox_id, "exec")
        async for item in self._lines("POST", path, json_body=body, sandbox_id=sandbox_id):
            yield item

    async def start_process(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        tag: str | None = None,
        pty: tuple[int, int] | None = None,
        stdin: bool = False,
    ) -> rm.ProcessStarted:
        body = command_params(command, env, cwd, user, timeout) | {"stdin": stdin}
        if tag is not None:
            body["tag"] = tag
        if pty is not None:
            body["pty"] = {"rows": pty[0], "cols": pty[1]}
        path = sandbox_path(sandbox_id, "processes")
        answer = await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)
        return rm.ProcessStarted.model_validate(answer)

    async def list_processes(self, sandbox_id: str, *, env: bool = False) -> list[dict[str, Any]]:
        """The sandbox's processes (each with its `cwd`); `env`: also the variables each start asked for."""
        path = sandbox_path(sandbox_id, "processes")
        params = {"env": True} if env else None
        answer = await self._request("GET", path, params=params, sandbox_id=sandbox_id)
        return rm.ProcessList.model_validate(answer).processes

    async def attach(
        self, sandbox_id: str, process_id: str, *, offset: int = 0, follow: bool = True
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: attached {offset, truncated}, stdout/stderr, then exit (end if not following)."""
        path = sandbox_path(sandbox_id, "processes", process_id, "output")
        params = {"offset": offset, "follow": follow}
        async for item in self._lines("GET", path, params=params, sandbox_id=sandbox_id):
            yield item

    async def write_stdin(self, sandbox_id: str, process_id: str, data: Body, *, eof: bool = False) -> int:
        path = sandbox_path(sandbox_id, "processes", process_id, "stdin")
        answer = await self._request(
            "POST", path, params={"eof": eof}, content=data, timeout=STREAM_TIMEOUT, sandbox_id=sandbox_id
        )
        return int(answer["written"])

    async def signal(self, sandbox_id: str, process_id: str, signal: str | int = "SIGTERM") -> None:
        path = sandbox_path(sandbox_id, "processes", process_id, "signal")
        await self._request("POST", path, json_body={"signal": signal}, sandbox_id=sandbox_id)

    async def resize(self, sandbox_id: str, process_id: str, rows: int, cols: int) -> None:
        path = sandbox_path(sandbox_id, "processes", process_id, "resize")
        await self._request("POST", path, json_body={"rows": rows, "cols": cols}, sandbox_id=sandbox_id)

    def pty(self, sandbox_id: str, *, rows: int = 24, cols: int = 80, cmd: str = "/bin/bash") -> ws_connect:
        """`async with client.pty(id) as ws:` — send bytes (input) or {"resize": [rows, cols]} as text;
        receive bytes (output) and text events ({"type": "started"|"exit"|"error", ...})."""
        base = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        query = httpx.QueryParams({"rows": rows, "cols": cols, "cmd": cmd})
        return ws_connect(
            f"{base}{API_PREFIX}{sandbox_path(sandbox_id, 'pty')}?{query}",
            additional_headers={
                "Authorization": f"Bearer {self._token}",
                **self.capability(sandbox_id),
                **request_ids.outgoing_headers(),
            },
            max_size=None,
        )

    def cdp(self, sandbox_id: str) -> ws_connect:
        """`async with client.cdp(id) as ws:` — the DevTools protocol of Chromium in a `browser` sandbox
        (ADR 0064): whole messages both ways; a sandbox without a browser ends it with 4409."""
        base = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return ws_connect(
            f"{base}{API_PREFIX}{sandbox_path(sandbox_id, 'cdp')}",
            additional_headers={
                "Authorization": f"Bearer {self._token}",
                **self.capability(sandbox_id),
                **request_ids.outgoing_headers(),
            },
            max_size=None,
        )
