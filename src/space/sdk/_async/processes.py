"""A sandbox's background processes: start (optionally with a terminal), list, attach, signal, stdin, wait.

Invariants:
- A process outlives the call that started it; its output is kept by the sandbox and can be attached to
  from any offset, by any number of readers, as often as wanted.
- A process handle holds the server's answer in `.data`; its methods go through the sandbox's
  `processes`.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from space.core.errors import SpaceError
from space.sdk._async.http import AsyncSandboxRef
from space.sdk.models import (
    Command,
    ExecResult,
    OutputCollector,
    ProcessEvent,
    process_body,
    seg,
    signal_name,
)

__all__ = ["AsyncProcess", "AsyncProcesses"]


class AsyncProcessOwner(AsyncSandboxRef, Protocol):
    """A sandbox, as a process handle sees it."""

    processes: AsyncProcesses


class AsyncProcess:
    """A background process in a sandbox (`.id` is its process id, `.pid` its pid in the sandbox)."""

    def __init__(self, sandbox: AsyncProcessOwner, data: Mapping[str, Any]) -> None:
        self._sandbox = sandbox
        self.data: dict[str, Any] = dict(data)

    @property
    def id(self) -> str:
        return str(self.data["process_id"])

    @property
    def pid(self) -> int | None:
        value = self.data.get("pid")
        return int(value) if value is not None else None

    @property
    def running(self) -> bool | None:
        value = self.data.get("running")
        return None if value is None else bool(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, pid={self.pid!r})"

    def attach(self, offset: int = 0, *, follow: bool = True) -> AsyncIterator[ProcessEvent]:
        return self._sandbox.processes.attach(self.id, offset=offset, follow=follow)

    async def signal(self, sig: int | str = "SIGTERM") -> None:
        await self._sandbox.processes.signal(self.id, sig)

    async def write_stdin(self, data: bytes, *, eof: bool = False) -> int:
        return await self._sandbox.processes.write_stdin(self.id, data, eof=eof)

    async def close_stdin(self) -> None:
        await self._sandbox.processes.write_stdin(self.id, b"", eof=True)

    async def resize(self, rows: int, cols: int) -> None:
        await self._sandbox.processes.resize(self.id, rows, cols)

    async def wait(self) -> ExecResult:
        """Follow the output from the start until the process exits; the output is collected."""
        output = OutputCollector()
        async for event in self.attach(0):
            if event.type == "exit":
                return output.result(event, self.id)
            output.keep(event)
        raise SpaceError("the output stream ended before the process's exit", process_id=self.id)


def _process_id(process: AsyncProcess | str | int) -> str:
    return process.id if isinstance(process, AsyncProcess) else str(process)


class AsyncProcesses:
    def __init__(self, sandbox: AsyncProcessOwner) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/processes"

    async def start(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        tag: str | None = None,
        pty: tuple[int, int] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncProcess:
        """Start a background process (it outlives this call); `pty=(rows, cols)` gives it a terminal."""
        body = process_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, tag=tag, pty=pty)
        answer = await self._http.json("POST", self._base, json_body=body, idempotency_key=idempotency_key)
        return AsyncProcess(self._sandbox, answer)

    async def list(self) -> builtins.list[AsyncProcess]:
        answer = await self._http.json("GET", self._base)
        return [AsyncProcess(self._sandbox, item) for item in answer.get("processes", [])]

    async def attach(
        self, process: AsyncProcess | str | int, *, offset: int = 0, follow: bool = True
    ) -> AsyncIterator[ProcessEvent]:
        """The process's output from `offset`: an "attached" event, then stdout/stderr events, then "exit"
        (with follow=False, only what is already there)."""
        async with self._http.stream(
            "GET",
            f"{self._base}/{seg(_process_id(process))}/output",
            params={"offset": offset, "follow": follow},
            timeout=self._http.timeout(None),
        ) as response:
            async for raw in self._http.iter_ndjson(response):
                yield ProcessEvent.from_wire(raw)

    async def signal(self, process: AsyncProcess | str | int, sig: int | str = "SIGTERM") -> None:
        await self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/signal",
            json_body={"signal": signal_name(sig)},
        )

    async def write_stdin(self, process: AsyncProcess | str | int, data: bytes, *, eof: bool = False) -> int:
        answer = await self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/stdin",
            params={"eof": eof},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(answer.get("written", 0)) if isinstance(answer, dict) else 0

    async def resize(self, process: AsyncProcess | str | int, rows: int, cols: int) -> None:
        """Set a PTY process's terminal size (1-1000 each); a process without a PTY is InvalidState."""
        await self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/resize",
            json_body={"rows": rows, "cols": cols},
        )
