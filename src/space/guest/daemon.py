"""spaced's core: take over stdio, greet the host, read frames, run each call on its own thread.

Invariants:
- The channel lives on two high, close-on-exec fds; fds 0/1/2 point at /dev/null (2 at SPACED_LOG when
  set), so neither a stray print in the daemon nor a child can write into the channel.
- The reader loop (the main thread) never runs a handler and never raises: every decoder error, malformed
  CALL, unknown method, stray DATA or host-only misuse is answered with an ERROR frame — on the offending
  call's stream when there is one, else on stream 0 with a "stream" field — and reading goes on.
- One CALL is one `Call` and one thread; the call leaves the table when its terminal frame is sent. Frames
  that arrive for a stream that ended recently (DATA/EOF racing the end of a process, a late CANCEL) are
  ignored; DATA/EOF for a stream never seen is a protocol error.
- A host's HELLO starts a new session: it negotiates the protocol version (and with it flow control) for
  the calls that follow, and cancels the calls still open from an earlier host (a restarted agent can
  neither read their answers nor return their credit; their processes keep running, attachable by id).
- As PID 1 the daemon never exits when the host hangs up (that would kill the sandbox) and keeps reaping;
  as a plain subprocess it kills its process groups and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import random
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from space.guest.channel import Call, ChannelWriter, GuestError, encode_error, error_payload
from space.guest.children import ChildWatcher
from space.guest.settings import SETTINGS
from space.protocol import methods as m
from space.protocol import trace_ids
from space.protocol.errors import ChannelClosed, MalformedPayload, ProtocolError, VersionMismatch
from space.protocol.flow import announced_window, window_increment
from space.protocol.frames import Frame, FrameDecoder, FrameType, encode_json
from space.protocol.version import FLOW_CONTROL_VERSION, PROTOCOL_VERSION, hello_payload, negotiate

if TYPE_CHECKING:
    from collections.abc import Callable

    from space.guest.processes import ProcessTable

    Handler = Callable[["Daemon", Call, dict[str, Any]], dict[str, Any] | None]

CHANNEL_FD_MIN = 100  # the channel's fds sit above anything a library or child expects to find
READ_SIZE = 1 << 20
RECENT_STREAMS = 4096
MAX_IDLE_WORKERS = 8
# Credit granted to the host per call for request bodies (announced in HELLO): bigger than the host's
# default, since it is the sandbox's own memory (within channel.BODY_BUDGET) and uploads cross a slower
# round trip (the sandbox's wake-ups) than downloads.
BODY_WINDOW = 4 << 20

# method -> (module, function); modules are imported on first use to keep start-up fast. Keys are exactly
# the protocol's methods.METHODS.
HANDLERS: dict[str, tuple[str, str]] = {
    m.SYS_PING: (__name__, "sys_ping"),
    m.SYS_INFO: (__name__, "sys_info"),
    m.SYS_SYNC: (__name__, "sys_sync"),
    m.SYS_RESEED: (__name__, "sys_reseed"),
    m.SYS_CONFIGURE: (__name__, "sys_configure"),
    m.PROCESS_START: ("space.guest.processes", "process_start"),
    m.PROCESS_ATTACH: ("space.guest.processes", "process_attach"),
    m.PROCESS_INPUT: ("space.guest.processes", "process_input"),
    m.PROCESS_SIGNAL: ("space.guest.processes", "process_signal"),
    m.PROCESS_RESIZE: ("space.guest.processes", "process_resize"),
    m.PROCESS_LIST: ("space.guest.processes", "process_list"),
    m.FILES_READ: ("space.guest.files", "files_read"),
    m.FILES_WRITE: ("space.guest.files", "files_write"),
    m.FILES_LIST: ("space.guest.files", "files_list"),
    m.FILES_STAT: ("space.guest.files", "files_stat"),
    m.FILES_MKDIR: ("space.guest.files", "files_mkdir"),
    m.FILES_REMOVE: ("space.guest.files", "files_remove"),
    m.FILES_RENAME: ("space.guest.files", "files_rename"),
    m.FILES_CHMOD: ("space.guest.files", "files_chmod"),
    m.FILES_WATCH: ("space.guest.watch", "files_watch"),
    m.FILES_XATTR_LIST: ("space.guest.xattrs", "files_xattr_list"),
    m.FILES_XATTR_GET: ("space.guest.xattrs", "files_xattr_get"),
    m.FILES_XATTR_SET: ("space.guest.xattrs", "files_xattr_set"),
    m.FILES_XATTR_REMOVE: ("space.guest.xattrs", "files_xattr_remove"),
}


def log(message: str) -> None:
    """Diagnostics go to fd 2, which is /dev/null unless SPACED_LOG names a file."""
    with contextlib.suppress(OSError):
        os.write(2, f"spaced[{os.getpid()}] {time.strftime('%H:%M:%S')} {message}\n".encode())


class Daemon:
    def __init__(self, channel_in: int, channel_out: int, reap_all: bool) -> None:
        self.writer = ChannelWriter(channel_out)
        self.children = ChildWatcher(reap_all)
        self.boot_id = os.urandom(16).hex()
        self.started_monotonic = time.monotonic()
        self.last_activity = time.time()
        self._in = channel_in
        self._calls: dict[int, Call] = {}
        self._recent: set[int] = set()
        self._recent_order: deque[int] = deque()
        self._lock = threading.Lock()
        self._processes: ProcessTable | None = None
        self._pool_lock = threading.Lock()
        self._idle_workers = 0
        self._jobs: queue.SimpleQueue[tuple[Call, tuple[str, str], dict[str, Any]]] = queue.SimpleQueue()
        #: The credit the host granted per stream, once a HELLO negotiated flow control; None before.
        self._host_window: int | None = None

    # --- shared state for handlers -------------------------------------------------------------------

    def touch(self) -> None:
        """Record activity (a call, or process output) for idle detection."""
        self.last_activity = time.time()

    @property
    def processes(self) -> ProcessTable:
        if self._processes is None:
            with self._lock:
                if self._processes is None:
                    from space.guest.processes import ProcessTable

                    self._processes = ProcessTable(self.children, self.touch)
        return self._processes

    @property
    def processes_loaded(self) -> ProcessTable | None:
        return self._processes

    # --- the channel ----------------------------------------------------------------------------------

    def hello(self, **extra: Any) -> dict[str, Any]:
        return hello_payload(ready=True, boot_id=self.boot_id, pid=os.getpid(), window=BODY_WINDOW, **extra)

    def _send(self, frame: bytes) -> None:
        with contextlib.suppress(ChannelClosed):
            self.writer.send(frame)

    def _send_error(self, stream: int, code: str, message: str) -> None:
        payload: dict[str, Any] = {"code": code, "message": message}
        active = self._calls.get(stream) if stream else None
        if active is not None:
            # The error is about a live call's input: end that call with it rather than send a second
            # terminal frame later.
            with contextlib.suppress(ChannelClosed):
                active.abort(payload)
            return
        if stream:
            with self._lock:
                self._remember(stream)
        self._send(encode_error(stream, payload))

    def _remember(self, stream: int) -> None:
        if stream in self._recent:
            return
        self._recent.add(stream)
        self._recent_order.append(stream)
        if len(self._recent_order) > RECENT_STREAMS:
            self._recent.discard(self._recent_order.popleft())

    def _call_done(self, call: Call) -> None:
        with self._lock:
            if self._calls.get(call.stream) is call:
                del self._calls[call.stream]
            self._remember(call.stream)

    def serve(self) -> int:
        self._send(encode_json(FrameType.HELLO, 0, self.hello()))
        # The HELLO is out; load the process machinery now rather than inside the first exec.
        threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
        decoder = FrameDecoder()
        while True:
            try:
                data = os.read(self._in, READ_SIZE)
            except OSError as exc:
                log(f"reading the channel failed: {exc}")
                break
            if not data:
                break
            for item in decoder.feed(data):
                try:
                    self._dispatch(item)
                except Exception as exc:  # the reader must survive anything
                    log(f"dispatch failed: {exc!r}")
        leftover = decoder.finish()
        if leftover is not None:
            self._send(encode_error(0, {"code": leftover.code, "message": leftover.message}))
        return self._host_gone()

    def _host_gone(self) -> int:
        if os.getpid() == 1:
            log("channel closed; PID 1 stays up to keep the sandbox's processes alive")
            threading.Event().wait()
        table = self._processes
        if table is not None:
            table.kill_all()
        return 0

    def _dispatch(self, item: Frame | ProtocolError) -> None:
        if isinstance(item, ProtocolError):
            self._send_error(item.stream, item.code, item.message)
            return
        kind = item.type
        if kind == FrameType.CALL:
            self._on_call(item)
        elif kind in (FrameType.DATA, FrameType.EOF):
            call = self._calls.get(item.stream)
            if call is not None:
                call.inbound.put(item)
            elif item.stream not in self._recent:
                self._send_stream0_error("protocol_error", f"{kind.name} for unknown stream", item.stream)
        elif kind == FrameType.CANCEL:
            call = self._calls.get(item.stream)
            if call is not None:
                call.cancel()
        elif kind == FrameType.WINDOW:
            call = self._calls.get(item.stream)
            if call is not None:
                try:
                    call.grant(window_increment(item))
                except MalformedPayload as exc:
                    self._send_error(item.stream, exc.code, exc.message)
        elif kind == FrameType.HELLO:
            self._on_hello(item)
        else:
            self._send_stream0_error(
                "protocol_error", f"{kind.name} frames travel from the daemon to the host only", item.stream
            )

    def _send_stream0_error(self, code: str, message: str, stream: int) -> None:
        self._send(encode_error(0, {"code": code, "message": message, "stream": stream}))

    def _on_hello(self, frame: Frame) -> None:
        try:
            chosen = negotiate(frame.json())
        except (VersionMismatch, MalformedPayload) as exc:
            self._send(
                encode_error(0, {"code": exc.code, "message": exc.message, "protocol": PROTOCOL_VERSION})
            )
            return
        with self._lock:
            stale = list(self._calls.values())
            self._host_window = announced_window(frame.json()) if chosen >= FLOW_CONTROL_VERSION else None
        for call in stale:
            call.cancel()
        self._send(encode_json(FrameType.HELLO, 0, self.hello(negotiated=chosen)))

    def _on_call(self, frame: Frame) -> None:
        stream = frame.stream
        if stream == 0:
            self._send_stream0_error("protocol_error", "CALL on stream 0", 0)
            return
        if stream in self._calls:
            self._send_stream0_error("protocol_error", f"stream {stream} already has a call open", stream)
            return
        try:
            request = frame.json()
        except MalformedPayload as exc:
            self._send_error(stream, exc.code, exc.message)
            return
        method = request.get("method")
        params = request.get("params", {})
        if not (isinstance(method, str) and method.startswith(m.SYSTEM_PREFIX)):
            self.touch()  # the node's own health and activity polls must not keep a sandbox "busy"
        if not isinstance(method, str):
            self._send_error(stream, "malformed_payload", "CALL without a string 'method'")
            return
        if params is None:
            params = {}
        if not isinstance(params, dict):
            self._send_error(stream, "invalid_argument", "'params' must be a JSON object")
            return
        target = HANDLERS.get(method)
        if target is None:
            self._send_error(stream, "unknown_method", f"unknown method {method!r}")
            return
        window = self._host_window
        call = Call(
            stream,
            method,
            self.writer,
            self._call_done,
            send_window=window,
            receive_window=BODY_WINDOW if window is not None else None,
        )
        if method not in m.BODY_METHODS:
            call.inbound.refuse()
        call.traced = trace_ids.valid_trace_id(request.get(trace_ids.TRACE_FIELD))
        with self._lock:
            self._calls[stream] = call
            self._recent.discard(stream)
        self._submit((call, target, params))

    def _submit(self, job: tuple[Call, tuple[str, str], dict[str, Any]]) -> None:
        """Hand the call to an idle worker thread, or start one: creating a thread per call costs a few
        hundred microseconds inside a sandbox, more than a whole small call."""
        with self._pool_lock:
            if self._idle_workers > 0:
                self._idle_workers -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._worker, args=(job,), name="call-worker", daemon=True).start()

    def _worker(self, job: tuple[Call, tuple[str, str], dict[str, Any]]) -> None:
        while True:
            self._run_call(*job)
            with self._pool_lock:
                if self._idle_workers >= MAX_IDLE_WORKERS:
                    return
                self._idle_workers += 1  # each put() above is matched by exactly one idle worker
            job = self._jobs.get()

    def _run_call(self, call: Call, target: tuple[str, str], params: dict[str, Any]) -> None:
        try:
            module_name, function_name = target
            # import_module (not sys.modules) waits for a module the warm-up thread is still importing.
            module = importlib.import_module(module_name)
            handler: Handler = getattr(module, function_name)
            started = time.perf_counter_ns()
            result = handler(self, call, params) or {}
            if call.traced:  # the node's trace gets our own time for the call (ADR 0072)
                result = {**result, trace_ids.TIMING_FIELD: time.perf_counter_ns() - started}
            call.result(result)
        except ChannelClosed:
            return
        except Exception as exc:
            payload = error_payload(exc)
            if payload["code"] == "internal":
                import traceback

                log(f"{call.method} failed:\n{traceback.format_exc()}")
            with contextlib.suppress(ChannelClosed):
                call.error(payload)
        finally:
            if not call.finished:
                # Only reachable through BaseException (e.g. SystemExit): still end the stream.
                with contextlib.suppress(ChannelClosed):
                    call.error({"code": "internal", "message": "handler ended without an answer"})


def _warm_up() -> None:
    for module in ("space.guest.processes", "space.guest.files"):
        try:
            importlib.import_module(module)
        except Exception as exc:
            log(f"warm-up import of {module} failed: {exc!r}")


# --- sys.* handlers ---------------------------------------------------------------------------------------


def sys_ping(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    return {"time": time.time()}


def sys_info(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    table = daemon.processes_loaded
    now = time.time()
    return {
        "boot_id": daemon.boot_id,
        "pid": os.getpid(),
        "uptime": time.monotonic() - daemon.started_monotonic,
        "last_activity": daemon.last_activity,
        "idle_seconds": max(0.0, now - daemon.last_activity),
        "running_processes": table.running_count() if table is not None else 0,
        "protocol": PROTOCOL_VERSION,
    }


def sys_sync(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    os.sync()
    return {}


RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07), linux/random.h


def sys_reseed(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    entropy_hex = params.get("entropy", "")
    if not isinstance(entropy_hex, str):
        raise GuestError("invalid_argument", "'entropy' must be a hex string")
    try:
        entropy = bytes.fromhex(entropy_hex)
    except ValueError as exc:
        raise GuestError("invalid_argument", f"'entropy' is not hex: {exc}") from exc
    if entropy:
        try:
            # Writing mixes the bytes into the kernel pool (no entropy credit, which needs an ioctl);
            # a kernel or sandbox that refuses it still gets the daemon-level reseed below.
            with open("/dev/urandom", "wb") as pool:
                pool.write(entropy)
                # A real guest kernel (the qemu driver's microVMs, all restored from one checkpoint) keeps
                # handing out its cloned pool's bytes until it next reseeds: make it reseed now
                # (RNDRESEEDCRNG, root only; gVisor does not know it and has its own per-sandbox state).
                import fcntl

                fcntl.ioctl(pool, RNDRESEEDCRNG)
        except OSError:
            pass
    random.seed(entropy + os.urandom(32))
    daemon.boot_id = os.urandom(16).hex()
    return {}


def sys_configure(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    """Set environment variables every later process inherits (a sandbox started from a template's
    checkpoint gets its own env this way, since its daemon's environment came with the checkpoint)."""
    env = params.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise GuestError("invalid_argument", "'env' must map variable names to strings")
    os.environ.update(env)
    daemon.processes.set_base_environment(env)
    return {"env": sorted(env)}


# --- start-up --------------------------------------------------------------------------------------------


def take_over_stdio() -> tuple[int, int]:
    """Move the channel off fds 0/1 (or open SPACED_CHANNEL's device) and park 0/1/2 on /dev/null (2 on
    SPACED_LOG if set)."""
    import fcntl

    if SETTINGS.channel:
        # A microVM's init may start without fds 0-2 at all: the device lands above them either way.
        device = os.open(SETTINGS.channel, os.O_RDWR | os.O_CLOEXEC)
        channel_in = fcntl.fcntl(device, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
        channel_out = fcntl.fcntl(device, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
        os.close(device)
    else:
        channel_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
        channel_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD_MIN)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    log_path = SETTINGS.log_path
    log_fd = devnull
    if log_path:
        try:
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:
            log_fd = devnull
    os.dup2(log_fd, 2)
    for fd in {devnull, log_fd}:
        if fd > 2:
            os.close(fd)
    return channel_in, channel_out


def main() -> int:
    channel_in, channel_out = take_over_stdio()
    os.umask(0o022)
    is_init = os.getpid() == 1
    if is_init:
        import signal

        # PID 1 gets only the signals it handles; Python's SIGINT handler would raise KeyboardInterrupt in
        # the reader. A no-op handler (not SIG_IGN, which children would inherit through exec) defuses it.
        signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    reap_all = is_init or SETTINGS.reap_all
    daemon = Daemon(channel_in, channel_out, reap_all)
    if SETTINGS.user is not None:
        # A template with a default user gives it passwordless sudo through the daemon (ADR 0057).
        from space.guest import sudo

        sudo.start(daemon.children)
    return daemon.serve()
