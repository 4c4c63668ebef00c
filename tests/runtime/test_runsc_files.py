"""Files in a real gVisor sandbox: round trips, a streamed 1 GiB file, directory operations, watch, errors."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from collections.abc import AsyncIterator

import pytest

from space.core import errors
from space.node.agent.agent import NodeAgent
from space.protocol import CHUNK_SIZE
from tests.support.sandboxes import new_sandbox, reset_vm_hwm, vm_hwm_kib

pytestmark = pytest.mark.root

GiB = 1 << 30
MiB = 1 << 20


def test_small_round_trip_and_directory_operations(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            data = os.urandom(4096)
            assert await s.write_file("/work/small.bin", data) == 4096
            assert await s.read_file("/work/small.bin") == data
            r = await s.exec("sha256sum /work/small.bin")
            assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
            assert await s.read_file("/work/small.bin", offset=4000, length=50) == data[4000:4050]

            # a file written inside is read back outside
            await s.exec("printf 'from inside' > /work/inside.txt")
            assert await s.read_file("/work/inside.txt") == b"from inside"

            # mkdir -p, list, stat
            await s.mkdir("/work/a/b/c")
            await s.write_file("/work/a/b/c/f.txt", b"hello")
            await s.write_file("/work/a/top.txt", b"x" * 10)
            names = [e["name"] for e in await s.list_dir("/work/a")]
            assert names == ["b", "top.txt"]
            st = await s.stat("/work/a/b/c/f.txt")
            assert (st["type"], st["size"], st["name"]) == ("file", 5, "f.txt")
            assert (await s.stat("/work/a/b"))["type"] == "dir"

            # rename, chmod
            await s.rename("/work/a/top.txt", "/work/a/moved.txt")
            assert sorted(e["name"] for e in await s.list_dir("/work/a")) == ["b", "moved.txt"]
            await s.chmod("/work/a/moved.txt", 0o600)
            assert stat.S_IMODE((await s.stat("/work/a/moved.txt"))["mode"]) == 0o600
            r = await s.exec("stat -c %a /work/a/moved.txt")
            assert r.stdout == b"600\n"
            await s.write_file("/work/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
            assert (await s.exec("/work/run.sh")).stdout == b"ran\n"

            # remove -r
            await s.remove("/work/a", recursive=True)
            assert "a" not in [e["name"] for e in await s.list_dir("/work")]

    node.run(scenario())


def test_errors_are_typed(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            with pytest.raises(errors.NotFound):
                await s.read_file("/work/missing.txt")
            with pytest.raises(errors.NotFound):
                await s.stat("/work/missing.txt")
            with pytest.raises(errors.NotFound):
                await s.list_dir("/work/missing")
            with pytest.raises(errors.NotFound):
                await s.rename("/work/missing", "/work/other")
            await s.write_file("/work/file.txt", b"x")
            with pytest.raises(errors.InvalidArgument):  # not a directory
                await s.list_dir("/work/file.txt")
            with pytest.raises(errors.InvalidArgument):  # is a directory
                await s.read_file("/work")
            await s.mkdir("/work/full/sub")
            with pytest.raises(errors.Conflict):  # not empty
                await s.remove("/work/full")
            with pytest.raises(errors.AlreadyExists):
                await s.mkdir("/work/full", parents=False)
            with pytest.raises(errors.PermissionDenied):
                await s.remove("/", recursive=True)
            with pytest.raises(errors.PermissionDenied):
                await s.write_file("/proc/version", b"no")
            # the channel is still fine after all those errors
            assert (await s.exec("echo ok")).stdout == b"ok\n"

    node.run(scenario())


def test_watch_reports_changes(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            await s.mkdir("/work/watched")
            call = await s.watch("/work/watched")
            seen: list[dict] = []
            events = call.events()

            async def next_event() -> dict:
                item = await asyncio.wait_for(anext(events), 10)
                return item.event

            first = await next_event()
            assert first["type"] == "watching", first
            await s.write_file("/work/watched/new.txt", b"1")
            await s.exec("echo more >> /work/watched/new.txt; rm /work/watched/new.txt")

            kinds: dict[str, set[str]] = {}
            while not {"created", "deleted"} <= kinds.get("/work/watched/new.txt", set()):
                event = await next_event()
                assert event["type"] == "changes", event
                seen.append(event)
                for change in event["changes"]:
                    kinds.setdefault(change["path"], set()).add(change["kind"])
            await call.cancel()
            assert await asyncio.wait_for(call.result(), 10) == {}

    node.run(scenario())


def test_one_gib_streams_both_ways_without_buffering_in_the_agent(node) -> None:
    agent: NodeAgent = node.agent
    block = os.urandom(CHUNK_SIZE)

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            sent = hashlib.sha256()

            async def source() -> AsyncIterator[bytes]:
                for i in range(GiB // CHUNK_SIZE):
                    chunk = i.to_bytes(8, "big") + block[8:]
                    sent.update(chunk)
                    yield chunk

            reset_vm_hwm()
            before = vm_hwm_kib()
            assert await s.write_file("/work/big.bin", source()) == GiB
            r = await s.exec("sha256sum /work/big.bin", timeout=120)
            assert r.stdout.split()[0].decode() == sent.hexdigest()
            assert (await s.stat("/work/big.bin"))["size"] == GiB

            got = hashlib.sha256()
            size = 0
            async for chunk in s.read_file_stream("/work/big.bin"):
                got.update(chunk)
                size += len(chunk)
            assert size == GiB
            assert got.hexdigest() == sent.hexdigest()
            growth_mib = (vm_hwm_kib() - before) / 1024
            assert growth_mib < 128, f"the agent's peak RSS grew by {growth_mib:.0f} MiB for a 1 GiB file"
            await s.remove("/work/big.bin")

    node.run(scenario())


def test_a_slow_reader_does_not_make_the_agent_buffer_the_file(node) -> None:
    """Streaming must be flow-controlled end to end: a consumer that stalls (a slow upload, a slow client)
    may not make the agent pull the whole file into memory behind its back."""
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            r = await s.exec("head -c 256M /dev/zero > /work/zeros.bin", timeout=60)
            assert r.exit_code == 0, r.stderr
            reset_vm_hwm()
            before = vm_hwm_kib()
            size = 0
            stalled = False
            async for chunk in s.read_file_stream("/work/zeros.bin"):
                if not stalled:
                    stalled = True
                    await asyncio.sleep(3)  # the consumer is busy elsewhere for a moment
                size += len(chunk)
            assert size == 256 * MiB
            growth_mib = (vm_hwm_kib() - before) / 1024
            assert growth_mib < 64, (
                f"the agent buffered {growth_mib:.0f} MiB of a 256 MiB file while its reader stalled: "
                "the channel's per-stream flow control did not hold the guest back"
            )

    node.run(scenario())
