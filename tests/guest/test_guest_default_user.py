"""A template's default user and workdir in the daemon (SPACED_USER, SPACED_WORKDIR; ADR 0057): calls that
name no user run as the default user and create files it owns; calls that name one (root included) keep
it; overwriting keeps a file's owner."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest_harness import SRC, Guest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users and chown need root"),
]

NOBODY = pwd.getpwnam("nobody")


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spaced-default-user-"))
    os.chmod(path, 0o777)  # the default user writes here, as in /home/user of `base`
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def guest(workdir: Path) -> Iterator[Guest]:
    g = Guest(env={"SPACED_USER": "nobody", "SPACED_WORKDIR": str(workdir)})
    yield g
    g.close()


@pytest.fixture(scope="module")
def plain_guest() -> Iterator[Guest]:
    g = Guest()
    yield g
    g.close()


def _owner(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid


def test_a_process_without_user_or_cwd_gets_the_defaults(guest: Guest, workdir: Path) -> None:
    reply = guest.call("process.start", {"cmd": "id -u; pwd; echo $HOME $USER $LOGNAME"}, timeout=20)
    assert reply.result["exit_code"] == 0
    assert reply.stdout.decode().split() == [
        str(NOBODY.pw_uid),
        str(workdir),
        NOBODY.pw_dir,
        "nobody",
        "nobody",
    ]


def test_a_process_naming_its_user_and_cwd_keeps_them(guest: Guest) -> None:
    for user in ("root", 0):
        reply = guest.call("process.start", {"cmd": "id -u; pwd; echo $HOME", "user": user, "cwd": "/"})
        assert reply.stdout.decode().split() == ["0", "/", "/root"]


def test_a_write_without_user_creates_files_and_parents_of_the_default_user(
    guest: Guest, workdir: Path
) -> None:
    assert guest.call("files.write", {"path": "new/dir/a.txt"}, body=b"x").ok
    for created in (workdir / "new", workdir / "new/dir", workdir / "new/dir/a.txt"):
        assert _owner(created) == (NOBODY.pw_uid, NOBODY.pw_gid), created
    assert (workdir / "new/dir/a.txt").stat().st_mode & 0o777 == 0o644
    assert guest.call("files.write", {"path": "new/b.txt", "append": True}, body=b"y").ok
    assert _owner(workdir / "new/b.txt") == (NOBODY.pw_uid, NOBODY.pw_gid)


def test_a_write_naming_root_creates_root_files_and_overwriting_keeps_the_owner(
    guest: Guest, workdir: Path
) -> None:
    assert guest.call("files.write", {"path": "rootdir/r.txt", "user": "root"}, body=b"x").ok
    assert _owner(workdir / "rootdir/r.txt") == (0, 0)
    assert _owner(workdir / "rootdir") == (0, 0)
    assert guest.call("files.write", {"path": "rootdir/r.txt"}, body=b"again").ok  # default user
    assert _owner(workdir / "rootdir/r.txt") == (0, 0)
    assert (workdir / "rootdir/r.txt").read_bytes() == b"again"


def test_mkdir_makes_directories_of_the_user(guest: Guest, workdir: Path) -> None:
    assert guest.call("files.mkdir", {"path": "m1/m2"}).result["created"] is True
    assert _owner(workdir / "m1") == _owner(workdir / "m1/m2") == (NOBODY.pw_uid, NOBODY.pw_gid)
    assert guest.call("files.mkdir", {"path": "m3", "parents": False, "user": "root"}).ok
    assert _owner(workdir / "m3") == (0, 0)


def test_an_unknown_user_is_invalid_and_writes_nothing(guest: Guest, workdir: Path) -> None:
    reply = guest.call("files.write", {"path": "ghost/x", "user": "no-such-user"}, body=b"x")
    assert reply.error["code"] == "invalid_argument"
    assert not (workdir / "ghost").exists()
    assert guest.call("files.write", {"path": "ghost/x", "user": ["root"]}, body=b"x").error["code"] == (
        "invalid_argument"
    )


def test_without_a_default_user_root_stays_the_default(plain_guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "sub" / "p.txt"
    assert plain_guest.call("files.write", {"path": str(target)}, body=b"x").ok
    assert _owner(target) == (0, 0)
    assert plain_guest.call("process.start", {"argv": ["id", "-u"]}).stdout == b"0\n"
    # Naming a user is honoured without a template default too (SPACE's API `user` field, E2B `username`).
    named = tmp_path / "n" / "q.txt"
    assert plain_guest.call("files.write", {"path": str(named), "user": "nobody"}, body=b"x").ok
    assert _owner(named) == _owner(named.parent) == (NOBODY.pw_uid, NOBODY.pw_gid)


def test_without_a_default_user_there_is_no_sudo_service(plain_guest: Guest) -> None:
    client = f"{SRC}/space/guest/sudo_client.py"
    name = f"space-sudo-none-{secrets.token_hex(4)}"  # whatever name: no daemon without a default user serves
    command = {"cmd": f"python3 -I -S -B {client} true; echo rc=$?", "env": {"SPACE_SUDO_SOCKET": name}}
    reply = plain_guest.call("process.start", command, timeout=30)
    assert reply.stdout == b"rc=1\n" and b"cannot reach" in reply.stderr
