"""`make demo` end to end with the production privilege split: the helper as root, the agent as `space`."""

from __future__ import annotations

import os
import pathlib
import pwd
import secrets
import shutil
import subprocess
import sys

import pytest

from tests.support.host import loop_devices_for, mounts_under, processes_mentioning

pytestmark = pytest.mark.root

AGENT_USER = "space"
REPO = pathlib.Path(__file__).resolve().parents[2]


def ensure_agent_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(AGENT_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", AGENT_USER],
            check=True,
        )
        return pwd.getpwnam(AGENT_USER)


def interpreter_problem(user: pwd.struct_passwd) -> str | None:
    """Why `user` cannot run this interpreter (the demo re-executes sys.executable as that user), if so."""
    probe = subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
         sys.executable, "-c", "import pydantic"],
        capture_output=True, text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"},
        check=False,
    )  # fmt: skip
    if probe.returncode == 0:
        return None
    resolved = pathlib.Path(sys.executable).resolve()
    return (
        f"user {AGENT_USER!r} cannot run {sys.executable} (-> {resolved}): "
        f"{(probe.stderr or probe.stdout).strip()[-300:]}"
    )


def test_demo_runs_the_agent_unprivileged_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the demo starts the root helper; run this as root")
    user = ensure_agent_user()
    # Not created here: the demo creates it (as the helper would in production, readable for the agent).
    data_dir = pathlib.Path("/var/tmp") / f"space-test-demo-{secrets.token_hex(4)}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "space.node.demo", "--data-dir", str(data_dir)],
            capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
        )  # fmt: skip
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            problem = interpreter_problem(user)
            hint = f"\nlikely cause: {problem}" if problem else ""
            if "channel.sock" in output and "Permission denied" in output:
                hint += (
                    "\nlikely cause: the agent reached a channel socket before its holder chowned it (see "
                    "test_runsc_channel.py::test_channel_socket_is_ready_the_moment_it_appears)"
                )
            pytest.fail(f"demo exited {proc.returncode}{hint}\n--- output ---\n{output[-4000:]}")
        assert f"agent running as uid {user.pw_uid} ({AGENT_USER})" in output, output
        assert "note: no 'space' user" not in output
        for step in ("create sandbox", "checkpoint", "restore", "fork", "delete sandbox"):
            assert step in output, f"step {step!r} missing from the demo's output:\n{output}"
        assert (
            "after.txt is gone" in output and "'after.txt'" not in output.split("now holds")[1].split("\n")[0]
        )
    finally:
        prefix = str(data_dir)
        leftovers = {
            "mounts": mounts_under(prefix),
            "loop devices": loop_devices_for(prefix),
            "processes": processes_mentioning(prefix),
            "data dir": [prefix] if data_dir.exists() else [],
        }
        if data_dir.exists():
            subprocess.run(["umount", "-l", str(data_dir / "fs")], capture_output=True, check=False)
            shutil.rmtree(data_dir, ignore_errors=True)
    assert leftovers == {"mounts": [], "loop devices": [], "processes": [], "data dir": []}, leftovers
