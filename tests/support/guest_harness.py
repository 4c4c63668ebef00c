"""A small synchronous client for `python -m space.guest`, for tests.

It starts the daemon as a subprocess on stdin/stdout pipes, reads its HELLO, and demultiplexes what the
daemon sends by stream id on a reader thread, so a test can run several calls at once (a flood on one
stream, pings on another) and still write synchronous code. Raw writes let a test send garbage.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from space.protocol.errors import ProtocolError
from space.protocol.frames import (
    TERMINAL_TYPES,
    Channel,
    Frame,
    FrameDecoder,
    FrameType,
    encode,
    encode_eof,
    encode_json,
    iter_data_frames,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass
class Reply:
    events: list[dict[str, Any]] = field(default_factory=list)
    data: dict[int, bytes] = field(default_factory=dict)
    data_bytes: dict[int, int] = field(default_factory=dict)
    eofs: list[int] = field(default_factory=list)
    terminal: Frame | None = None

    @property
    def ok(self) -> bool:
        return self.terminal is not None and self.terminal.type == FrameType.RESULT

    @property
    def result(self) -> dict[str, Any]:
        assert self.terminal is not None, "no terminal frame"
        assert self.terminal.type == FrameType.RESULT, f"expected RESULT, got {self.terminal.json()}"
        return self.terminal.json()

    @property
    def error(self) -> dict[str, Any]:
        assert self.terminal is not None, "no terminal frame"
        assert self.terminal.type == FrameType.ERROR, f"expected ERROR, got {self.terminal.json()}"
        return self.terminal.json()

    @property
    def stdout(self) -> bytes:
        return self.data.get(Channel.STDOUT, b"")

    @property
    def stderr(self) -> bytes:
        return self.data.get(Channel.STDERR, b"")

    @property
    def body(self) -> bytes:
        return self.data.get(Channel.BODY, b"")


class Guest:
    def __init__(self, env: dict[str, str] | None = None, reap_all: bool = False) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPACED_")}
        full_env["PYTHONPATH"] = SRC
        if reap_all:
            full_env["SPACED_REAP_ALL"] = "1"
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "space.guest"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=full_env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin = self.proc.stdin
        self._stdout_fd = self.proc.stdout.fileno()
        self._write_lock = threading.Lock()
        self._queues: dict[int, queue.Queue[Frame | None]] = {}
        self._queues_lock = threading.Lock()
        self.protocol_errors: list[ProtocolError] = []
        self._next_stream = 1
        self._reader = threading.Thread(target=self._read_forever, daemon=True)
        self._reader.start()
        hello = self.next_frame(0, timeout=10)
        assert hello.type == FrameType.HELLO, hello
        self.hello = hello.json()

    @property
    def pid(self) -> int:
        return self.proc.pid

    # --- reading ---------------------------------------------------------------------------------------

    def _queue(self, stream: int) -> queue.Queue[Frame | None]:
        with self._queues_lock:
            q = self._queues.get(stream)
            if q is None:
                q = self._queues[stream] = queue.Queue()
            return q

    def _read_forever(self) -> None:
        decoder = FrameDecoder()
        while True:
            try:
                data = os.read(self._stdout_fd, 1 << 20)
            except OSError:
                data = b""
            if not data:
                break
            for item in decoder.feed(data):
                if isinstance(item, ProtocolError):
                    self.protocol_errors.append(item)
                else:
                    self._queue(item.stream).put(item)
        with self._queues_lock:
            queues = list(self._queues.values())
        for q in queues:
            q.put(None)

    def next_frame(self, stream: int, timeout: float = 10) -> Frame:
        item = self._queue(stream).get(timeout=timeout)
        if item is None:
            raise EOFError("the daemon closed its channel")
        return item

    def collect(
        self,
        stream: int,
        timeout: float = 20,
        keep_data: bool = True,
        on_data: Callable[[int, bytes], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> Reply:
        reply = Reply()
        chunks: dict[int, list[bytes]] = {}
        deadline = time.monotonic() + timeout
        while True:
            frame = self.next_frame(stream, timeout=max(0.01, deadline - time.monotonic()))
            if frame.type == FrameType.DATA:
                channel, data = frame.channel_data()
                reply.data_bytes[channel] = reply.data_bytes.get(channel, 0) + len(data)
                if on_data is not None:
                    on_data(channel, data)
                if keep_data:
                    chunks.setdefault(channel, []).append(data)
            elif frame.type == FrameType.EOF:
                reply.eofs.append(frame.channel_data()[0])
            elif frame.type == FrameType.EVENT:
                event = frame.json()
                reply.events.append(event)
                if on_event is not None:
                    on_event(event)
            elif frame.type in TERMINAL_TYPES:
                reply.terminal = frame
                break
        reply.data = {channel: b"".join(parts) for channel, parts in chunks.items()}
        return reply

    # --- writing ---------------------------------------------------------------------------------------

    def write_raw(self, data: bytes) -> None:
        with self._write_lock:
            self._stdin.write(data)
            self._stdin.flush()

    def open(self, method: str, params: dict[str, Any] | None = None) -> int:
        with self._write_lock:
            stream = self._next_stream
            self._next_stream += 1
        self._queue(stream)
        self.write_raw(encode_json(FrameType.CALL, stream, {"method": method, "params": params or {}}))
        return stream

    def send_body(self, stream: int, data: bytes, eof: bool = True) -> None:
        for frame in iter_data_frames(stream, Channel.BODY, data):
            self.write_raw(frame)
        if eof:
            self.write_raw(encode_eof(stream, Channel.BODY))

    def cancel(self, stream: int) -> None:
        self.write_raw(encode(FrameType.CANCEL, stream))

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        body: bytes | None = None,
        timeout: float = 20,
    ) -> Reply:
        stream = self.open(method, params)
        if body is not None:
            self.send_body(stream, body)
        return self.collect(stream, timeout=timeout)

    def ping_seconds(self) -> float:
        started = time.monotonic()
        assert self.call("sys.ping").ok
        return time.monotonic() - started

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
