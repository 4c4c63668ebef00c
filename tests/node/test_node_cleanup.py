"""`space node cleanup` (and `make clean-host`): what a crashed node left on the host is torn down through
a helper started for it, and nothing but a node's data directory is ever touched."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from space.node import cleanup
from tests.support.realnode import assert_no_leaks, make_data_dir

# A node agent in a process of its own, killed by the test like a crash: it starts its node, creates one
# sandbox, prints its id and waits.
CRASHING_AGENT = """
import asyncio, pathlib, sys
from space.node.local import LocalNode

async def main() -> None:
    agent = await LocalNode(pathlib.Path(sys.argv[1])).start(progress=lambda line: None)
    handle = await agent.create("python")
    print(handle.sandbox_id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def space(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", "node", "cleanup", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.root
def test_a_crashed_nodes_sandbox_network_and_mounts_are_torn_down() -> None:
    data_dir = make_data_dir("cleanup")
    agent = subprocess.Popen(
        [sys.executable, "-c", CRASHING_AGENT, str(data_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None
        sandbox_id = agent.stdout.readline().strip()
        assert sandbox_id.startswith("sb-"), sandbox_id
    finally:
        agent.kill()  # the crash: the helper, its holders and runsc stay behind
        agent.wait()
    left_running = cleanup.components_of(data_dir.resolve())
    assert left_running, "the crash left no helper to stop: the test would not test that path"
    assert (data_dir / "fs" / "sandboxes" / sandbox_id).exists()

    done = space(str(data_dir))

    assert done.returncode == 0, done.stderr
    assert "cleaned (stopped" in done.stdout, done.stdout
    assert not data_dir.exists()
    assert not [pid for pid in left_running if cleanup.alive(pid)]
    assert_no_leaks(data_dir, {sandbox_id})


def test_only_a_nodes_data_directory_is_touched(tmp_path: pathlib.Path) -> None:
    plain = tmp_path / "plain"
    (plain / "run").mkdir(parents=True)  # a `run` or `fs` directory does not make a node: `/` has a `run`
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    (node_dir / "helper.log").write_text("")
    link = tmp_path / "link"
    link.symlink_to(node_dir)
    faked = tmp_path / "faked"
    faked.mkdir()
    (faked / "helper.log").symlink_to(node_dir / "helper.log")
    for target in (plain, link, faked, pathlib.Path("/"), pathlib.Path("/var"), tmp_path / "missing"):
        assert not cleanup.is_node_dir(target), target
    assert cleanup.is_node_dir(node_dir)
    if os.geteuid() == 0:
        refused = space(str(plain), str(link))
        assert refused.returncode == 1
        assert refused.stderr.count("is not a SPACE node's data directory") == 2, refused.stderr
        assert plain.is_dir() and link.is_symlink() and node_dir.is_dir()


def wait_for_exec(pid: int, last_argument: str) -> None:
    deadline = time.monotonic() + 10
    cmdline = pathlib.Path(f"/proc/{pid}/cmdline")
    while cmdline.read_bytes().rstrip(b"\0").split(b"\0")[-1] != os.fsencode(last_argument):
        assert time.monotonic() < deadline, f"{pid} did not exec"
        time.sleep(0.01)


def test_a_process_is_a_component_only_when_an_argument_is_the_directory(tmp_path: pathlib.Path) -> None:
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    named = subprocess.Popen([*sleeper, str(data_dir)])
    inside = subprocess.Popen([*sleeper, f"{data_dir}/x", f"--root={data_dir}"])
    try:
        # Popen returns after fork, before exec: until then a child's cmdline is still pytest's.
        wait_for_exec(named.pid, str(data_dir))
        wait_for_exec(inside.pid, f"--root={data_dir}")
        assert cleanup.components_of(data_dir) == [named.pid]
        cleanup.stop_processes([named.pid])
        assert named.wait(5) == -signal.SIGTERM
        assert inside.poll() is None
    finally:
        for process in (named, inside):
            process.kill()
            process.wait()
