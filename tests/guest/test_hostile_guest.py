"""A hostile guest, in a real gVisor sandbox, against the node agent's end of the private channel.

No test-only init is needed: inside any sandbox a root process can open `/proc/1/fd/101`, the daemon's end
of the channel towards the agent, and write whatever it likes into it (checked below: gVisor allows it).
So forged and malformed frames are a real attack surface, and these tests use exactly that: a script in
sandbox A floods the channel while sandbox B, the neighbour, is measured. A guest that never reads is a
sandbox whose runtime is frozen underneath a live channel.

Each attack asserts: the agent's memory stays bounded (VmRSS of this process, which is the agent), the
attacked sandbox ends with a clear error (its channel closed with the reason, the sandbox `crashed`), and
the neighbour keeps answering exec within its normal latency throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import statistics
import time
from collections.abc import Awaitable, Callable

import pytest

from space.core import errors
from space.core.lifecycle import State
from space.node.agent import channel as channel_module
from space.node.agent import channel_call
from space.node.agent.agent import NodeAgent, SandboxHandle
from space.node.agent.guest import GuestSession
from tests.support.sandboxes import eventually, new_sandbox

pytestmark = pytest.mark.root

MiB = 1 << 20
CHANNEL_OUT_FD = 101  # spaced moves its channel to fds >= 100: 100 reads from the agent, 101 writes to it

# Runs inside the attacked sandbox as root. Frames are built by hand (the guest image has no SPACE host
# code to lean on, and an attacker would not use it either).
HOSTILE = r"""
import os, struct, sys, zlib

mode = sys.argv[1]
out = os.open("/proc/1/fd/" + sys.argv[2], os.O_WRONLY)

def frame(kind, stream, payload, length=None):
    head = struct.pack(">2sBBII", b"SP", kind, 0, stream, len(payload) if length is None else length)
    return head + struct.pack(">I", zlib.crc32(head)) + payload

def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]

os.write(1, b"attacking\n")
if mode == "garbage":
    junk = [
        os.urandom(4096),
        b"SP" + os.urandom(14) + b"no valid checksum",
        frame(0x7F, 0, b"{}"),                        # unknown type
        frame(2, 5, b'{"method": "sys.ping"}'),        # a CALL, from the guest
        frame(9, 0, b"\x00"),                          # a malformed WINDOW
        frame(6, 77, b"not json"),                     # a RESULT nobody asked for
        frame(7, 0, b'{"code": "internal", "message": "' + b"E" * 3000 + b'"}'),  # an error report flood
    ]
    while True:
        for piece in junk:
            write(piece)
elif mode == "oversized":
    write(frame(3, 12345, b"", length=0xFFFFFFFF))  # an endless frame: 4 GiB announced ...
    block = b"\0" * 65536
    while True:
        write(block)                                # ... and the bytes keep coming
elif mode == "unsolicited":
    data = b"\x01" + b"D" * (256 * 1024)
    stream = 1
    while True:                                     # valid DATA frames for streams nobody opened
        write(frame(3, stream, data))
        stream = stream % 1000 + 1
"""


def agent_rss_mib() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def exec_latency(session: GuestSession) -> float:
    started = time.monotonic()
    result = await session.exec(["echo", "neighbour"], timeout=30)
    assert (result.exit_code, result.stdout) == (0, b"neighbour\n")
    return time.monotonic() - started


async def baseline_latency(session: GuestSession, rounds: int = 10) -> float:
    return statistics.median([await exec_latency(session) for _ in range(rounds)])


async def while_measuring(
    neighbour: GuestSession, attack: Callable[[], Awaitable[None]], *, samples: list[float], rss: list[float]
) -> None:
    """Run `attack` while the neighbour execs every 0.1 s and the agent's RSS is sampled."""
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            samples.append(await exec_latency(neighbour))
            rss.append(agent_rss_mib())
            await asyncio.sleep(0.1)

    prober = asyncio.create_task(probe())
    try:
        await attack()
        await asyncio.sleep(1.0)  # and a little after
    finally:
        stop.set()
        await prober


