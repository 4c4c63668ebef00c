"""spaced's sudo service for a template's default user (space.guest.sudo, ADR 0057) and its client
(space.guest.sudo_client): the default user becomes root (or `-u USER`), the command gets the caller's
stdio, working directory and exit status, signals reach it, and any other user is refused. gVisor ignores
set-user-ID bits, so this is how `sudo` works in a `base` sandbox (tests/node/test_base_template.py)."""

from __future__ import annotations

import os
import pwd
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from space.guest import sudo, sudo_client
from tests.support.guest_harness import SRC, Guest, Reply

NOBODY = pwd.getpwnam("nobody")
CLIENT = f"{SRC}/space/guest/sudo_client.py"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture(scope="module")
def socket_name() -> str:
    return f"space-sudo-test-{secrets.token_hex(4)}"  # abstract names are per host: one per module run


@pytest.fixture(scope="module")
def guest(socket_name: str) -> Iterator[Guest]:
    g = Guest(env={"SPACED_USER": "nobody", "SPACED_WORKDIR": "/tmp", "SPACED_SUDO_SOCKET": socket_name})
    yield g
    g.close()


def _sudo(guest: Guest, socket_name: str, shell: str, **params: Any) -> Reply:
    """`shell` run by the default user, with `sudo` meaning the client (as /usr/local/bin/sudo does)."""
    prelude = f'sudo() {{ python3 -I -S -B {CLIENT} "$@"; }}; '
    env = {"SPACE_SUDO_SOCKET": socket_name, **params.pop("env", {})}
    return guest.call("process.start", {"cmd": prelude + shell, "env": env, **params}, timeout=30)


@pytest.mark.root
@root_only
def test_the_default_user_runs_commands_as_root_or_as_another_user(guest: Guest, socket_name: str) -> None:
    reply = _sudo(guest, socket_name, "id -u; sudo -n id -u; sudo -u nobody id -u; sudo --user=root whoami")
    assert reply.result["exit_code"] == 0, reply.stderr
    assert reply.stdout.decode().split() == [str(NOBODY.pw_uid), "0", str(NOBODY.pw_uid), "root"]


@pytest.mark.root
@root_only
def test_stdio_cwd_environment_and_exit_status_travel(guest: Guest, socket_name: str) -> None:
    reply = _sudo(
        guest, socket_name,
        "cd /usr && echo piped | sudo cat; sudo pwd; sudo sh -c 'echo $HOME $USER $SUDO_USER $KEEP'; "
        "sudo -E sh -c 'echo $KEEP'; sudo sh -c 'echo err >&2; exit 7'; echo rc=$?",
        env={"KEEP": "kept"},
    )  # fmt: skip
    assert reply.stdout.decode().split() == ["piped", "/usr", "/root", "root", "nobody", "kept", "rc=7"]
    assert reply.stderr == b"err\n"


@pytest.mark.root
@root_only
def test_a_signal_to_sudo_reaches_the_command(guest: Guest, socket_name: str) -> None:
    direct = f"python3 -I -S -B {CLIENT}"  # not the shell function: $! must be the client itself
    reply = _sudo(
        guest, socket_name, f"{direct} sleep 60 & pid=$!; sleep 1; kill -TERM $pid; wait $pid; echo rc=$?"
    )
    assert reply.stdout.decode().split() == ["rc=143"]  # 128 + SIGTERM, as the command ended


@pytest.mark.root
@root_only
def test_other_users_are_refused_and_nothing_runs(guest: Guest, socket_name: str) -> None:
    marker = f"/tmp/sudo-refused-{secrets.token_hex(4)}"
    reply = _sudo(guest, socket_name, f"sudo touch {marker}; echo rc=$?", user="daemon")
    assert reply.stdout == b"rc=1\n"
    assert b"may not use sudo" in reply.stderr
    assert not os.path.exists(marker)


@pytest.mark.root
@root_only
def test_bad_requests_are_errors(guest: Guest, socket_name: str) -> None:
    reply = _sudo(
        guest, socket_name, "sudo -u no-such-user id; echo rc=$?; sudo; echo rc=$?; sudo -x; echo rc=$?"
    )
    assert reply.stdout.decode().split() == ["rc=1", "rc=1", "rc=1"]
    assert b"unknown user" in reply.stderr and b"invalid option" in reply.stderr


def test_the_client_parses_sudo_s_options() -> None:
    parse = sudo_client.parse
    assert parse(["-n", "id", "-u"]) == ({}, ["id", "-u"], "n")
    assert parse(["-u", "bob", "-E", "--", "-x"]) == ({"user": "bob"}, ["-x"], "E")
    assert parse(["-ubob", "true"]) == ({"user": "bob"}, ["true"], "")
    assert parse(["--user=bob", "--preserve-env=PATH", "--login"]) == ({"user": "bob"}, [], "Ei")
    assert parse(["-nu", "bob", "ls"]) == ({"user": "bob"}, ["ls"], "n")
    with pytest.raises(sudo_client.Usage):
        parse(["-u"])
    with pytest.raises(sudo_client.Usage):
        parse(["-Z", "ls"])


def test_requests_are_checked_before_anything_runs() -> None:
    bad_requests: tuple[dict[str, Any], ...] = (
        {"argv": "ls"},
        {"argv": ["a\0b"]},
        {"argv": ["x"] * (sudo.MAX_ARGS + 1)},
        {"argv": ["ls"], "env": {"A=B": "c"}},
        {"argv": ["ls"], "env": {"A": 1}},
        {"argv": []},
    )
    for bad in bad_requests:
        with pytest.raises(ValueError):
            sudo.build_launch(bad, 1000, 1000)
    launch = sudo.build_launch({"argv": ["ls"], "env": {"TERM": "xterm", "SECRET": "s"}, "cwd": "/"}, 0, 0)
    assert launch.env["TERM"] == "xterm" and "SECRET" not in launch.env and launch.env["HOME"] == "/root"
    shell = sudo.build_launch({"argv": ["echo", "hi"], "login": True}, 0, 0)
    assert shell.argv[1:] == ["-l", "-c", "echo hi"] and shell.cwd == "/root"
