"""Processes in a real gVisor sandbox: background, re-attach, PTY, signals, timeouts, blocking, floods."""

from __future__ import annotations

import asyncio
import time

import pytest

from space.core import errors
from space.node.agent.agent import NodeAgent
from tests.support.sandboxes import count_output, eventually, new_sandbox

pytestmark = pytest.mark.root

MiB = 1 << 20


def test_background_process_outlives_its_request_and_reattaches_at_any_offset(node) -> None:
    agent: NodeAgent = node.agent
    script = "for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done; echo done >&2; exit 7"
    expected = b"line1\nline2\nline3\nline4\nline5\ndone\n"

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            started_at = time.monotonic()
            started = await s.start_background(script, tag="lines")
            assert time.monotonic() - started_at < 1.0, "a background start returns at once"
            pid = started["process_id"]

            listed = {p["process_id"]: p for p in await s.processes()}
            assert listed[pid]["running"] and listed[pid]["tag"] == "lines" and listed[pid]["background"]

            # a non-following attach while it runs gives what is there so far
            await eventually(lambda: _has_output(s, pid, b"line2"), what="two lines of output")
            r = await s.attach(pid, follow=False)
            assert expected.startswith(r.stdout + r.stderr) and r.extra["running"] is True

            # from offset 0, following: everything, then the exit status
            r = await s.attach(pid, offset=0)
            assert r.stdout + r.stderr == expected
            assert r.stderr == b"done\n" and r.exit_code == 7

            # from the middle: the rest only
            middle = len(b"line1\nline2\n")
            r = await s.attach(pid, offset=middle)
            assert r.stdout + r.stderr == expected[middle:]
            assert r.exit_code == 7

            listed = {p["process_id"]: p for p in await s.processes()}
            assert not listed[pid]["running"] and listed[pid]["exit_code"] == 7
            assert listed[pid]["output_bytes"] == len(expected)
            with pytest.raises(errors.NotFound):
                await s.attach("0123456789abcdef")

    node.run(scenario())


async def _has_output(session, process_id: str, needle: bytes) -> bool:  # type: ignore[no-untyped-def]
    r = await session.attach(process_id, follow=False)
    return needle in r.stdout + r.stderr


def test_pty_session_with_resize(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            started = await s.start_background(
                "stty size; tty; read line; echo got:$line; stty size", pty=(24, 80), stdin=True
            )
            pid = started["process_id"]
            await eventually(lambda: _has_output(s, pid, b"24 80"), what="initial terminal size")
            await s.resize(pid, 40, 100)
            await s.write_stdin(pid, b"hello\n")
            r = await asyncio.wait_for(s.attach(pid), 20)
            text = r.stdout.decode().replace("\r\n", "\n")
            assert "24 80\n" in text and "/dev/pts/" in text
            assert "got:hello\n" in text
            assert text.rstrip().endswith("40 100"), text
            assert r.stderr == b""  # a PTY's output is all STDOUT
            assert r.exit_code == 0
            plain = await s.start_background("sleep 5")
            with pytest.raises(errors.InvalidState) as refused:  # no PTY, no resize: typed, not a 502
                await s.resize(plain["process_id"], 10, 10)
            assert refused.value.state == "no_terminal"
            assert refused.value.details["guest_code"] == "not_a_terminal"
            await s.signal(plain["process_id"], "KILL")

    node.run(scenario())


def test_signals_reach_processes(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            started = await s.start_background(
                "trap 'echo got-usr1' USR1; echo ready; while true; do sleep 0.1; done"
            )
            pid = started["process_id"]
            await eventually(lambda: _has_output(s, pid, b"ready"), what="trap installed")
            await s.signal(pid, "SIGUSR1")
            await eventually(lambda: _has_output(s, pid, b"got-usr1"), what="USR1 handled")
            await s.signal(pid, 15)
            r = await asyncio.wait_for(s.attach(pid), 10)
            assert r.signal == 15 and r.exit_code is None
            with pytest.raises(errors.NotFound):  # it is gone now
                await s.signal(pid, "TERM")
            with pytest.raises(errors.InvalidArgument):
                await s.signal(pid, "NOT_A_SIGNAL")

    node.run(scenario())


def test_timeout_kills_foreground_and_background(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            started_at = time.monotonic()
            r = await s.exec("echo before; sleep 60; echo after", timeout=1.0)
            elapsed = time.monotonic() - started_at
            assert r.timed_out and r.signal == 9, r
            assert r.stdout == b"before\n"
            assert elapsed < 10, f"a 1 s timeout took {elapsed:.1f} s"

            started = await s.start_background("sleep 60", timeout=1.0)
            r = await asyncio.wait_for(s.attach(started["process_id"]), 15)
            assert r.timed_out and r.signal == 9
            assert (await s.exec("pgrep -x sleep")).exit_code == 1, "the timed-out group is gone"

    node.run(scenario())


def test_a_process_that_never_exits_does_not_block_other_calls(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            stuck = asyncio.create_task(s.exec("echo stuck; sleep 3600"))
            try:
                running = await eventually(
                    lambda: _running_matching(s, "sleep 3600"), what="the stuck process is listed"
                )
                for _ in range(3):
                    started_at = time.monotonic()
                    await s.ping()
                    assert (await s.exec("echo free")).stdout == b"free\n"
                    await s.write_file("/work/x", b"x")
                    assert await s.read_file("/work/x") == b"x"
                    assert time.monotonic() - started_at < 5
                assert not stuck.done()
                await s.signal(running, "KILL")
                r = await asyncio.wait_for(stuck, 10)
                assert r.signal == 9 and r.stdout == b"stuck\n"
            finally:
                stuck.cancel()

    node.run(scenario())


async def _running_matching(session, text: str) -> str | None:  # type: ignore[no-untyped-def]
    for p in await session.processes():
        if p["running"] and text in " ".join(p["argv"]):
            return str(p["process_id"])
    return None


def test_output_flood_does_not_starve_the_channel(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            background = await s.start_background("yes", timeout=5.0)
            flood = asyncio.create_task(count_output(s, "yes | head -c 200M", timeout=120))
            latencies = []
            try:
                while not flood.done():
                    started_at = time.monotonic()
                    await s.ping(timeout=10)
                    latencies.append(time.monotonic() - started_at)
                    await asyncio.sleep(0.1)
                result = await flood
            finally:
                flood.cancel()
            assert result["exit_code"] == 0 and result["received"] == 200 * MiB
            assert len(latencies) >= 3, "the flood was too short to overlap any ping"
            assert max(latencies) < 3.0, f"ping latencies during the flood: {latencies}"

            listed = {p["process_id"]: p for p in await s.processes()}
            entry = listed[background["process_id"]]
            assert entry["output_bytes"] > 0
            assert (await s.exec("echo alive")).stdout == b"alive\n"
            r = await asyncio.wait_for(s.attach(background["process_id"]), 30)
            assert r.timed_out

    node.run(scenario())
