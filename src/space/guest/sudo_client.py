"""`sudo` inside a sandbox whose template has a default user (ADR 0057): a client of spaced's sudo service
(space.guest.sudo), run as `python3 -I -S -B <this file> ARGS...` by the template's /usr/local/bin/sudo.

It understands the options agents use: -n (never prompts anyway), -u USER, -E / --preserve-env, -H, -i,
-s, -k/-K/-v (nothing to do), -V, -h, and `--`. It sends the command, its environment and working
directory with its stdin/stdout/stderr descriptors, forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2
to the command, and exits with the command's status.

Invariants:
- Standard library only, and self-contained: it runs as a script, not as part of the `space` package.
- It never runs anything itself; a refusal or a failure to reach the daemon is exit status 1 with a
  `sudo: ...` message on stderr, as sudo's own failures are.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys

#: The service's abstract socket name; SPACE_SUDO_SOCKET is only set by tests running daemons side by side.
SOCKET_NAME = "\0" + (os.environ.get("SPACE_SUDO_SOCKET") or "space-sudo")
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
USAGE = "usage: sudo [-EHiksnVv] [-u user] [--] [command [arg ...]]\n"
NO_COMMAND_NEEDED = frozenset("kKv")
LONG_OPTIONS = {
    "--login": "-i", "--shell": "-s", "--non-interactive": "-n", "--set-home": "-H", "--user": "-u",
    "--help": "-h", "--version": "-V", "--validate": "-v", "--reset-timestamp": "-k",
    "--remove-timestamp": "-K",
}  # fmt: skip


class Usage(Exception):
    pass


def _short(arg: str) -> str:
    """A long option as its short form (`--user=NAME` as `-uNAME`); anything else unchanged."""
    if arg.startswith("--preserve-env"):
        return "-E"
    if arg.startswith("--user="):
        return "-u" + arg.split("=", 1)[1]
    return LONG_OPTIONS.get(arg, arg)


def parse(args: list[str]) -> tuple[dict[str, object], list[str], str]:
    """(request fields, command, flags seen) from sudo's command line."""
    fields: dict[str, object] = {}
    flags = ""
    i = 0
    while i < len(args):
        arg = _short(args[i])
        if arg == "--":
            return fields, args[i + 1 :], flags
        if not arg.startswith("-") or arg == "-":
            return fields, args[i:], flags
        i += 1
        for j, flag in enumerate(arg[1:], start=1):
            if flag == "u":
                value = arg[j + 1 :]
                if not value:
                    if i >= len(args):
                        raise Usage("option requires an argument -- 'u'")
                    value, i = args[i], i + 1
                fields["user"] = value
                break
            if flag not in "EHiksnVvKh":
                raise Usage(f"invalid option -- '{flag}'")
            flags += flag
    return fields, [], flags


def _connect() -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.connect(SOCKET_NAME)
    return conn


def _stdio() -> list[int]:
    """fds 0, 1 and 2; one that is closed is replaced by /dev/null (the daemon needs all three)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def run(fields: dict[str, object], command: list[str], flags: str) -> int:
    request = {
        **fields,
        "argv": command,
        "env": dict(os.environ),
        "cwd": os.getcwd() if os.path.isdir(".") else "/",
        "login": "i" in flags,
        "shell": "s" in flags,
        "preserve_env": "E" in flags,
    }
    body = json.dumps(request).encode()
    payload = struct.pack("!I", len(body)) + body
    try:
        conn = _connect()
    except OSError as exc:
        sys.stderr.write(f"sudo: cannot reach the sandbox's sudo service: {exc.strerror or exc}\n")
        return 1
    with conn:
        try:
            sent = socket.send_fds(conn, [payload[: 60 << 10]], _stdio())
            conn.sendall(payload[sent:])
        except OSError:
            pass  # refused before the request was read: the answer waits in the socket, read below

        def forward(signum: int, _frame: object) -> None:
            with contextlib.suppress(OSError):
                conn.sendall(f"kill {signum}\n".encode())

        for name in FORWARDED:
            signal.signal(getattr(signal, name), forward)
        answer = b""
        while b"\n" not in answer:
            try:
                chunk = conn.recv(4096)
            except InterruptedError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sys.stderr.write("sudo: the sandbox's sudo service went away\n")
                return 1
            answer += chunk
    word, _, rest = answer.split(b"\n", 1)[0].decode(errors="replace").partition(" ")
    if word == "exit" and rest.strip().lstrip("-").isdigit():
        return int(rest)
    sys.stderr.write(f"sudo: {rest or word}\n")
    return 1


def main(argv: list[str]) -> int:
    try:
        fields, command, flags = parse(argv)
    except Usage as exc:
        sys.stderr.write(f"sudo: {exc}\n{USAGE}")
        return 1
    if "h" in flags:
        sys.stdout.write(USAGE)
        return 0
    if "V" in flags:
        sys.stdout.write("Sudo version 1.9 (SPACE sandbox: commands run by spaced, ADR 0057)\n")
        return 0
    if not command and not {"i", "s"} & set(flags):
        if set(flags) & NO_COMMAND_NEEDED:
            return 0
        sys.stderr.write(USAGE)
        return 1
    return run(fields, command, flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
