"""Several real nodes on this machine sharing one object store, and node agents as killable processes.

Each node has its own data directory (btrfs image, runsc root, helper, holders) and its own cgroup parent,
so two nodes can hold the same sandbox id at once (a suspended source on one, its restored copy on the
other) without sharing a container cgroup.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from space.node.agent.agent import NodeAgent
from space.node.layout import NodeLayout
from space.node.local import LocalNode
from space.node.rpc_client import NodeClient
from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore
from tests.support.node_capability import NodeAuth


@dataclass
class StoreDir:
    root: pathlib.Path

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def open(self) -> ObjectStore:
        return open_store(self.url)

    def files(self, prefix: str) -> list[pathlib.Path]:
        base = self.root / prefix
        return sorted(p for p in base.rglob("*") if p.is_file()) if base.exists() else []


def free_port() -> int:
    from tests.support.cluster import free_port as below_ephemeral_range

    return below_ephemeral_range()


class AgentProcess:
    """`python -m space.node.agent.server` on a node's helper, as a process a test can SIGKILL."""

    def __init__(self, layout: NodeLayout, store_url: str, log_dir: pathlib.Path, name: str) -> None:
        self.layout = layout
        self.store_url = store_url
        self.port = free_port()
        self.token = secrets.token_urlsafe(16)
        self.token_file = log_dir / f"{name}.token"  # the agent's own RPC token (ADR 0021)
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        src = str(pathlib.Path(__file__).resolve().parents[2] / "src")
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "space.node.agent.server", "--data-dir", str(self.layout.data_dir),
                 "--listen", f"127.0.0.1:{self.port}", "--rpc-token-file", str(self.token_file),
                 "--no-prepare", "--store-url", self.store_url, "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.token}"}
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited at start: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/node/v1/info", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"agent did not come up: {self.log_tail()}")
            time.sleep(0.05)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
        # NodeAuth: the token, and a capability for the sandbox the call names (as the control plane sends)
        return httpx.post(f"{self.url}/node/v1{path}", json=body, auth=NodeAuth(self.token), timeout=timeout)

    def client(self) -> NodeClient:
        return NodeClient(self.url, self.token)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the agent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


@dataclass
class NodeOnMachine:
    name: str
    node: LocalNode
    agent: NodeAgent

    @property
    def layout(self) -> NodeLayout:
        return self.node.layout

    def subvolumes_of(self, sandbox_id: str) -> list[str]:
        """Every subvolume this node holds for a sandbox (root filesystem, snapshots, half-received ones)."""
        found = []
        fs = self.layout.fs
        out = subprocess.run(
            ["btrfs", "subvolume", "list", str(fs)], capture_output=True, text=True, check=True
        ).stdout
        for line in out.splitlines():
            path = line.split(" path ", 1)[-1]
            if sandbox_id in path:
                found.append(path)
        return sorted(found)

    def staging_entries(self) -> list[str]:
        root = self.layout.staging
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def containers(self, sandbox_id: str) -> list[dict[str, Any]]:
        """runsc's own list of containers of a sandbox under this node's runsc root."""
        root = self.layout.runsc_root
        found = []
        for state in root.glob(f"{sandbox_id}-*_sandbox:*.state") if root.exists() else []:
            found.append({"container": state.name.split("_sandbox:", 1)[0]})
        return found
