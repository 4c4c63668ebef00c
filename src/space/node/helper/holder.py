"""The per-sandbox holder: parent of one `runsc run|restore` process, keeper of its stdio pipes.

The sandbox's private channel is its init's stdin/stdout, which are pipes owned by the runsc process. The
holder owns those pipes and relays them, byte for byte, to whichever node agent is connected to its unix
socket, so the agent can die and reconnect without the sandbox noticing.

Invariants:
- Exactly one client at a time: a new connection replaces the old one (a restarted agent is the owner).
- Bytes from the sandbox are never dropped while no agent is connected: they are buffered up to
  MAX_BUFFERED, then the holder stops reading (the sandbox blocks on its pipe) until an agent comes back.
- When runsc exits, the holder records its exit status in `exit.json` next to the socket, removes the
  socket and exits; so a vanished socket plus `exit.json` always means "this runtime is gone". The record
  also says how often the sandbox's host cgroup enforced its limits by then (`oom_kills`: processes the
  host's OOM killer killed; `task_limit_hits`: forks the host refused), read before anything removes the
  cgroup, so a crash can name its reason (ADR 0036).
- Standard library only and started with `python3 -S`, ahead of need as a spare (`--spare`), so its
  start-up time is not part of sandbox creation.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

MAX_BUFFERED = 8 << 20
READ_SIZE = 1 << 20
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _write_json(path: str, value: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(value, handle)
    os.replace(tmp, path)


CGROUP_ROOT = "/sys/fs/cgroup"


def _counter(path: str, key: str) -> int | None:
    """The value of `key` in a cgroup file of `key value` lines (None if unreadable)."""
    try:
        with open(path) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


def limit_events(argv: list[str]) -> dict[str, int]:
    """How often the host enforced the sandbox's limits while the runtime of `argv` ran (cgroup v1 or v2;
    empty when its cgroup cannot be found)."""
    bundle = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--bundle=")), None)
    if bundle is None:
        return {}
    try:
        with open(os.path.join(bundle, "config.json")) as handle:
            cgroup = json.load(handle)["linux"]["cgroupsPath"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(cgroup, str) or not cgroup.startswith("/") or ".." in cgroup.split("/"):
        return {}
    sources = {
        "oom_kills": [
            (f"memory{cgroup}/memory.oom_control", "oom_kill"),
            (f"{cgroup[1:]}/memory.events", "oom_kill"),
        ],
        "task_limit_hits": [(f"pids{cgroup}/pids.events", "max"), (f"{cgroup[1:]}/pids.events", "max")],
    }
    found: dict[str, int] = {}
    for name, places in sources.items():
        for relative, key in places:
            value = _counter(os.path.join(CGROUP_ROOT, relative), key)
            if value is not None:
                found[name] = value
                break
    return found


class Holder:
    def __init__(self, socket_path: str, owner_uid: int, argv: list[str], log_path: str) -> None:
        self.socket_path = socket_path
        self.run_dir = os.path.dirname(socket_path)
        self.owner_uid = owner_uid
        self.argv = argv
        self.log_path = log_path
        self.client: socket.socket | None = None
        self.to_client = bytearray()
        self.to_sandbox = bytearray()
        self.selector = selectors.DefaultSelector()

    def run(self) -> int:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, "exit.json"))
        # Bound under a temporary name and renamed into place once owned and listening: whoever sees the
        # socket path can connect to it at once.
        staging = f"{self.socket_path}.{os.getpid()}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(staging)
        os.chmod(staging, 0o600)
        os.chown(staging, self.owner_uid, -1)
        listener.listen(16)
        listener.setblocking(False)
        os.rename(staging, self.socket_path)

        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the child
        child = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, close_fds=True
        )
        assert child.stdin is not None and child.stdout is not None
        sandbox_out = child.stdout.fileno()
        sandbox_in = child.stdin.fileno()
        for pipe_fd in (sandbox_out, sandbox_in):
            # Bigger pipes mean fewer wake-ups of the sandbox per megabyte moved (1 MiB is the default cap).
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe_fd, F_SETPIPE_SZ, PIPE_SIZE)
        os.set_blocking(sandbox_out, False)
        os.set_blocking(sandbox_in, False)
        _write_json(
            os.path.join(self.run_dir, "holder.json"),
            {
                "holder_pid": os.getpid(),
                "runtime_pid": child.pid,
                "started_at": time.time(),
                "argv": self.argv,
            },
        )
        signal.signal(signal.SIGTERM, lambda *_: None)  # the runtime's end, not a signal, ends the holder
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(sandbox_out, selectors.EVENT_READ, "sandbox")
        sandbox_open = True
        while sandbox_open:
            self._update_interest(sandbox_in, sandbox_out)
            for key, _mask in self.selector.select(timeout=1.0):
                tag = key.data
                if tag == "accept":
                    self._accept(listener)
                elif tag == "sandbox":
                    sandbox_open = self._read_sandbox(sandbox_out)
                elif tag == "sandbox_in":
                    self._flush_to_sandbox(sandbox_in)
                elif tag == "client":
                    self._client_ready(key.events)
            if len(self.to_client) >= MAX_BUFFERED and child.poll() is not None:
                # The runtime ended while its output sat unread (no agent, or one that gave up on a hostile
                # guest): the sandbox end is not polled then, so its EOF would never be seen.
                break
        # The runtime closed its stdout: deliver what is left, then record how it ended.
        self._drain_to_client_blocking()
        code = child.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        ended: dict[str, object] = {"exit_code": code, "ended_at": time.time(), **limit_events(self.argv)}
        _write_json(os.path.join(self.run_dir, "exit.json"), ended)
        if self.client is not None:
            self.client.close()
        listener.close()
        return 0

    # -- event handlers -----------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        if self.client is not None:
            self._drop_client()
        conn.setblocking(False)
        self.client = conn
        self.selector.register(conn, selectors.EVENT_READ, "client")

    def _drop_client(self) -> None:
        if self.client is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.client)
        self.client.close()
        self.client = None
        # Half a frame may have gone to the old client; the daemon resynchronises on frame headers and the
        # new client ignores streams it did not open, so the rest of the buffer is still worth delivering.

    def _read_sandbox(self, fd: int) -> bool:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.to_client += data
        self._flush_to_client()
        return True

    def _flush_to_client(self) -> None:
        if self.client is None or not self.to_client:
            return
        try:
            sent = self.client.send(self.to_client)
        except BlockingIOError:
            return
        except OSError:
            self._drop_client()
            return
        del self.to_client[:sent]

    def _client_ready(self, events: int) -> None:
        if self.client is None:
            return
        if events & selectors.EVENT_WRITE:
            self._flush_to_client()
        if self.client is not None and events & selectors.EVENT_READ:
            try:
                data = self.client.recv(READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._drop_client()
                return
            self.to_sandbox += data

    def _flush_to_sandbox(self, fd: int) -> None:
        if not self.to_sandbox:
            return
        try:
            written = os.write(fd, self.to_sandbox)
        except BlockingIOError:
            return
        except BrokenPipeError:
            self.to_sandbox.clear()
            return
        del self.to_sandbox[:written]

    def _update_interest(self, sandbox_in: int, sandbox_out: int) -> None:
        """Re-register interests so that full buffers push back instead of growing."""
        if self.to_sandbox:
            self._flush_to_sandbox(sandbox_in)
        want_in = bool(self.to_sandbox)
        self._set(sandbox_in, selectors.EVENT_WRITE if want_in else 0, "sandbox_in")
        self._set(sandbox_out, selectors.EVENT_READ if len(self.to_client) < MAX_BUFFERED else 0, "sandbox")
        if self.client is not None:
            events = 0
            if len(self.to_sandbox) < MAX_BUFFERED:
                events |= selectors.EVENT_READ
            if self.to_client:
                events |= selectors.EVENT_WRITE
            self._set(self.client, events, "client")

    def _set(self, fileobj: int | socket.socket, events: int, tag: str) -> None:
        try:
            key = self.selector.get_key(fileobj)
        except KeyError:
            key = None
        if events == 0:
            if key is not None:
                self.selector.unregister(fileobj)
            return
        if key is None:
            self.selector.register(fileobj, events, tag)
        elif key.events != events:
            self.selector.modify(fileobj, events, tag)

    def _drain_to_client_blocking(self) -> None:
        if self.client is None or not self.to_client:
            return
        with contextlib.suppress(OSError):
            self.client.setblocking(True)
            self.client.settimeout(2.0)
            self.client.sendall(self.to_client)
        self.to_client.clear()


def _wait_for_assignment() -> list[str] | None:
    """A spare holder is started ahead of need and blocks here until the helper hands it a sandbox (one JSON
    line on stdin), so creating a sandbox does not wait for a Python interpreter to start."""
    line = sys.stdin.buffer.readline()
    if not line:
        return None  # the helper went away before using this spare
    job = json.loads(line)
    log_fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # runsc's messages: root only
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return [job["socket"], str(job["owner_uid"]), job["log"], "--", *job["argv"]]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--spare"]:
        assigned = _wait_for_assignment()
        if assigned is None:
            return 0
        args = assigned
    if "--" not in args:
        print("usage: holder SOCKET OWNER_UID LOG -- RUNTIME_ARGV...", file=sys.stderr)
        return 2
    split = args.index("--")
    head, runtime_argv = args[:split], args[split + 1 :]
    if len(head) != 3 or not runtime_argv:
        print("usage: holder SOCKET OWNER_UID LOG -- RUNTIME_ARGV...", file=sys.stderr)
        return 2
    socket_path, owner_uid, log_path = head
    return Holder(socket_path, int(owner_uid), runtime_argv, log_path).run()


if __name__ == "__main__":
    raise SystemExit(main())
