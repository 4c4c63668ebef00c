"""Small helpers for tests that drive real sandboxes through a NodeAgent (async, on the node's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from space.core import errors
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.guest import GuestSession
from space.protocol import FrameType
from space.protocol import methods as m

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > {path}; sleep 0.1; done"


@contextlib.asynccontextmanager
async def new_sandbox(agent: NodeAgent, **kwargs: Any) -> AsyncIterator[SandboxHandle]:
    """A sandbox that is deleted when the block ends, however it ends."""
    handle = await agent.create(kwargs.pop("template", "python"), **kwargs)
    try:
        yield handle
    finally:
        await delete_quietly(agent, handle.sandbox_id)


async def delete_quietly(agent: NodeAgent, *sandbox_ids: str) -> None:
    """Delete sandboxes that may already be gone; other failures still raise (a leak must be loud)."""
    for sandbox_id in sandbox_ids:
        with contextlib.suppress(errors.NotFound):
            await agent.delete(sandbox_id)


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Await `check()` until it returns something truthy; fail with the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s: {what} (last value {last!r})")
        await asyncio.sleep(interval)


async def read_int(session: GuestSession, path: str) -> int:
    """The integer a counter wrote to `path` (retrying the rare torn read of a file being rewritten)."""
    for _ in range(50):
        text = (await session.read_file(path)).decode().strip()
        if text.isdigit():
            return int(text)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never held an integer")


async def start_counter(session: GuestSession, path: str = "/work/counter") -> str:
    """A background shell loop that writes an increasing integer to `path` every 0.1 s; its process id."""
    started = await session.start_background(COUNTER.format(path=path), tag="counter")
    await eventually(lambda: _exists(session, path), what=f"{path} written")
    return str(started["process_id"])


async def counter_above(sb: SandboxHandle, value: int, path: str = "/work/counter") -> bool:
    """Whether the counter `start_counter` runs has counted past `value`."""
    return await read_int(sb.session, path) > value


async def _exists(session: GuestSession, path: str) -> bool:
    try:
        await session.stat(path)
    except errors.NotFound:
        return False
    return True


async def running_ids(session: GuestSession) -> set[str]:
    return {p["process_id"] for p in await session.processes() if p["running"]}


async def count_output(
    session: GuestSession, command: str, *, timeout: float | None = None
) -> dict[str, Any]:
    """Run `command` in the foreground counting its output bytes without keeping them (for floods)."""
    params: dict[str, Any] = {"cmd": command, "stdin": False}
    if timeout is not None:
        params["timeout"] = timeout
    call = await session.channel.open(m.PROCESS_START, params)
    received = 0
    async for item in call.events():
        if item.kind == FrameType.DATA:
            received += len(item.data)
    result = await call.result()
    return {**result, "received": received}


def vm_hwm_kib() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_vm_hwm() -> None:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0: `5` to clear_refs)."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")
