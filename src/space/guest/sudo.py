"""Passwordless sudo for a template's default user, served by spaced (ADR 0057).

gVisor ignores set-user-ID bits (every exec behaves as if no_new_privs were set), so Debian's setuid `sudo`
cannot make its caller root inside a sandbox. A template with a default user (SPACED_USER, e.g. `base`)
therefore puts a small client first on PATH (`sudo`, space.guest.sudo_client) that asks this daemon (root)
over an abstract unix socket to start the command as root, or as `-u USER`, with the caller's
stdin/stdout/stderr (passed as file descriptors) and working directory, and relays the command's exit
status and the signals the caller receives.

Invariants:
- Only the template's default user and root may use it: the peer's uid (SO_PEERCRED, set by the kernel at
  connect) is checked before anything is read; anyone else gets "refused" and nothing runs. This grants
  no more than the API already does: an API caller may run any command as root (`user: "root"`).
- The socket is in the abstract namespace (no file in the sandbox's root filesystem, nothing on the host)
  and only exists when the daemon has a default user (SPACED_USER): `python` sandboxes have none.
- A request is bounded (MAX_REQUEST bytes, MAX_ARGS arguments, MAX_ENV variables), validated, and carries
  exactly three descriptors; bad requests answer "error ..." and run nothing. Received descriptors are
  closed by the daemon once the child holds them, whatever happened.
- The command runs in a session of its own (no controlling terminal; it still reads and writes the
  caller's terminal through the passed descriptors), started through the ChildWatcher so its exit status
  is never lost to the reaper; the answer is "exit N" (128 + signal number when a signal ended it). A
  "kill N" line from the client signals the command's process group (how Ctrl-C reaches it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import socket
import struct
import subprocess
import threading
from typing import Any, NamedTuple

from space.guest.channel import GuestError
from space.guest.children import ChildWatcher
from space.guest.launch import DEFAULT_PATH, resolve_user
from space.guest.settings import SETTINGS

MAX_REQUEST = 256 << 10
MAX_ARGS = 4096
MAX_ENV = 1024
KEPT_VARIABLES = ("TERM", "LANG", "LC_ALL", "LC_CTYPE", "COLORTERM", "COLUMNS", "LINES")
_HEADER = struct.Struct("!I")
_UCRED = struct.Struct("3i")


class SudoLaunch(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    cwd: str
    popen_user: dict[str, Any]


def start(children: ChildWatcher) -> bool:
    """Listen for sudo requests when the daemon has a default user; False when it has none (or the socket
    cannot be made: the sandbox then simply has no sudo)."""
    if SETTINGS.user is None:
        return False
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        server.bind("\0" + SETTINGS.sudo_socket)
        server.listen(16)
    except OSError as exc:
        server.close()
        os.write(2, f"spaced: no sudo service: {exc!r}\n".encode())
        return False
    threading.Thread(target=_serve, args=(children, server), name="sudo", daemon=True).start()
    return True


def _serve(children: ChildWatcher, server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            continue
        threading.Thread(target=_handle, args=(children, conn), name="sudo-call", daemon=True).start()


def allowed_uids() -> set[int]:
    allowed = {0}
    if SETTINGS.user is not None:
        try:
            user = resolve_user(SETTINGS.user)
        except GuestError:
            user = None
        if user is not None:
            allowed.add(user[0])
    return allowed


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected process, as the kernel recorded them at connect."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def _handle(children: ChildWatcher, conn: socket.socket) -> None:
    fds: list[int] = []
    with conn:
        try:
            _pid, uid, gid = _peer(conn)
            if uid not in allowed_uids():
                conn.sendall(b"refused this user may not use sudo in this sandbox\n")
                return
            request, fds = _receive(conn)
            launch = build_launch(request, uid, gid)
            process, done = _spawn(children, launch, fds)
        except (OSError, ValueError, GuestError) as exc:
            message = exc.message if isinstance(exc, GuestError) else str(exc)
            _send(conn, f"error {message}")
            return
        finally:
            for fd in fds:
                os.close(fd)
        threading.Thread(
            target=_relay_signals, args=(conn, process.pid), name="sudo-signals", daemon=True
        ).start()
        done.wait()
        _send(conn, f"exit {process.returncode}")


def _send(conn: socket.socket, line: str) -> None:
    # A client that went away gets nothing; the command ran (or runs) all the same, as with sudo.
    with contextlib.suppress(OSError):
        conn.sendall(line.replace("\n", " ").encode(errors="replace") + b"\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request (length-prefixed JSON) and the three descriptors sent with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 64 << 10, 3)
    try:
        if len(fds) != 3:
            raise ValueError("a request carries exactly three descriptors (stdin, stdout, stderr)")
        while len(data) < _HEADER.size:
            data += _recv_some(conn)
        (size,) = _HEADER.unpack_from(data)
        if size > MAX_REQUEST:
            raise ValueError(f"request larger than {MAX_REQUEST} bytes")
        while len(data) < _HEADER.size + size:
            data += _recv_some(conn)
        request = json.loads(data[_HEADER.size : _HEADER.size + size])
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _recv_some(conn: socket.socket) -> bytes:
    chunk = conn.recv(64 << 10)
    if not chunk:
        raise ValueError("the request ended early")
    return chunk


def _strings(value: Any, what: str, limit: int) -> list[str]:
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"{what} must be a list of at most {limit} strings")
    if not all(isinstance(item, str) and "\0" not in item for item in value):
        raise ValueError(f"{what} must hold NUL-free strings")
    return value


def _environment(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_ENV:
        raise ValueError(f"env must be an object of at most {MAX_ENV} variables")
    for key, item in value.items():
        if not (isinstance(item, str) and key and "=" not in key and "\0" not in key + item):
            raise ValueError("env must map variable names to NUL-free strings")
    return value


def build_launch(request: dict[str, Any], caller_uid: int, caller_gid: int) -> SudoLaunch:
    """What to start for a checked request: argv, environment (sudo's env_reset unless preserve_env),
    working directory and the user to switch to."""
    args = _strings(request.get("argv", []), "argv", MAX_ARGS)
    client_env = _environment(request.get("env", {}))
    target_name = request.get("user") or "root"
    target = resolve_user(target_name)
    assert target is not None
    uid, gid, name, home, groups = target
    try:
        shell = pwd.getpwuid(uid).pw_shell or "/bin/sh"
    except KeyError:
        shell = "/bin/sh"
    login, as_shell = bool(request.get("login")), bool(request.get("shell"))
    if login or as_shell:
        argv = [shell, *(["-l"] if login else []), *(["-c", " ".join(args)] if args else [])]
    elif args:
        argv = args
    else:
        raise ValueError("no command")
    cwd = request.get("cwd")
    if login or not (isinstance(cwd, str) and cwd.startswith("/") and os.path.isdir(cwd)):
        cwd = home if os.path.isdir(home) else "/"
    env = (
        dict(client_env)
        if request.get("preserve_env")
        else {key: client_env[key] for key in KEPT_VARIABLES if key in client_env}
    )
    env.update(PATH=env.get("PATH", DEFAULT_PATH) if request.get("preserve_env") else DEFAULT_PATH)
    env.update(HOME=home, USER=name, LOGNAME=name, SHELL=shell, SUDO_COMMAND=" ".join(argv)[:4096])
    env.update(SUDO_UID=str(caller_uid), SUDO_GID=str(caller_gid), SUDO_USER=_name_of(caller_uid))
    popen_user = {"user": uid, "group": gid, "extra_groups": groups} if uid != os.geteuid() else {}
    return SudoLaunch(argv, env, cwd, popen_user)


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _spawn(
    children: ChildWatcher, launch: SudoLaunch, fds: list[int]
) -> tuple[subprocess.Popen[bytes], threading.Event]:
    done = threading.Event()
    holder: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(  # any command: that is what sudo is for
            launch.argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=launch.cwd, env=launch.env,
            start_new_session=True, close_fds=True, **launch.popen_user,
        )  # fmt: skip
        holder.append(process)
        return process

    def on_exit(status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        # Set before `done`: the Popen never waits itself (the ChildWatcher owns waitpid).
        holder[0].returncode = code if code >= 0 else 128 - code
        done.set()

    process = children.spawn(start, on_exit)
    return process, done


def _relay_signals(conn: socket.socket, pid: int) -> None:
    """`kill N` lines from the client signal the command's process group, until the client goes."""
    buffered = b""
    while True:
        try:
            chunk = conn.recv(4096)
        except OSError:
            return
        if not chunk:
            return
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            parts = line.split()
            if len(parts) == 2 and parts[0] == b"kill" and parts[1].isdigit():
                number = int(parts[1])
                if 0 < number < signal.NSIG:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, number)
        buffered = buffered[-64:]  # a line never needs more; junk cannot grow it
