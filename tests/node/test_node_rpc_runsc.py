"""The node RPC over a real gVisor node: create a sandbox with a chosen id, exec in it, move a file both ways
(streamed), auto-resume after a pause, and delete — all through NodeClient and a real uvicorn."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.agent.app import create_app
from space.node.rpc_client import NodeClient
from tests.support.host import cgroups_under, processes_mentioning

pytestmark = pytest.mark.root

TOKEN = "integration-node-token"
MiB = 1 << 20


async def pieces(data: bytes, size: int = 256 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_exec_and_files_through_the_rpc(node) -> None:  # type: ignore[no-untyped-def]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(
        uvicorn.Config(create_app(node.agent, TOKEN), log_level="warning", lifespan="off")
    )

    async def start() -> asyncio.Task[None]:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            assert not task.done(), "uvicorn stopped at start"
            await asyncio.sleep(0.01)
        return task

    async def scenario() -> None:
        async with NodeClient(url, TOKEN) as client:
            sandbox_id = new_sandbox_id()
            observed, created = await client.create_sandbox(sandbox_id, env={"WHO": "rpc"})
            try:
                assert (observed.id, observed.state, created) == (sandbox_id, "running", True)
                assert (await client.create_sandbox(sandbox_id))[1] is False

                result = await client.exec(sandbox_id, 'echo "hello $WHO"; uname -s')
                assert (result.exit_code, result.stdout.splitlines()[0]) == (0, "hello rpc")

                data = os.urandom(8 * MiB)
                assert await client.write_file(sandbox_id, "/work/blob.bin", pieces(data)) == len(data)
                inside = await client.exec(sandbox_id, ["sha256sum", "/work/blob.bin"])
                assert inside.stdout.split()[0] == hashlib.sha256(data).hexdigest()
                assert await client.read_file(sandbox_id, "/work/blob.bin") == data

                await client.exec(sandbox_id, "printf made-inside > /work/inside.txt")
                assert await client.read_file(sandbox_id, "/work/inside.txt") == b"made-inside"

                events = [e async for e in client.exec_stream(sandbox_id, "echo streamed; exit 7")]
                assert (events[0]["type"], events[-1]["type"], events[-1]["exit_code"]) == (
                    "started",
                    "exit",
                    7,
                )

                await client.pause(sandbox_id)
                assert (await client.get_sandbox(sandbox_id)).runtime == "paused"
                assert (await client.exec(sandbox_id, "echo resumed")).stdout == "resumed\n"
                observed = await client.get_sandbox(sandbox_id)
                assert (observed.state, observed.runtime) == ("running", "running")

                await client.stop(sandbox_id)
                with pytest.raises(errors.InvalidState) as caught:
                    await client.pause(sandbox_id)
                assert caught.value.state == "stopped"
            finally:
                await client.delete_sandbox(sandbox_id)
            assert (await client.delete_sandbox(sandbox_id)).existed is False
            with pytest.raises(errors.NotFound):
                await client.get_sandbox(sandbox_id)
            # nothing of this sandbox is left on the host (checked by id: other runs may share the host)
            assert [g for g in cgroups_under("space") if sandbox_id in g] == []
            assert [p for p in processes_mentioning(sandbox_id)] == []

    task = node.run(start(), timeout=30)
    try:
        node.run(scenario(), timeout=300)
    finally:
        server.should_exit = True
        node.run(asyncio.wait_for(task, 30), timeout=60)
