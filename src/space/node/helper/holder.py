"""The per-sandbox holder: parent of one `runsc run|restore` process, keeper of its stdio pipes.

The sandbox's private channel is its init's stdin/stdout, which are pipes owned by the runsc process. The
holder owns those pipes and relays them, byte for byte, to whichever node agent is connected to its unix
socket, so the agent can die and reconnect without the sandbox noticing.

Invariants:
- Exactly one client at a time: a new connection replaces the old one (a restarted agent is the owner).
- Bytes from the sandbox are never dropped while no agent is connected: they are buffered up to
  MAX_BUFFERED, then the holder stops reading (the sandbox blocks on its pipe) until an agent comes back.
- When runsc exits, the holder records its exit status in `exit.json` next to the socket, removes the
  socket and exits; so a vanished socket plus `exit.json` always means "this runtime is gone". Only while
  its socket is still the one it bound there: a runtime the helper discards (Runtimes.discard, ADR 0088)
  has its socket unlinked before its processes are killed, and its successor may have taken the run
  directory by the time this holder has reaped them; it then leaves the directory alone. The record
  also says how often the sandbox's host cgroup enforced its limits by then (`oom_kills`: processes the
  host's OOM killer killed; `task_limit_hits`: forks the host refused), read before anything removes the
  cgroup, so a crash can name its reason (ADR 0036).
- runsc runs the sandbox detached (`--detach`, ADR 0045): `runsc run|restore` exits once the sandbox is up
  instead of staying beside it (~4 MB each). The holder is a child subreaper, so the sandbox and gofer
  processes become its children: it reaps them, and records the sandbox process' exit status (the
  container's, as runsc reports it: 128 + N for a signal) unless runsc itself failed to start it.
- Standard library only (with space.node.helper.holder_record, its files' writer, found the same way),
  started with `python3 -I -S` importing this module by its directory, not through
  the `space` package (whose `typing` import alone costs more than the relay: Runtimes.holder_argv), ahead
  of need as a spare (`--spare`), so its start-up time is not part of sandbox creation.
- Small, because one lives beside every sandbox (ADR 0045): while the sandbox runs it has loaded only
  built-in and extension modules (`os`, `select`, `fcntl`, `_socket`, `time`; `_signal` is loaded by every
  interpreter), no `subprocess`, `selectors`, `socket`, `signal`, `json` or `contextlib`; `json` is
  imported only once the runtime has ended.
"""

from __future__ import annotations

import _socket
import fcntl
import os
import select
import sys
import time

try:  # run as a holder: its own directory is on sys.path, the `space` package is not (Runtimes.holder_argv)
    import holder_record  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # imported from the package (the helper, tests)
    from space.node.helper import holder_record

