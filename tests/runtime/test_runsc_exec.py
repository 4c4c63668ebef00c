"""A real gVisor sandbox runs commands: its own kernel, env, exit codes, separate stdout/stderr, stdin."""

from __future__ import annotations

import pathlib

import pytest

from space.node.agent.agent import NodeAgent
from tests.support.sandboxes import new_sandbox

pytestmark = pytest.mark.root


def test_python_env_kernel_exit_codes_streams_and_stdin(node) -> None:
    agent: NodeAgent = node.agent

    async def scenario() -> None:
        async with new_sandbox(agent, env={"SANDBOX_VAR": "from-create"}) as sb:
            s = sb.session
            r = await s.exec(["python3", "-c", "import sys; print(sum(range(10)), sys.version_info[0])"])
            assert (r.exit_code, r.stdout, r.stderr) == (0, b"45 3\n", b"")

            # env: the sandbox's own (set at create) and per-call variables reach processes
            r = await s.exec("echo $SANDBOX_VAR $CALL_VAR", env={"CALL_VAR": "from-call"})
            assert r.stdout == b"from-create from-call\n"
            r = await s.exec(["python3", "-c", "import os; print(os.environ['SANDBOX_VAR'])"])
            assert r.stdout == b"from-create\n"

            # its own kernel: gVisor's Sentry answers uname, /proc/version and dmesg, not the host's
            host_release = pathlib.Path("/proc/sys/kernel/osrelease").read_text().strip()
            r = await s.exec("uname -r; cat /proc/version; dmesg")
            assert r.exit_code == 0, r.stderr
            release = r.stdout.decode().splitlines()[0]
            assert release != host_release
            assert "gVisor" in r.stdout.decode()
            r = await s.exec("hostname")
            assert r.stdout == b"sandbox\n"

            # exit codes propagate; stdout and stderr stay apart
            r = await s.exec("echo out; echo err >&2; exit 42")
            assert (r.exit_code, r.stdout, r.stderr) == (42, b"out\n", b"err\n")
            r = await s.exec(["python3", "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
            assert (r.exit_code, r.stdout, r.stderr) == (3, b"", b"boom")
            r = await s.exec(["false"])
            assert r.exit_code == 1 and not r.ok
            r = await s.exec("kill -9 $$")
            assert r.signal == 9 and r.exit_code is None

            # stdin reaches the process and its EOF ends it
            payload = b"line one\nline two\n" * 1000
            r = await s.exec(["python3", "-c", "import sys; d=sys.stdin.buffer.read(); print(len(d))"],
                             stdin=payload)  # fmt: skip
            assert r.stdout == f"{len(payload)}\n".encode()
            r = await s.exec("tr a-z A-Z", stdin=b"shout\n")
            assert r.stdout == b"SHOUT\n"

            # cwd and user
            r = await s.exec("pwd; id -un", cwd="/tmp", user="user")
            assert r.stdout == b"/tmp\nuser\n"

    node.run(scenario())
