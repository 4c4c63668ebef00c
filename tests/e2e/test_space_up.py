"""`space up --detach`, then the CLI of DESIGN.md with nothing exported (the config file `space up` wrote is
all it has), over the real runsc node; then `space down --purge` leaves nothing on the host.

HOME is a temporary directory, so the developer's ~/.config/space/config.json is never touched."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.cluster import free_port, wait_for
from tests.support.space_up import Cli

pytestmark = pytest.mark.root


def test_space_up_then_the_cli_with_nothing_exported(cli: Cli) -> None:
    port = free_port()
    up = cli.run("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach", timeout=900)
    out = up.stdout.decode()
    url = re.search(r"^SPACE_URL=(\S+)$", out, re.M)
    key = re.search(r"^SPACE_API_KEY=(\S+)$", out, re.M)
    assert url and key, out
    assert url.group(1) == f"http://127.0.0.1:{port}"
    assert key.group(1).startswith("space_")
    config = cli.home / ".config" / "space" / "config.json"
    assert json.loads(config.read_text()) == {"url": url.group(1), "api_key": key.group(1)}
    assert config.stat().st_mode & 0o077 == 0, "the config file holds a key: owner-only"
    # A second `space up` finds it running and says so (same lines), without starting another.
    again = cli.run("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach")
    assert f"SPACE_URL={url.group(1)}" in again.stdout.decode()

    sb = cli.json("sandbox", "create", "--json")
    sandbox_id = str(sb["id"])
    assert sb["state"] == "running" and sandbox_id.startswith("sb-")
    assert cli.json("sandbox", "get", sandbox_id, "--json")["state"] == "running"

    code = cli.run("exec", sandbox_id, "--", "python3", "-c", "import sys; sys.exit(7)", check=False)
    assert code.returncode == 7, code.stderr
    both = cli.run("exec", sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; uname -s")
    assert both.stdout == b"out\nLinux\n" and b"err" in both.stderr

    data = bytes(range(256)) * 4096 + b"end"
    cli.run("files", "write", sandbox_id, "/work/blob.bin", stdin=data)
    assert cli.run("files", "read", sandbox_id, "/work/blob.bin").stdout == data
    listing = json.loads(cli.run("files", "ls", sandbox_id, "/work", "--json").stdout)
    assert "blob.bin" in json.dumps(listing)

    # A process that must survive pause/resume (a real freeze, not a restart).
    cli.run("exec", sandbox_id, "--", "sh", "-c", "nohup sleep 3600 >/dev/null 2>&1 & echo $! > /work/pid")
    pid = cli.run("files", "read", sandbox_id, "/work/pid").stdout.strip()
    assert cli.json("sandbox", "pause", sandbox_id, "--json")["state"] == "paused"
    assert cli.json("sandbox", "get", sandbox_id, "--json")["state"] == "paused"
    assert cli.json("sandbox", "resume", sandbox_id, "--json")["state"] == "running"
    assert cli.run("exec", sandbox_id, "--", "kill", "-0", pid.decode()).returncode == 0
    # Any access to a paused sandbox resumes it first.
    cli.run("sandbox", "pause", sandbox_id)
    assert cli.run("exec", sandbox_id, "--", "cat", "/work/pid").stdout.strip() == pid
    assert cli.json("sandbox", "get", sandbox_id, "--json")["state"] == "running"

    snap = cli.json("snapshot", "create", sandbox_id, "--full", "--json")
    assert snap["kind"] == "full" and str(snap["id"]).startswith("snap-")
    listed = json.loads(cli.run("snapshot", "list", sandbox_id, "--json").stdout)
    assert [s["id"] for s in listed] == [snap["id"]]

    child = cli.json("sandbox", "fork", sandbox_id, "--json")
    child_id = str(child["id"])
    assert child_id != sandbox_id and child["forked_from"] == sandbox_id
    wait_for(
        lambda: cli.json("sandbox", "get", child_id, "--json")["state"] == "running", timeout=60, what="child"
    )
    assert cli.run("files", "read", child_id, "/work/blob.bin").stdout == data
    # The child carries the parent's processes (a checkpoint, not a copy of the disk only).
    assert cli.run("exec", child_id, "--", "kill", "-0", pid.decode(), check=False).returncode == 0

    for target in (child_id, sandbox_id):
        assert cli.run("sandbox", "delete", target).stdout.split() == [target.encode(), b"deleting"]
        # The answer comes once it is `deleting`; the teardown ends in the background (ADR 0073).
        wait_for(
            lambda target=target: cli.run("sandbox", "get", target, check=False).returncode == 3,
            timeout=60, interval=0.2, what=f"{target} gone (exit code 3: not found)",
        )  # fmt: skip
    assert json.loads(cli.run("sandbox", "list", "--json").stdout) == []