def assert_neighbour_unaffected(baseline: float, samples: list[float]) -> None:
    assert len(samples) >= 3, samples
    # Generous for a shared 2-core machine, far below what a stalled or starved agent would show.
    assert statistics.median(samples) < max(0.5, 5 * baseline), (baseline, samples)
    assert max(samples) < max(3.0, 20 * baseline), (baseline, samples)


async def attack_from_inside(agent: NodeAgent, mode: str, neighbour: SandboxHandle) -> dict[str, object]:
    async with new_sandbox(agent) as victim:
        session = victim.session
        channel = victim.channel
        assert channel is not None and channel.flow_control
        await session.write_file("/work/hostile.py", HOSTILE.encode())
        baseline = await baseline_latency(neighbour.session)
        neighbour_errors = neighbour.channel.protocol_errors if neighbour.channel else -1
        rss_before = agent_rss_mib()
        samples: list[float] = []
        rss: list[float] = []

        async def attack() -> None:
            await session.start_background(
                ["python3", "/work/hostile.py", mode, str(CHANNEL_OUT_FD)], tag="hostile"
            )
            await eventually(
                lambda: _closed(channel), timeout=60, what=f"the agent gave up on the {mode} guest"
            )

        await while_measuring(neighbour.session, attack, samples=samples, rss=rss)
        growth = max(rss) - rss_before
        assert growth < 64, f"the agent's RSS grew by {growth:.0f} MiB under a {mode} flood"
        assert channel.failure is not None and "broke the channel protocol" in channel.failure
        assert victim.state == State.CRASHED, victim.state
        with pytest.raises(errors.InvalidState):
            _ = victim.session
        assert_neighbour_unaffected(baseline, samples)
        assert neighbour.channel is not None and not neighbour.channel.closed
        assert neighbour.channel.protocol_errors == neighbour_errors  # nothing reached the neighbour
        return {
            "failure": channel.failure,
            "rss_growth_mib": round(growth, 1),
            "baseline_s": round(baseline, 4),
            "neighbour_max_s": round(max(samples), 4),
        }


async def _closed(channel: channel_module.GuestChannel) -> bool:
    return channel.closed


@pytest.mark.parametrize("mode", ["garbage", "oversized", "unsolicited"])
def test_forged_frames_from_inside_a_sandbox(node, mode: str) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as neighbour:
            found = await attack_from_inside(agent, mode, neighbour)
            print(f"\n{mode}: {found}")
            after = await neighbour.session.exec(["echo", "neighbour"])
            assert after.stdout == b"neighbour\n"

    node.run(scenario(), timeout=600)


def test_a_process_inside_can_reach_the_channel_but_not_a_neighbours(node) -> None:  # type: ignore[no-untyped-def]
    """The attack surface itself: a root process writes into its own sandbox's channel and the agent sees
    it; the neighbour's channel sees nothing, and a single torn write does not cost A its channel."""
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as a, new_sandbox(agent) as b:
            assert a.channel is not None and b.channel is not None
            before_a, before_b = a.channel.protocol_errors, b.channel.protocol_errors
            probe = (
                "import os\n"
                f"fd = os.open('/proc/1/fd/{CHANNEL_OUT_FD}', os.O_WRONLY)\n"
                "os.write(fd, b'\\x00forged bytes, not a frame\\x00')\n"
            )
            result = await a.session.exec(["python3", "-c", probe])
            assert result.exit_code == 0, result.stderr
            await eventually(lambda: _more_errors(a.channel, before_a), what="the agent saw the forged bytes")
            assert b.channel.protocol_errors == before_b
            assert (await b.session.exec(["echo", "b"])).stdout == b"b\n"
            assert not a.channel.closed  # a torn write is tolerated; only floods cut a guest off
            assert (await a.session.exec(["echo", "a"])).stdout == b"a\n"

    node.run(scenario(), timeout=300)


