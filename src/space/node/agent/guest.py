"""Typed operations on a sandbox's daemon: processes and files, over a GuestChannel.

Invariants:
- Large transfers are streamed in protocol-sized chunks in both directions; nothing here holds a whole file
  in memory unless the caller asked for `bytes`.
- A collected (non-streamed) exec keeps at most `max_output` bytes per stream (DEFAULT_OUTPUT_LIMIT unless
  the caller says otherwise, never more than MAX_OUTPUT_LIMIT); the rest is read and dropped, so the process
  runs to its end, and the result says which stream was truncated.
- A consumer that leaves a streamed read early abandons the call (space.node.agent.channel): the daemon
  gets a CANCEL and nothing more is queued for it.
- Every method raises space.core errors only (translated at the channel boundary).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from space.core import errors
from space.node.agent.channel import GuestChannel
from space.node.agent.channel_call import Call
from space.node.agent.rpc_models import EXEC_OUTPUT_DEFAULT, EXEC_OUTPUT_MAX
from space.protocol import CHUNK_SIZE, Channel, FrameType
from space.protocol import methods as m
from space.protocol.commands import command_params

OutputCallback = Callable[[Channel, bytes], None]
DEFAULT_OUTPUT_LIMIT = EXEC_OUTPUT_DEFAULT  # bytes kept per stream of a collected exec by default
MAX_OUTPUT_LIMIT = EXEC_OUTPUT_MAX  # the most a request may ask for


@dataclass
class ExecResult:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    process_id: str = ""
    signal: int | None = None
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class GuestSession:
    def __init__(self, channel: GuestChannel) -> None:
        self.channel = channel

    # -- system ----------------------------------------------------------------------------------------
    async def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        return await self.channel.call(m.SYS_PING, timeout=timeout)

    async def info(self) -> dict[str, Any]:
        return await self.channel.call(m.SYS_INFO)

    async def sync(self) -> None:
        await self.channel.call(m.SYS_SYNC, timeout=120.0)

    async def reseed(self) -> None:
        await self.channel.call(m.SYS_RESEED, {"entropy": secrets.token_hex(64)})

    async def configure(self, env: Mapping[str, str]) -> None:
        await self.channel.call(m.SYS_CONFIGURE, {"env": dict(env)})

    # -- processes ----------------------------------------------------------------------------------------
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_output: OutputCallback | None = None,
        max_output: int | None = DEFAULT_OUTPUT_LIMIT,
    ) -> ExecResult:
        """Run a command to completion; output is collected up to `max_output` bytes per stream (None:
        MAX_OUTPUT_LIMIT) and all of it is also streamed to `on_output`."""
        params = command_params(command, env, cwd, user, timeout)
        params["stdin"] = stdin is not None
        call = await self.channel.open(m.PROCESS_START, params)
        try:
            if stdin is not None:
                await call.send(stdin)
                await call.send_eof()
        except BaseException:
            await call.cancel()
            raise
        return await self._collect(call, on_output, max_output)

    async def _collect(
        self, call: Call, on_output: OutputCallback | None, max_output: int | None = DEFAULT_OUTPUT_LIMIT
    ) -> ExecResult:
        limit = MAX_OUTPUT_LIMIT if max_output is None else max(0, min(max_output, MAX_OUTPUT_LIMIT))
        out = bytearray()
        err = bytearray()
        truncated = {Channel.STDOUT: False, Channel.STDERR: False}
        process_id = ""
        async for item in call.events():
            if item.kind == FrameType.DATA and item.channel is not None:
                stream = Channel.STDERR if item.channel == Channel.STDERR else Channel.STDOUT
                buf = err if stream == Channel.STDERR else out
                room = limit - len(buf)
                if len(item.data) > room:
                    truncated[stream] = True
                if room > 0:
                    buf += item.data[:room]
                if on_output is not None:
                    on_output(item.channel, item.data)
            elif item.kind == FrameType.EVENT and item.event.get("type") == m.EVENT_STARTED:
                process_id = str(item.event.get("process_id", ""))
        result = await call.result()
        return ExecResult(
            exit_code=result.get("exit_code"),
            stdout=bytes(out),
            stderr=bytes(err),
            process_id=str(result.get("process_id", process_id)),
            signal=result.get("signal"),
            timed_out=bool(result.get("timed_out", False)),
            extra=result,
            stdout_truncated=truncated[Channel.STDOUT],
            stderr_truncated=truncated[Channel.STDERR],
        )

    async def start_background(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        tag: str | None = None,
        pty: tuple[int, int] | None = None,
        stdin: bool = False,
    ) -> dict[str, Any]:
        params = command_params(command, env, cwd, user, timeout)
        params.update(background=True, stdin=stdin)
        if tag is not None:
            params["tag"] = tag
        if pty is not None:
            params["pty"] = {"rows": pty[0], "cols": pty[1]}
        return await self.channel.call(m.PROCESS_START, params)

    async def attach(
        self,
        process_id: str,
        *,
        offset: int = 0,
        follow: bool = True,
        on_output: OutputCallback | None = None,
        max_output: int | None = DEFAULT_OUTPUT_LIMIT,
    ) -> ExecResult:
        call = await self.channel.open(
            m.PROCESS_ATTACH, {"process_id": process_id, "offset": offset, "follow": follow}
        )
        return await self._collect(call, on_output, max_output)

    async def processes(self, *, env: bool = False) -> list[dict[str, Any]]:
        """The daemon's process table; with `env`, each entry also carries the variables its start asked
        for (kept off by default: SPACE's own list is readable by read-only keys)."""
        result = await self.channel.call(m.PROCESS_LIST, {"env": True} if env else {})
        return list(result.get("processes", []))

    async def signal(self, process_id: str, signal: int | str) -> None:
        await self.channel.call(m.PROCESS_SIGNAL, {"process_id": process_id, "signal": signal})

    async def write_stdin(self, process_id: str, data: bytes, *, eof: bool = False) -> None:
        call = await self.channel.open(m.PROCESS_INPUT, {"process_id": process_id, "eof": eof})
        try:
            if data:
                await call.send(data)
            await call.send_eof()
        except BaseException:
            await call.cancel()
            raise
        await call.result()

    async def resize(self, process_id: str, rows: int, cols: int) -> None:
        await self.channel.call(m.PROCESS_RESIZE, {"process_id": process_id, "rows": rows, "cols": cols})

    # -- files ---------------------------------------------------------------------------------------------
    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], *, mode: int | None = None, append: bool = False
    ) -> int:
        params: dict[str, Any] = {"path": path, "append": append}
        if mode is not None:
            params["mode"] = mode
        call = await self.channel.open(m.FILES_WRITE, params)
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                await call.send(bytes(data))
            else:
                async for chunk in data:
                    if call.done:
                        break  # the guest already refused (e.g. disk full): stop sending
                    await call.send(chunk)
            if not call.done:
                await call.send_eof()
        except errors.ChannelError:
            if not call.done:
                raise
        except BaseException:
            await call.cancel()  # a stalled guest or a cancelled request: the write must not stay open
            raise
        result = await call.result()
        return int(result.get("size", 0))

    async def read_file_stream(
        self, path: str, *, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes]:
        call = await self.channel.open(m.FILES_READ, {"path": path, "offset": offset, "length": length})
        try:
            async for item in call.events():
                if item.kind == FrameType.DATA:
                    yield item.data
            await call.result()
        finally:
            if not call.done:
                await call.cancel()  # the consumer left early: stop the daemon's read

    async def read_file(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        buf = bytearray()
        async for chunk in self.read_file_stream(path, offset=offset, length=length):
            buf.extend(chunk)
        return bytes(buf)

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        call = await self.channel.open(m.FILES_LIST, {"path": path})
        entries: list[dict[str, Any]] = []
        async for item in call.events():  # large listings arrive in batches before the result
            if item.kind == FrameType.EVENT and item.event.get("type") == m.EVENT_ENTRIES:
                entries.extend(item.event.get("entries", []))
        entries.extend((await call.result()).get("entries", []))
        return entries

    async def stat(self, path: str) -> dict[str, Any]:
        return await self.channel.call(m.FILES_STAT, {"path": path})

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        await self.channel.call(m.FILES_MKDIR, {"path": path, "parents": parents, "mode": mode})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self.channel.call(m.FILES_REMOVE, {"path": path, "recursive": recursive}, timeout=600.0)

    async def rename(self, src: str, dst: str) -> None:
        await self.channel.call(m.FILES_RENAME, {"src": src, "dst": dst})

    async def chmod(self, path: str, mode: int) -> None:
        await self.channel.call(m.FILES_CHMOD, {"path": path, "mode": mode})

    async def watch(self, path: str, *, recursive: bool = False) -> Call:
        """Open a watch; iterate `call.events()` for {"type": "changes"} events, `call.cancel()` to stop."""
        return await self.channel.open(m.FILES_WATCH, {"path": path, "recursive": recursive})


async def chunked(data: bytes, size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])
