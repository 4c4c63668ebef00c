"""The MCP tools on REAL runsc sandboxes of a whole local installation (`real_cluster`), with the `mcp` SDK's
own client over both transports: `space mcp` spawned as a subprocess (stdio), and the control plane's /mcp
(streamable HTTP) with an org key acting in a project named by X-Space-Project. Also: a path outside the
sandbox reads the sandbox's own files, never the host's."""

from __future__ import annotations

import asyncio
import pathlib
import secrets

import pytest

from space.mcp.tools import TOOLS
from tests.support import cluster as c
from tests.support.mcp_clients import McpCaller, first_word_after, over_http, over_stdio

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

LIMITS = {"cpus": 0.5, "memory_mb": 256}


async def listing_once_torn_down(mcp: McpCaller, gone: str | None = None, *, deadline_s: float = 60.0) -> str:
    """list_sandboxes once no sandbox of the listing is `deleting` (a delete answers before its teardown, ADR
    0073, so a deleted sandbox is listed as deleting for a moment), and `gone` is no longer in it."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    while True:
        listing = await mcp.ok("list_sandboxes")
        if " deleting " not in listing and (gone is None or gone not in listing):
            return listing
        assert loop.time() < until, f"still listed after {deadline_s} s: {listing}"
        await asyncio.sleep(0.2)


async def new_sandbox(mcp: McpCaller) -> str:
    return first_word_after(await mcp.ok("create_sandbox", {"limits": LIMITS}), "Created sandbox ")


def test_space_mcp_over_stdio_drives_a_real_sandbox(real_cluster: c.RealCluster) -> None:
    marker = pathlib.Path("/var/tmp") / f"space-mcp-host-{secrets.token_hex(6)}"
    marker.write_text("the host's own file")

    async def scenario() -> None:
        async with over_stdio(real_cluster.url, real_cluster.api_key) as mcp:
            assert await mcp.tool_names() == [name for name, _hints in TOOLS]
            sb = await new_sandbox(mcp)
            try:
                out = await mcp.ok("execute_command", {"id": sb, "command": "cat /proc/version", "cwd": "/"})
                assert out.startswith("exit code 0\n--- stdout ---\nLinux version"), out
                await mcp.ok("write_file", {"id": sb, "path": "/work/state.txt", "content": "before"})
                assert await mcp.ok("read_file", {"id": sb, "path": "state.txt"}) == "before"
                cell = "import os\nx = 6\nprint(os.getcwd())\nx * 7"
                assert await mcp.ok("run_code", {"id": sb, "code": cell}) == (
                    "exit code 0\n--- stdout ---\n/work\n42\n"
                )
                failed = await mcp.ok("run_code", {"id": sb, "code": "def f():\n    return 1 / 0\nf()"})
                assert failed.startswith("exit code 1\n--- stderr ---\nTraceback"), failed
                assert 'File "<cell>", line 2, in f' in failed and "ZeroDivisionError" in failed

                snap = first_word_after(await mcp.ok("snapshot", {"id": sb, "kind": "disk"}), "Snapshot ")
                assert snap in await mcp.ok("list_snapshots", {"id": sb})
                await mcp.ok("write_file", {"id": sb, "path": "/work/state.txt", "content": "after"})
                assert "running" in await mcp.ok("rollback", {"id": sb, "snapshot_id": snap})
                assert await mcp.ok("read_file", {"id": sb, "path": "/work/state.txt"}) == "before"

                # Outside the sandbox: dot segments stop at the sandbox's own root.
                for path in (f"/../../../..{marker}", f"../../../../../..{marker}", str(marker)):
                    refusal = await mcp.refused("read_file", {"id": sb, "path": path})
                    assert "not_found" in refusal and "host's own" not in refusal, (path, refusal)
                listing = await mcp.ok("list_files", {"id": sb, "path": "/../../var/tmp"})
                assert marker.name not in listing
            finally:
                assert f"Deleted sandbox {sb}" in await mcp.ok("delete_sandbox", {"id": sb})
            assert sb not in await listing_once_torn_down(mcp, sb)

    try:
        asyncio.run(scenario())
    finally:
        marker.unlink()


def test_the_http_endpoint_acts_in_the_callers_project_on_real_sandboxes(real_cluster: c.RealCluster) -> None:
    name = f"mcp-{secrets.token_hex(4)}"
    with real_cluster.sdk() as sp:
        sp.projects.create(name)

    async def scenario() -> None:
        async with over_http(real_cluster.url, real_cluster.api_key, project=name) as mcp:
            # E2B's shape: run_code(code) alone runs in a sandbox of its own, gone afterwards.
            assert await mcp.ok("run_code", {"code": "sum(range(10))"}) == "exit code 0\n--- stdout ---\n45\n"
            assert await listing_once_torn_down(mcp) == "No sandboxes."
            sb = await new_sandbox(mcp)
            try:
                assert sb in await mcp.ok("list_sandboxes")
                egress = await mcp.ok("set_egress_policy", {"id": sb, "allow": ["*.example.com"]})
                assert egress.startswith(f"Egress of {sb}") and "*.example.com" in egress, egress
                out = await mcp.ok(
                    "execute_command", {"id": sb, "command": "echo $GREETING", "env": {"GREETING": "hi"}}
                )
                assert out == "exit code 0\n--- stdout ---\nhi\n"
                # A full snapshot (memory too) and a rollback to it, through the caller's key.
                await mcp.ok("write_file", {"id": sb, "path": "state.txt", "content": "checkpointed"})
                snap = first_word_after(await mcp.ok("snapshot", {"id": sb, "kind": "full"}), "Snapshot ")
                assert f"{snap}  full  ready" in await mcp.ok("list_snapshots", {"id": sb})
                await mcp.ok("execute_command", {"id": sb, "command": "echo later > state.txt"})
                assert "running" in await mcp.ok("rollback", {"id": sb, "snapshot_id": snap})
                assert await mcp.ok("read_file", {"id": sb, "path": "state.txt"}) == "checkpointed"
            finally:
                await mcp.ok("delete_sandbox", {"id": sb})
        # The same key in its default project sees none of them.
        async with over_http(real_cluster.url, real_cluster.api_key) as mcp:
            assert sb not in await mcp.ok("list_sandboxes")

    asyncio.run(scenario())