MAX_BUFFERED = 8 << 20
READ_SIZE = 1 << 20
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: The interpreter loads `_signal` before any code runs; taking it from there keeps `signal` (and `enum`,
#: which it imports) out of the holder.
_SIGNAL = sys.modules["_signal"]
POLLIN, POLLOUT = select.POLLIN, select.POLLOUT
POLLDONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def _unlink(path: str) -> None:
    try:  # noqa: SIM105 - `contextlib` would cost every holder ~0.6 MB
        os.unlink(path)
    except FileNotFoundError:
        pass


PR_SET_CHILD_SUBREAPER = 36
DETACH = "--detach"
#: How long the runtime's other processes may outlive the sandbox process before the holder kills them.
STRAGGLER_GRACE_S = 5.0
#: How often the holder looks for its runtime's last processes once the sandbox has closed its channel: a
#: stop waits for this holder's exit, so the poll's period is part of every stop (10 ms cost 5 on average).
REAP_POLL_S = 0.001


def become_subreaper() -> None:
    """Orphans of our children (a detached runsc's sandbox and gofer) become ours, not init's."""
    import ctypes  # ~0.3 MB, only where runsc runs detached

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as handle:
            return [int(pid) for pid in handle.read().split()]
    except OSError:
        return []


def _is_sandbox_process(pid: int) -> bool:
    """runsc's sandbox process (the Sentry) runs `runsc-sandbox ... boot ...`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"boot" in handle.read().split(b"\0")
    except OSError:
        return False


def spawn_runtime(argv: list[str]) -> tuple[int, int, int]:
    """Start `argv` with fresh pipes as stdin and stdout and the holder's stderr (the log): returns (pid,
    the write end of its stdin, the read end of its stdout). Every other descriptor of the holder is
    close-on-exec (Python's default), and SIGPIPE is reset to its default for the runtime."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            os.environ,
            file_actions=[(os.POSIX_SPAWN_DUP2, stdin_r, 0), (os.POSIX_SPAWN_DUP2, stdout_w, 1)],
            setsigdef=(_SIGNAL.SIGPIPE,),
        )
    finally:
        os.close(stdin_r)
        os.close(stdout_w)
    for pipe_fd in (stdout_r, stdin_w):
        # Bigger pipes mean fewer wake-ups of the sandbox per megabyte moved (1 MiB is the default cap).
        try:  # noqa: SIM105 - see _unlink
            fcntl.fcntl(pipe_fd, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass
        os.set_blocking(pipe_fd, False)
    return pid, stdin_w, stdout_r


class Holder:
    def __init__(self, socket_path: str, owner_uid: int, argv: list[str], log_path: str) -> None:
        self.socket_path = socket_path
        self.run_dir = os.path.dirname(socket_path)
        self.owner_uid = owner_uid
        self.argv = argv
        self.log_path = log_path
        self.client: _socket.socket | None = None
        self.to_client = bytearray()
        self.to_sandbox = bytearray()
        self.poller = select.poll()
        self.interest: dict[int, int] = {}
        self.detached = DETACH in argv
        self.runtime_pid = 0
        self.started_at = 0.0
        self.sandbox_pid: int | None = None  # detached: the sandbox process, once runsc has handed it over
        self.reaped: dict[int, int] = {}  # pid -> exit code (negative: the signal), for every child reaped
        self.socket_inode = 0  # of the socket this holder bound, to know it is still the one at its path

    def _listen(self) -> _socket.socket:
        # Bound under a temporary name and renamed into place once owned and listening: whoever sees the
        # socket path can connect to it at once.
        staging = f"{self.socket_path}.{os.getpid()}"
        listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        listener.bind(staging)
        self.socket_inode = os.stat(staging).st_ino
        os.chmod(staging, 0o600)
        os.chown(staging, self.owner_uid, -1)
        listener.listen(16)
        listener.setblocking(False)
        os.rename(staging, self.socket_path)
        return listener

    def run(self) -> int:
        _unlink(self.socket_path)
        _unlink(os.path.join(self.run_dir, "exit.json"))
        listener = self._listen()
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 2)  # runsc's messages: root only
        os.close(log_fd)
        if self.detached:
            become_subreaper()
        pid, sandbox_in, sandbox_out = spawn_runtime(self.argv)
        self.runtime_pid = pid
        self.started_at = time.time()
        self._write_info(pid)
        _SIGNAL.signal(_SIGNAL.SIGTERM, lambda *_: None)  # the runtime's end, not a signal, ends the holder
        _SIGNAL.signal(_SIGNAL.SIGPIPE, _SIGNAL.SIG_IGN)

        self._set(listener.fileno(), POLLIN)
        sandbox_open = True
        while sandbox_open:
            self._update_interest(sandbox_in, sandbox_out)
            # Until runsc has handed the sandbox over, wake often to reap it and take over its processes.
            waiting = self.detached and self.runtime_pid not in self.reaped
            for fd, events in self.poller.poll(20 if waiting else 1000):
                if fd == listener.fileno():
                    self._accept(listener)
                elif fd == sandbox_out:
                    sandbox_open = self._read_sandbox(sandbox_out)
                elif fd == sandbox_in:
                    self._flush_to_sandbox(sandbox_in)
                elif self.client is not None and fd == self.client.fileno():
                    self._client_ready(events)
            if self._reap() and len(self.to_client) >= MAX_BUFFERED:
                # The runtime ended while its output sat unread (no agent, or one that gave up on a hostile
                # guest): the sandbox end is not polled then, so its EOF would never be seen.
                break
        # The runtime closed its stdout: deliver what is left, then record how it ended.
        self._drain_to_client_blocking()
        code = self._wait()
        if self._owns_run_dir():
            _unlink(self.socket_path)
            ended: dict[str, object] = {
                "exit_code": code,
                "ended_at": time.time(),
                **holder_record.limit_events(self.argv),
            }
            holder_record.write_json(os.path.join(self.run_dir, "exit.json"), ended)
        if self.client is not None:
            self.client.close()
        listener.close()
        return 0

    def _owns_run_dir(self) -> bool:
        """Whether the socket at this holder's path is still the one it bound (not unlinked by a discard,
        nor replaced by a successor's)."""
        try:
            return os.stat(self.socket_path).st_ino == self.socket_inode
        except OSError:
            return False

    def _write_info(self, runtime_pid: int) -> None:
        """holder.json: `runtime_pid` is the process whose end is the runtime's end (runsc's own, then the
        sandbox process once a detached runsc has handed it over); `runsc_pid` is runsc's."""
        info: dict[str, object] = {"holder_pid": os.getpid(), "runtime_pid": runtime_pid}
        info.update(runsc_pid=self.runtime_pid, started_at=self.started_at, argv=self.argv)
        holder_record.write_json(os.path.join(self.run_dir, "holder.json"), info)

    # -- the runtime processes ----------------------------------------------------------------------
    def _reap(self) -> bool:
        """Reap whichever children have exited, without blocking; whether none is left (the runtime, and
        when detached the sandbox and gofer it handed over, are all gone)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return False
            self.reaped[pid] = os.waitstatus_to_exitcode(status)
            if pid == self.runtime_pid and self.detached and self.reaped[pid] == 0:
                self._handed_over()

    def _handed_over(self) -> None:
        """runsc started the sandbox and left: its processes are ours now. holder.json names the sandbox
        process (the Sentry) as the runtime from here on: the process whose end is the runtime's end."""
        self.sandbox_pid = next((c for c in _children() if _is_sandbox_process(c)), None)
        if self.sandbox_pid is not None:
            self._write_info(self.sandbox_pid)

    def _wait(self) -> int | None:
        """Wait for every child, then the exit code to record: the runtime's own when it failed or ran
        attached, else the sandbox process' (None: not known)."""
        deadline: float | None = None
        while not self._reap():
            if deadline is None and (self.sandbox_pid is None or self.sandbox_pid in self.reaped):
                deadline = time.monotonic() + STRAGGLER_GRACE_S
            elif deadline is not None and time.monotonic() > deadline:
                for pid in _children():  # e.g. a gofer that outlives its sandbox: ours to end
                    try:  # noqa: SIM105 - see _unlink
                        os.kill(pid, _SIGNAL.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(REAP_POLL_S)
        runtime_code = self.reaped.get(self.runtime_pid)
        if not self.detached or runtime_code != 0:
            return runtime_code
        code = self.reaped.get(self.sandbox_pid) if self.sandbox_pid is not None else None
        return 128 - code if code is not None and code < 0 else code

    # -- event handlers -----------------------------------------------------------------------------
    def _accept(self, listener: _socket.socket) -> None:
        try:
            # `_socket.socket._accept` is what `socket.socket.accept` calls: the descriptor of the new
            # connection (the `socket` module would import `enum` and `selectors`).
            fd, _ = listener._accept()  # type: ignore[attr-defined]
        except BlockingIOError:
            return
        if self.client is not None:
            self._drop_client()
        conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, fd)
        conn.setblocking(False)
        self.client = conn
        self._set(fd, POLLIN)

    def _drop_client(self) -> None:
        if self.client is None:
            return
        self._set(self.client.fileno(), 0)
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
        if events & POLLOUT:
            self._flush_to_client()
        if self.client is not None and events & (POLLIN | POLLDONE):
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
        self._set(sandbox_in, POLLOUT if self.to_sandbox else 0)
        self._set(sandbox_out, POLLIN if len(self.to_client) < MAX_BUFFERED else 0)
        if self.client is not None:
            events = 0
            if len(self.to_sandbox) < MAX_BUFFERED:
                events |= POLLIN
            if self.to_client:
                events |= POLLOUT
            self._set(self.client.fileno(), events)

    def _set(self, fd: int, events: int) -> None:
        current = self.interest.get(fd, 0)
        if events == current:
            return
        if events == 0:
            self.poller.unregister(fd)
            del self.interest[fd]
        elif current == 0:
            self.poller.register(fd, events)
            self.interest[fd] = events
        else:
            self.poller.modify(fd, events)
            self.interest[fd] = events

    def _drain_to_client_blocking(self) -> None:
        if self.client is None or not self.to_client:
            return
        try:
            self.client.settimeout(2.0)
            self.client.sendall(self.to_client)
        except OSError:
            pass
        self.to_client.clear()


def parse_assignment(raw: bytes) -> list[str] | None:
    """The job a spare is handed: NUL-separated `socket, owner uid, log, runtime argv...` (no field of
    which can hold a NUL), read to EOF. None when the helper went away before using this spare."""
    if not raw:
        return None
    fields = raw.decode().split("\0")
    if len(fields) < 4 or not fields[1].isdigit():
        raise ValueError("malformed holder assignment")
    return [fields[0], fields[1], fields[2], "--", *fields[3:]]


def encode_assignment(socket_path: str, owner_uid: int, log_path: str, argv: list[str]) -> bytes:
    fields = [socket_path, str(owner_uid), log_path, *argv]
    if any("\0" in field for field in fields):
        raise ValueError("a holder assignment cannot carry a NUL byte")
    return "\0".join(fields).encode()


def _wait_for_assignment() -> list[str] | None:
    """A spare holder is started ahead of need and blocks here until the helper hands it a sandbox (written
    to its stdin, which the helper then closes), so creating a sandbox does not wait for an interpreter."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    assigned = parse_assignment(b"".join(chunks))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return assigned


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
