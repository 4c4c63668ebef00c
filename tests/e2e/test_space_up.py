"""`space up --detach`, then the CLI of DESIGN.md with nothing exported (the config file `space up` wrote is
all it has), over the real runsc node; then `space down --purge` leaves nothing on the host.

HOME is a temporary directory, so the developer's ~/.config/space/config.json is never touched."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.cluster import free_port, host_leftovers, sandbox_ids_in, wait_for

pytestmark = pytest.mark.root


@dataclass
class Cli:
    home: pathlib.Path
    data_dir: pathlib.Path

    def env(self) -> dict[str, str]:
        # Nothing SPACE_* exported: the config file is the only source.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8"}

    def run(
        self, *args: str, stdin: bytes | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(
            [sys.executable, "-m", "space.cli.main", *args], input=stdin, capture_output=True, env=self.env(),
            cwd=self.home, timeout=timeout, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
            pytest.fail(
                f"space {' '.join(args)} exited {proc.returncode}\nstdout: {out}\nstderr: {err[-3000:]}\n"
                + self.logs()
            )
        return proc

    def json(self, *args: str) -> dict[str, object]:
        data = json.loads(self.run(*args).stdout)
        assert isinstance(data, dict), data
        return data

    def logs(self) -> str:
        parts = []
        for name in ("space.log", "controlplane.log", "agent.log", "helper.log"):
            path = self.data_dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


@pytest.fixture
def cli(tmp_path: pathlib.Path) -> Iterator[Cli]:
    if os.geteuid() != 0:
        pytest.fail("`space up` starts the node's root helper: run the tests as root")
    home = tmp_path / "home"
    home.mkdir()
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-up-", dir="/var/tmp"))
    made = Cli(home, data_dir)
    try:
        yield made
    finally:
        seen = sandbox_ids_in(data_dir)
        down = made.run("down", "--data-dir", str(data_dir), "--purge", timeout=600, check=False)
        logs = made.logs()
        left = host_leftovers(data_dir, seen)
        remains = (
            sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*")) if data_dir.exists() else []
        )
        if not left["mounts"]:  # never recurse into a mount left behind: leave it for a post-mortem
            shutil.rmtree(data_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr.decode(errors="replace") + logs
        assert {k: v for k, v in left.items() if v} == {}, f"left behind by `space down --purge`: {left}"
        assert remains == [], f"files left in the data directory after --purge: {remains[:20]}"


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
        cli.run("sandbox", "delete", target)
        gone = cli.run("sandbox", "get", target, check=False)
        assert gone.returncode == 3, (gone.returncode, gone.stderr)  # exit code 3: not found
    assert json.loads(cli.run("sandbox", "list", "--json").stdout) == []
