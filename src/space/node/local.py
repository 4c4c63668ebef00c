"""A whole node on this machine: the root helper as a child process plus an agent talking to it.

Used by `make demo`, the benchmarks, the tests and `space up`. The helper needs root; the agent side
(`connect_agent`) needs only the helper socket, so it can run as an unprivileged user in another process.

Invariants:
- `stop(purge=True)` leaves nothing behind: every sandbox destroyed (runtimes, holders, cgroups,
  subvolumes), the btrfs image unmounted and its loop device detached, the helper process gone.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import sys
import time

from space.core import errors
from space.node.agent.agent import NodeAgent
from space.node.agent.helper_client import HelperClient
from space.node.drivers.base import Progress
from space.node.drivers.runsc import RunscDriver
from space.node.layout import NodeLayout

HELPER_START_TIMEOUT_S = 30.0


def connect_agent(data_dir: pathlib.Path, helper_socket: pathlib.Path | None = None) -> NodeAgent:
    layout = NodeLayout(data_dir)
    helper = HelperClient(str(helper_socket or layout.helper_socket))
    return NodeAgent(RunscDriver(layout, helper))


class LocalNode:
    def __init__(
        self,
        data_dir: pathlib.Path,
        *,
        agent_user: str | int = 0,
        platform: str = "ptrace",
        runsc: str = "runsc",
    ) -> None:
        self.layout = NodeLayout(pathlib.Path(data_dir).resolve())
        self.agent_user = str(agent_user)
        self.platform = platform
        self.runsc = runsc
        self.helper_process: subprocess.Popen[bytes] | None = None
        self.agent: NodeAgent | None = None

    def start_helper(self) -> None:
        self.layout.data_dir.mkdir(parents=True, exist_ok=True)
        sock = self.layout.helper_socket
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        log = open(self.layout.data_dir / "helper.log", "ab")  # noqa: SIM115 - handed to the child
        self.helper_process = subprocess.Popen(
            [sys.executable, "-m", "space.node.helper.server", "--data-dir", str(self.layout.data_dir),
             "--agent-user", self.agent_user, "--platform", self.platform, "--runsc", self.runsc],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + HELPER_START_TIMEOUT_S
        while not sock.exists():
            if self.helper_process.poll() is not None:
                tail = (self.layout.data_dir / "helper.log").read_text(errors="replace")[-2000:]
                raise errors.RuntimeFailure(f"node helper exited at start: {tail}")
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure("node helper did not open its socket")
            time.sleep(0.01)

    async def start(
        self, progress: Progress | None = None, templates: tuple[str, ...] = ("python",)
    ) -> NodeAgent:
        self.start_helper()
        self.agent = connect_agent(self.layout.data_dir)
        await self.agent.prepare(templates, progress)
        return self.agent

    async def stop(self, *, purge: bool = False) -> None:
        helper = HelperClient(str(self.layout.helper_socket))
        try:
            if self.agent is not None:
                await self.agent.close()
            if purge:
                await helper.call("node.teardown", timeout=300.0)
        finally:
            await helper.close()
            self.stop_helper()
            if purge:
                shutil.rmtree(self.layout.data_dir, ignore_errors=True)

    def stop_helper(self) -> None:
        if self.helper_process is not None and self.helper_process.poll() is None:
            self.helper_process.terminate()
            try:
                self.helper_process.wait(10)
            except subprocess.TimeoutExpired:
                self.helper_process.kill()
                self.helper_process.wait()
        self.helper_process = None
