"""Starting a process: process.start's params checked into a Launch, then the child forked with its stdio.

Invariants:
- Every param is checked before anything is created (no fd, no child): a bad one is invalid_argument, in
  the order the params are read below, so the same bad call always names the same param.
- Every process runs in its own session and process group (setsid), so a timeout or a signal reaches its
  whole group, and a PTY child gets the PTY slave as its controlling terminal (one ioctl between fork and
  exec, the only pre-exec hook).
- Children get a sane environment: the daemon's own environment minus SPACED_* and PYTHONPATH (the
  template's and sandbox's variables travel there), over defaults for PATH, HOME and LANG; the user's
  HOME, USER and LOGNAME; then the call's "env" wins. A PTY gets TERM=xterm-256color unless given.
- A call that names no "user" runs as the template's default user (SPACED_USER, settings.py), else as
  the daemon's own user (root); a call that names one, root included, runs as that one.
- A relative "cwd" is under the work directory (settings.py); no "cwd" is the work directory when it
  exists, else "/".
- The fork goes through the ChildWatcher (`children.spawn`), so the exit status reaches the Process
  however early the child exits. If starting fails, every fd opened for it is closed again.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import termios
from typing import Any, NamedTuple

from space.guest.channel import GuestError
from space.guest.children import ChildWatcher
from space.guest.params import get_bool, get_float, get_int, get_str, get_str_map
from space.guest.process import Process, set_winsize
from space.guest.settings import SETTINGS, inherited_environment
from space.protocol import commands
from space.protocol.frames import Channel

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PTY_SIZE = (24, 80)


class Launch(NamedTuple):
    """A checked process.start request (a NamedTuple: importing dataclasses costs spaced boot time)."""

    argv: list[str]
    tag: str | None
    background: bool
    stdin: bool  # a pipe for stdin (a PTY's stdin is always its terminal)
    timeout: float | None
    pty_size: tuple[int, int] | None
    env: dict[str, str]
    cwd: str
    popen_user: dict[str, Any]  # user/group/extra_groups for Popen when switching user


def parse_launch(params: dict[str, Any], base_env: dict[str, str]) -> Launch:
    argv = _argv(params)
    tag = get_str(params, "tag", None)
    background = get_bool(params, "background", False)
    want_stdin = get_bool(params, "stdin", False)
    timeout = get_float(params, commands.TIMEOUT, None)
    if timeout is not None and timeout <= 0:
        raise GuestError("invalid_argument", f"'{commands.TIMEOUT}' must be positive")
    pty_size = _pty_size(params.get("pty"))
    env = dict(base_env)
    named = params.get(commands.USER)
    user = resolve_user(SETTINGS.user if named is None else named)
    popen_user: dict[str, Any] = {}
    if user is not None:
        uid, gid, name, home, groups = user
        env.update(HOME=home, USER=name, LOGNAME=name)
        if uid != os.geteuid():
            popen_user = {"user": uid, "group": gid, "extra_groups": groups}
    if pty_size is not None:
        env["TERM"] = "xterm-256color"
    env.update(get_str_map(params, commands.ENV))
    cwd = _resolve_cwd(get_str(params, commands.CWD, None))
    return Launch(argv, tag, background, want_stdin, timeout, pty_size, env, cwd, popen_user)


def spawn(process: Process, launch: Launch, children: ChildWatcher) -> subprocess.Popen[bytes]:
    """Fork the child with its stdio wired to `process` (outputs, stdin, PTY master) and return its Popen."""
    child_fds: list[int] = []
    ours: list[int] = []
    try:
        popen_io, preexec = _wire_stdio(process, launch, child_fds, ours)

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                launch.argv,
                env=launch.env,
                cwd=launch.cwd,
                start_new_session=True,
                close_fds=True,
                preexec_fn=preexec,  # noqa: PLW1509 - PTY only; the hook is one ioctl, see above
                **popen_io,
                **launch.popen_user,
            )

        return children.spawn(start, process.on_exit)
    except BaseException:
        for fd in ours:
            os.close(fd)
        process.close_wake_pipe()
        raise
    finally:
        for fd in child_fds:
            os.close(fd)


def _wire_stdio(
    process: Process, launch: Launch, child_fds: list[int], ours: list[int]
) -> tuple[dict[str, Any], Any]:
    """Open the child's stdio (a PTY, or pipes); returns Popen's stdio arguments and its pre-exec hook.
    Fds are appended to `child_fds` (the child's ends) and `ours` as they are opened, for the caller to
    close."""
    popen_io: dict[str, Any]
    preexec = None
    if launch.pty_size is not None:
        import pty

        master, slave = pty.openpty()
        ours.append(master)
        child_fds.append(slave)
        set_winsize(master, *launch.pty_size)
        process.master_fd = master
        process.stdin_fd = master
        process.outputs = {master: Channel.STDOUT}
        popen_io = {"stdin": slave, "stdout": slave, "stderr": slave}
        preexec = _take_controlling_tty
    else:
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        ours += [out_read, err_read]
        child_fds += [out_write, err_write]
        process.outputs = {out_read: Channel.STDOUT, err_read: Channel.STDERR}
        popen_io = {"stdin": subprocess.DEVNULL, "stdout": out_write, "stderr": err_write}
        if launch.stdin:
            in_read, in_write = os.pipe()
            ours.append(in_write)
            child_fds.append(in_read)
            process.stdin_fd = in_write
            popen_io["stdin"] = in_read
    if process.stdin_fd is not None:
        os.set_blocking(process.stdin_fd, False)
    return popen_io, preexec


def base_environment() -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    env.update(inherited_environment())
    return env


def _argv(params: dict[str, Any]) -> list[str]:
    argv = params.get(commands.ARGV)
    cmd = params.get(commands.CMD)
    if (argv is None) == (cmd is None):
        raise GuestError("invalid_argument", commands.ONE_COMMAND)
    if cmd is not None:
        if not isinstance(cmd, str) or "\x00" in cmd:
            raise GuestError("invalid_argument", f"'{commands.CMD}' must be a string without NUL bytes")
        return ["/bin/sh", "-c", cmd]
    # NUL bytes cannot be passed to exec (found by fuzzing: they were an internal error).
    if not isinstance(argv, list) or not argv or not all(_exec_string(a) for a in argv):
        raise GuestError("invalid_argument", f"'{commands.ARGV}' must be a list of NUL-free strings")
    return argv


def _exec_string(value: Any) -> bool:
    return isinstance(value, str) and "\x00" not in value


def _pty_size(value: Any) -> tuple[int, int] | None:
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_PTY_SIZE
    if not isinstance(value, dict):
        raise GuestError("invalid_argument", "'pty' must be an object {rows, cols} or true")
    rows = get_int(value, "rows", DEFAULT_PTY_SIZE[0])
    cols = get_int(value, "cols", DEFAULT_PTY_SIZE[1])
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_argument", "PTY rows and cols must be 1..65535")
    return rows, cols


def _take_controlling_tty() -> None:
    # Runs in the child between fork and exec, after setsid: only a plain ioctl, no locks, no imports.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def resolve_user(value: Any) -> tuple[int, int, str, str, list[int]] | None:
    """(uid, gid, name, home, supplementary groups) of a user given by name or uid."""
    if value is None:
        return None
    import pwd

    if isinstance(value, str) and value.isdigit():
        value = int(value)
    try:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise GuestError("invalid_argument", "'user' must be a name or a uid")
        entry = pwd.getpwnam(value) if isinstance(value, str) else pwd.getpwuid(value)
    except KeyError:
        if isinstance(value, int) and value >= 0:
            return value, value, str(value), "/", []
        raise GuestError("invalid_argument", f"unknown user {value!r}") from None
    try:
        groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    except OSError:
        groups = [entry.pw_gid]
    return entry.pw_uid, entry.pw_gid, entry.pw_name, entry.pw_dir, groups


def _resolve_cwd(cwd: str | None) -> str:
    workdir = SETTINGS.workdir
    if cwd is None:
        return workdir if os.path.isdir(workdir) else "/"
    return os.path.join(workdir, cwd)
