"""Garbage on a real sandbox's private channel: the daemon reports it, resynchronises and keeps serving."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import pytest

from space.node.agent.agent import NodeAgent
from space.protocol import FrameType, encode_json
from tests.support.sandboxes import eventually, new_sandbox

pytestmark = pytest.mark.root

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def _frame_with_type(type_byte: int, stream: int, payload: bytes) -> bytes:
    head = struct.pack(">2sBBII", b"SP", type_byte, 0, stream, len(payload))
    return head + struct.pack(">I", zlib.crc32(head)) + payload


def test_garbage_on_the_channel_is_reported_and_survived(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent) as sb:
            s = sb.session
            channel = sb.channel
            assert channel is not None
            await s.ping()
            before = channel.protocol_errors
            garbage = [
                b"\x00\xffthis is not a frame at all\n" * 50,  # no magic anywhere
                b"SP" + b"\x02\x00\x00\x00\x00\x07\x00\x00\x00\x05" + b"BADC" + b"hello",  # bad header CRC
                _frame_with_type(0x7F, 0, b"{}"),  # unknown frame type
                encode_json(FrameType.CALL, 0, {"method": "sys.ping", "params": {}}),  # CALL on stream 0
            ]
            for chunk in garbage:
                channel._writer.write(chunk)
            await channel._writer.drain()

            assert "time" in await s.ping()
            await eventually(
                lambda: _errors_at_least(channel, before + 3), what="the daemon reported the garbage"
            )
            # the stream is still in frame: calls with bodies and output work
            assert (await s.exec("cat", stdin=b"intact")).stdout == b"intact"
            await s.write_file("/work/after-garbage", b"fine")
            assert await s.read_file("/work/after-garbage") == b"fine"
            assert not channel.closed

    node.run(scenario())


async def _errors_at_least(channel, count: int) -> int | None:  # type: ignore[no-untyped-def]
    return channel.protocol_errors if channel.protocol_errors >= count else None


def test_channel_socket_is_ready_the_moment_it_appears() -> None:
    """The helper reports a sandbox's channel socket as soon as the path exists (runtime.py/verbs.py poll
    `socket_path.exists()`), and an unprivileged agent connects right away. So the socket must already be
    owned by the agent, mode 0600 and listening when it appears. The holder binds it first and only then
    chmods, chowns and listens; an agent that is quick (or a holder that is descheduled) gets EACCES —
    seen as `Unavailable: cannot reach sandbox channel ... Permission denied` in the unprivileged demo —
    or, even as root, ECONNREFUSED (`... [Errno 111] Connection refused` from agent.create)."""
    boot = (
        f"import sys; sys.path.insert(0, {str(SRC)!r}); "
        "from space.node.helper.holder import main; raise SystemExit(main())"
    )
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="space-test-holder-", dir="/var/tmp"))
    owner = 65534
    early = []
    try:
        for attempt in range(20):
            sock = scratch / "channel.sock"
            holder = subprocess.Popen(
                [sys.executable, "-S", "-c", boot, str(sock), str(owner), str(scratch / "runtime.log"), "--",
                 "sleep", "5"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        st = os.stat(sock)
                        break
                    except FileNotFoundError:
                        assert time.monotonic() < deadline, "the holder never opened its socket"
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(sock))  # as root: only "not listening yet" can refuse it
                    listening = "listening"
                except OSError as exc:
                    listening = f"connect: {exc.strerror}"
                finally:
                    probe.close()
                first_sight = (st.st_uid, stat.S_IMODE(st.st_mode))
                if first_sight != (owner, 0o600) or listening != "listening":
                    early.append(
                        f"attempt {attempt}: uid {first_sight[0]}, mode {first_sight[1]:o}, {listening}"
                    )
            finally:
                os.killpg(holder.pid, signal.SIGKILL)
                holder.wait()
                with contextlib.suppress(FileNotFoundError):
                    sock.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert not early, (
        f"the channel socket appeared before it belonged to the agent in {len(early)}/20 launches: {early}"
    )
