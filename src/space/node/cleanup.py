"""Host clean-up for what crashed runs left behind: `space node cleanup DIR...` and `make clean-host`.

For each node data directory: the SPACE processes that still run from it (a dead supervisor's agent,
helper or control plane; a crashed test's helper) are stopped, a root helper is started just for this,
and its `node.teardown` verb destroys every sandbox (runsc containers, cgroups), the node's network
(namespaces, links, its nftables table) and unmounts its btrfs image; then the directory goes. Privileged
work stays in the helper's verb table: this module only starts and stops processes.

Invariants:
- Only a directory that is a node's data directory (it holds a node's own files) is torn down; anything
  else named on the command line is refused, so a typo cannot remove an unrelated directory.
- A process is stopped only when one of its arguments IS the directory (as `space up` and the tests start
  every component) and it is not runsc's own: runsc's processes go through the helper's teardown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import signal
import sys
import time

from space.core import errors
from space.node.local import LocalNode

#: Where the test suites make their node and installation directories (tests/support/realnode.py).
TEST_DIRS_GLOB = "/var/tmp/space-test-*"
#: A node's data directory holds at least one of these files: its helper's log (LocalNode) or its btrfs
#: image (NodeLayout). Directory names such as `run` or `fs` would not do: `/` has a `run`.
NODE_MARKERS = ("helper.log", "btrfs.img")
STOP_GRACE_S = 10.0


def is_node_dir(path: pathlib.Path) -> bool:
    if not path.is_dir() or path.is_symlink() or len(path.resolve().parts) < 3:  # never `/` nor `/var`
        return False
    return any((path / name).is_file() and not (path / name).is_symlink() for name in NODE_MARKERS)


def components_of(data_dir: pathlib.Path) -> list[int]:
    """Pids of the SPACE processes started for `data_dir` (an argument equal to it), runsc's excepted."""
    wanted = os.fsencode(str(data_dir))
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if wanted in argv and b"runsc" not in os.path.basename(argv[0]):
            found.append(int(proc.name))
    return found


def stop_processes(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def clean(data_dir: pathlib.Path) -> list[int]:
    """Tear down the node of `data_dir` and remove the directory; returns the pids that had to be stopped."""
    if not is_node_dir(data_dir):  # checked before resolving: a symbolic link is refused, never followed
        raise errors.InvalidArgument(f"{data_dir} is not a SPACE node's data directory")
    data_dir = data_dir.resolve()
    stopped = components_of(data_dir)
    stop_processes(stopped)
    node = LocalNode(data_dir)
    node.start_helper()
    asyncio.run(node.stop(purge=True))
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="space node cleanup", description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dirs", nargs="*", type=pathlib.Path, help="node data directories to tear down")
    parser.add_argument("--all-test-dirs", action="store_true", help=f"also every {TEST_DIRS_GLOB}")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("error: cleaning a node needs its root helper: run it as root", file=sys.stderr)
        return 1
    targets: list[pathlib.Path] = list(args.data_dirs)
    if args.all_test_dirs:
        targets += [p for p in sorted(pathlib.Path("/var/tmp").glob(TEST_DIRS_GLOB.rsplit("/", 1)[1]))
                    if is_node_dir(p)]  # fmt: skip
    status = 0
    for target in targets:
        try:
            stopped = clean(target)
        except errors.SpaceError as exc:
            print(f"{target}: {exc.code}: {exc.message}", file=sys.stderr)
            status = 1
            continue
        print(f"{target}: cleaned" + (f" (stopped {len(stopped)} process(es))" if stopped else ""))
    if not targets:
        print("nothing to clean")
    return status


if __name__ == "__main__":
    sys.exit(main())
