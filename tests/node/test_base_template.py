"""The built-in `base` template on a real gVisor node (ADR 0057): user `user` in /home/user with passwordless
sudo, git and curl; execs, PTY processes and file writes that name no user get the template's defaults,
those that name one keep it (root included); pooled sandboxes of `base` get the same defaults; `python` is
unchanged (root in /work). Everything goes through the node RPC (NodeClient over a real uvicorn)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from space.core.ids import new_sandbox_id
from space.node.agent import template_prep
from space.node.agent.app import create_app
from space.node.agent.pools import WarmPools
from space.node.rpc_client import NodeClient
from space.node.volumes import templates
from tests.support.loop import BackgroundLoop
from tests.support.node_rpc import TOKEN, serve_in
from tests.support.realnode import RealNode

pytestmark = pytest.mark.root

IDENTITY = "whoami; pwd; echo $HOME $USER $LOGNAME"
T = TypeVar("T")


@dataclass
class Rpc:
    loop: BackgroundLoop
    agent: Any
    client: NodeClient

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return self.loop.run(coro, timeout)

    def new(self, template: str) -> str:
        sandbox_id = new_sandbox_id()
        self.run(self.client.create_sandbox(sandbox_id, template=template), timeout=300)
        return sandbox_id


@pytest.fixture(scope="module")
def rpc(node: RealNode) -> Iterator[Rpc]:
    server, future, url = serve_in(node.loop, create_app(node.agent, TOKEN))

    async def make_client() -> NodeClient:
        return NodeClient(url, TOKEN)

    client = node.run(make_client())
    try:
        yield Rpc(node.loop, node.agent, client)
    finally:
        node.run(client.aclose())
        server.should_exit = True
        future.result(15)


@pytest.fixture(scope="module")
def base_sandbox(rpc: Rpc) -> Iterator[str]:
    sandbox_id = rpc.new(template="base")
    try:
        yield sandbox_id
    finally:
        rpc.run(rpc.agent.delete(sandbox_id), timeout=120)


def _lines(rpc: Rpc, sandbox_id: str, command: str, **kwargs: Any) -> list[str]:
    result = rpc.run(rpc.client.exec(sandbox_id, command, **kwargs))
    assert result.exit_code == 0, result.stderr
    return result.stdout.split()


async def _pty_output(client: NodeClient, sandbox_id: str, command: str) -> bytes:
    started = await client.start_process(sandbox_id, command, pty=(24, 80))
    out = bytearray()
    async with asyncio.timeout(60):
        async for event in client.attach(sandbox_id, started.process_id):
            if event.get("type") == "exit":
                break
            if "data_b64" in event:
                out += base64.b64decode(event["data_b64"])
    return bytes(out)


def test_the_agent_knows_the_node_s_built_in_templates() -> None:
    assert set(template_prep.BUILTIN_TEMPLATE_NAMES) == set(templates.BUILTIN_TEMPLATES)


def test_base_runs_as_user_in_its_home_with_sudo_git_and_curl(rpc: Rpc, base_sandbox: str) -> None:
    assert _lines(rpc, base_sandbox, IDENTITY) == ["user", "/home/user", "/home/user", "user", "user"]
    assert _lines(rpc, base_sandbox, "id -u; stat -c '%U %a' /home/user") == ["1000", "user", "755"]
    # Passwordless sudo works inside gVisor, which ignores setuid bits: `sudo` asks the daemon (ADR 0057).
    assert _lines(rpc, base_sandbox, "sudo -n id -u; sudo -n true && echo ok; command -v sudo") == [
        "0", "ok", "/usr/local/bin/sudo",
    ]  # fmt: skip
    piped = "sudo -u user whoami; echo hi | sudo tee /root/t >/dev/null; sudo cat /root/t"
    assert _lines(rpc, base_sandbox, piped) == ["user", "hi"]
    versions = _lines(rpc, base_sandbox, "git --version; curl --version | head -1; python3 --version")
    assert versions[:2] == ["git", "version"] and "curl" in versions and "Python" in versions
    # git works for the user without any setup (HOME is the user's).
    assert _lines(rpc, base_sandbox, "git init -q repo && cd repo && git status --short && echo clean") == [
        "clean"
    ]


def test_a_call_naming_its_user_or_cwd_keeps_them(rpc: Rpc, base_sandbox: str) -> None:
    assert _lines(rpc, base_sandbox, IDENTITY, user="root", cwd="/tmp") == [
        "root", "/tmp", "/root", "root", "root",
    ]  # fmt: skip
    assert _lines(rpc, base_sandbox, "id -u; pwd", user=0) == ["0", "/home/user"]
    assert _lines(rpc, base_sandbox, "whoami; pwd", cwd="/") == ["user", "/"]


def test_a_pty_process_gets_the_defaults(rpc: Rpc, base_sandbox: str) -> None:
    out = rpc.run(_pty_output(rpc.client, base_sandbox, "whoami; pwd"), timeout=90)
    assert out.split() == [b"user", b"/home/user"]


def test_file_writes_belong_to_the_default_or_the_named_user(rpc: Rpc, base_sandbox: str) -> None:
    client = rpc.client
    rpc.run(client.write_file(base_sandbox, "notes/a.txt", b"relative: in the workdir"))
    rpc.run(client.write_file(base_sandbox, "/tmp/owned/by-root.txt", b"x", user="root"))
    rpc.run(client.mkdir(base_sandbox, "/tmp/made/here"))
    owners = _lines(
        rpc, base_sandbox,
        "stat -c '%U:%G' /home/user/notes /home/user/notes/a.txt /tmp/owned /tmp/owned/by-root.txt"
        " /tmp/made /tmp/made/here",
    )  # fmt: skip
    assert owners == ["user:user", "user:user", "root:root", "root:root", "user:user", "user:user"]
    # The user can change what it was given; overwriting a root file keeps it root's.
    assert _lines(rpc, base_sandbox, "echo more >> notes/a.txt && echo ok") == ["ok"]
    rpc.run(client.write_file(base_sandbox, "/tmp/owned/by-root.txt", b"again"))
    assert _lines(rpc, base_sandbox, "stat -c '%U' /tmp/owned/by-root.txt") == ["root"]
    entry = rpc.run(client.stat(base_sandbox, "/home/user/notes/a.txt"))
    assert entry["owner"] == "user"


def test_the_template_metadata_and_its_own_layer(node: RealNode, base_sandbox: str) -> None:
    tdir = node.node.layout.templates
    meta = json.loads((tdir / "base.json").read_text())
    assert (meta["default_user"], meta["workdir"]) == ("user", "/home/user")
    assert meta["env"] == {"HOME": "/home/user", "USER": "user", "LOGNAME": "user"}
    python_meta = json.loads((tdir / "python.json").read_text())
    assert not {"default_user", "workdir", "env"} & set(python_meta)
    sudoers = tdir / "base" / "etc/sudoers.d/user"
    assert oct(os.stat(sudoers).st_mode & 0o777) == "0o440" and os.stat(sudoers).st_uid == 0
    assert not (tdir / "python" / "etc/sudoers.d/user").exists()  # python's user has no sudo entry


def test_a_fork_keeps_the_defaults_and_sudo(rpc: Rpc, base_sandbox: str) -> None:
    """A child restored from a full checkpoint resumes the daemon that booted with the defaults, its sudo
    socket included."""
    (child,) = rpc.run(rpc.agent.fork(base_sandbox), timeout=300)
    try:
        assert _lines(rpc, child.sandbox_id, "whoami; pwd; sudo -n id -u") == ["user", "/home/user", "0"]
    finally:
        rpc.run(rpc.agent.delete(child.sandbox_id))


def test_python_is_unchanged(rpc: Rpc) -> None:
    sandbox_id = rpc.new(template="python")
    try:
        assert _lines(rpc, sandbox_id, "whoami; pwd; echo $HOME") == ["root", "/work", "/root"]
        rpc.run(rpc.client.write_file(sandbox_id, "/work/made/p.txt", b"x"))
        assert _lines(rpc, sandbox_id, "stat -c '%U' /work/made /work/made/p.txt") == ["root", "root"]
        assert _lines(rpc, sandbox_id, "whoami", user="user") == ["user"]
    finally:
        rpc.run(rpc.agent.delete(sandbox_id), timeout=120)


def test_pooled_base_sandboxes_get_the_defaults(node: RealNode, rpc: Rpc) -> None:
    agent = node.agent
    pools = WarmPools(lambda: agent.driver, {"base": 1}, fill_yield_s=0.0, fill_concurrency=1)
    agent.pools = pools

    async def filled() -> None:
        pools.start()
        async with asyncio.timeout(180):
            while pools.counts().get("base", 0) < 1:
                await asyncio.sleep(0.05)

    try:
        node.run(filled(), timeout=200)
        sandbox_id = new_sandbox_id()
        handle = node.run(agent.create("base", sandbox_id=sandbox_id), timeout=120)
        try:
            assert handle.created_from == "pool"
            assert _lines(rpc, sandbox_id, IDENTITY) == ["user", "/home/user", "/home/user", "user", "user"]
        finally:
            node.run(agent.delete(sandbox_id), timeout=120)
    finally:
        agent.pools = None
        node.run(pools.close(destroy=True), timeout=120)
