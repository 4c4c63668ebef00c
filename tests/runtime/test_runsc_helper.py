"""The root helper's refusals on its real socket, as the agent sees them through HelperClient, and the
refusal of callers with another uid."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from space.core import errors
from space.node.agent.helper_client import HelperClient

pytestmark = pytest.mark.root

NOBODY = 65534
# Runs as another uid: the system interpreter, standard library only, prints one JSON line.
CLIENT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect_errno": exc.errno}))
    sys.exit(0)
sock.sendall(json.dumps({"verb": "sandbox.list", "args": {}}).encode() + b"\\n")
data = b""
while not data.endswith(b"\\n"):
    part = sock.recv(65536)
    if not part:
        break
    data += part
print(json.dumps({"answer": json.loads(data) if data else None}))
"""


def test_helper_refuses_bad_requests_with_typed_errors(node) -> None:
    link = node.data_dir / "escape-link"

    async def scenario() -> None:
        helper = HelperClient(str(node.node.layout.helper_socket))
        try:
            with pytest.raises(errors.InvalidArgument, match="unknown verb"):
                await helper.call("sandbox.explode", {"sandbox_id": "sb-" + "a" * 26})
            with pytest.raises(errors.InvalidArgument):
                await helper.call("rm -rf /")
            for bad_id in ("../../etc", "sb-" + "A" * 26, "sb-short", "sb-" + "a" * 26 + "/x", "", 5, None):
                with pytest.raises(errors.InvalidArgument):
                    await helper.call("sandbox.state", {"sandbox_id": bad_id})
            with pytest.raises(errors.InvalidArgument):
                await helper.call("sandbox.destroy", {"sandbox_id": "sb-" + "a" * 26, "force": True})
            with pytest.raises(errors.InvalidArgument):
                await helper.call("sandbox.create", {"sandbox_id": "sb-" + "a" * 26, "template": "../python"})
            with pytest.raises(errors.InvalidArgument):
                await helper.call(
                    "sandbox.create",
                    {"sandbox_id": "sb-" + "a" * 26, "limits": {"memory_mb": 1 << 40}},
                )
            with pytest.raises(errors.InvalidArgument):
                await helper.call("snapshot.delete", {"sandbox_id": "sb-" + "a" * 26, "snapshot_id": "../x"})

            # the one path argument is confined to the data directory, symlinks resolved
            for stream in ("/etc/passwd", f"{node.data_dir}/../../etc/passwd", "relative/stream", str(link)):
                with pytest.raises(errors.InvalidArgument, match=r"outside|absolute"):
                    await helper.call("template.receive", {"name": "evil", "stream": stream})
            assert not (node.data_dir / "fs" / "templates" / "evil").exists()

            # none of that disturbed it
            listed = await helper.call("sandbox.list")
            assert isinstance(listed["sandboxes"], list)
        finally:
            await helper.close()

    link.symlink_to("/etc/passwd")
    try:
        node.run(scenario())
    finally:
        link.unlink()


def test_helper_survives_garbage_lines(node) -> None:
    async def scenario() -> None:
        import asyncio

        reader, writer = await asyncio.open_unix_connection(str(node.node.layout.helper_socket))
        try:
            answers = []
            for line in (b"not json\n", b"[1, 2]\n", b'{"verb": "sandbox.list", "args": [], "x": 1}\n'):
                writer.write(line)
                await writer.drain()
                answers.append(json.loads(await asyncio.wait_for(reader.readline(), 10)))
            assert [a["ok"] for a in answers] == [False, False, False]
            assert {a["error"]["code"] for a in answers} == {"invalid_argument"}
            writer.write(b'{"verb": "sandbox.list", "args": {}}\n')
            await writer.drain()
            assert json.loads(await asyncio.wait_for(reader.readline(), 10))["ok"] is True
        finally:
            writer.close()

    node.run(scenario())


def _run_as_nobody(socket_path: str) -> dict:
    out = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         "/usr/bin/python3", "-I", "-c", CLIENT, socket_path],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_uid_is_refused(node) -> None:
    # The node's own socket: mode 0600 in a 0700 data directory, so the kernel refuses the connection.
    got = _run_as_nobody(str(node.node.layout.helper_socket))
    assert got.get("connect_errno") in {13, 1}, got  # EACCES / EPERM

    # Behind the file permissions, the helper checks the caller's uid itself (SO_PEERCRED): a helper whose
    # socket is reachable by everyone still answers another uid with permission_denied and serves nothing.
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="space-test-peercred-", dir="/var/tmp"))
    sock = scratch / "helper.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.node.helper.server", "--data-dir", str(scratch / "data"),
         "--socket", str(sock), "--agent-user", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the helper did not open its socket"
            time.sleep(0.02)
        scratch.chmod(0o755)
        sock.chmod(0o666)
        got = _run_as_nobody(str(sock))
        answer = got.get("answer")
        assert answer is not None, got
        assert answer["ok"] is False and answer["error"]["code"] == "permission_denied", answer
        assert "result" not in answer
        # root (an allowed uid) is still served by that helper
        client_out = subprocess.run(
            ["/usr/bin/python3", "-I", "-c", CLIENT, str(sock)], capture_output=True, text=True, check=True
        )
        assert json.loads(client_out.stdout)["answer"]["ok"] is True
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            os.chmod(scratch, 0o700)
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_prepared_node_has_asked_the_kernel_for_cheap_cgroup_moves(node) -> None:  # type: ignore[no-untyped-def]
    """node.prepare (again: it converges) reports favordynmods on, and the kernel's mount table shows it on a
    cgroup2 mount, wherever the kernel has the mode (ADR 0086)."""
    supported = "favordynmods" in pathlib.Path("/sys/kernel/cgroup/features").read_text().split()

    async def prepare() -> dict[str, object]:
        helper = HelperClient(str(node.node.layout.helper_socket))
        try:
            answer: dict[str, object] = await helper.call("node.prepare", timeout=300.0)
            return answer
        finally:
            await helper.close()

    answer = node.run(prepare())
    assert answer["cgroup_moves"] == ("on" if supported else "unsupported"), answer
    cgroup2 = [
        line.split() for line in pathlib.Path("/proc/mounts").read_text().splitlines() if " cgroup2 " in line
    ]
    assert not supported or any("favordynmods" in fields[3].split(",") for fields in cgroup2), cgroup2