async def _more_errors(channel: channel_module.GuestChannel | None, before: int) -> bool:
    return channel is not None and channel.protocol_errors > before


def test_a_guest_that_never_reads(node, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The victim's runtime is frozen under its live channel, so nothing reads what the agent sends. Many
    concurrent uploads to it fail with Timeout; the agent neither blocks its event loop nor buffers them."""
    monkeypatch.setattr(channel_module, "WRITE_STALL_TIMEOUT", 5.0)
    monkeypatch.setattr(channel_call, "CREDIT_STALL_TIMEOUT", 5.0)
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as neighbour, new_sandbox(agent) as victim:
            session = victim.session
            channel = victim.channel
            assert channel is not None
            baseline = await baseline_latency(neighbour.session)
            rss_before = agent_rss_mib()
            samples: list[float] = []
            rss: list[float] = []
            outcomes: list[BaseException | int] = []
            payload = b"p" * (4 * MiB)

            async def attack() -> None:
                await agent.driver.pause(victim.sandbox_id)
                try:
                    uploads = [session.write_file(f"/work/upload-{n}", payload) for n in range(40)]
                    outcomes.extend(await asyncio.gather(*uploads, return_exceptions=True))
                finally:
                    await agent.driver.resume(victim.sandbox_id)

            started = time.monotonic()
            await while_measuring(neighbour.session, attack, samples=samples, rss=rss)
            elapsed = time.monotonic() - started
            growth = max(rss) - rss_before
            kinds = sorted({type(o).__name__ for o in outcomes})
            print(
                f"\nnever-reads: {kinds}, {elapsed:.1f}s, RSS +{growth:.0f} MiB, "
                f"neighbour max {max(samples):.3f}s"
            )
            assert all(isinstance(o, errors.Timeout | errors.ResourceExhausted) for o in outcomes), outcomes
            assert any(isinstance(o, errors.Timeout) for o in outcomes)
            assert growth < 64, f"the agent's RSS grew by {growth:.0f} MiB with 160 MiB of uploads stalled"
            assert (
                channel._writer.transport.get_write_buffer_size() <= channel_module.WRITE_HIGH_WATER + 2 * MiB
            )
            assert_neighbour_unaffected(baseline, samples)
            # Once it runs again the victim answers: nothing was torn, the abandoned writes were cancelled.
            await eventually(lambda: _answers(session), timeout=60, what="the thawed victim answers")
            await eventually(lambda: _no_open_calls(channel), timeout=30, what="every call slot came back")

    node.run(scenario(), timeout=600)


async def _answers(session: GuestSession) -> bool:
    with contextlib.suppress(errors.SpaceError):
        return (await session.exec(["echo", "back"], timeout=10)).stdout == b"back\n"
    return False


async def _no_open_calls(channel: channel_module.GuestChannel) -> bool:
    return channel.open_calls == 0


def test_fifty_megabytes_of_exec_output_through_a_real_sandbox(node) -> None:  # type: ignore[no-untyped-def]
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            rss_before = agent_rss_mib()
            started = time.monotonic()
            result = await sb.session.exec(["python3", "-c", "print('x' * 50_000_000)"], timeout=120)
            elapsed = time.monotonic() - started
            growth = agent_rss_mib() - rss_before
            print(f"\n50 MB exec: {elapsed:.2f}s, RSS +{growth:.0f} MiB")
            assert result.exit_code == 0
            assert result.stdout_truncated and not result.stderr_truncated
            assert len(result.stdout) == 1 << 20 and set(result.stdout) == {ord("x")}
            assert elapsed < 30, f"a capped 50 MB exec took {elapsed:.1f}s"
            assert growth < 40, f"the agent's RSS grew by {growth:.0f} MiB for a capped exec"

    node.run(scenario(), timeout=300)
