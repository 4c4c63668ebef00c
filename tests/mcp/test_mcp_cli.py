"""`space mcp` as a process: configured like every command (no server configured: exit 2 before serving),
a key the server refuses is every tool's error, never the end of the server, and --project names the
project of an organization key."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from tests.support import cluster as c
from tests.support.mcp_clients import over_stdio

fake_cluster = c.fake_cluster
SPACE = os.path.join(os.path.dirname(sys.executable), "space")


def test_without_a_server_it_exits_2_before_serving(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPACE_")}
    env.update({"HOME": str(tmp_path), "SPACE_CONFIG": os.path.join(str(tmp_path), "none.json")})
    done = subprocess.run([SPACE, "mcp"], check=False, env=env, input=b"", capture_output=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stdout == b""
    assert b"error: configuration_error: no server configured" in done.stderr


def test_a_refused_key_is_each_tools_error_and_the_server_goes_on(fake_cluster: c.Cluster) -> None:
    async def scenario() -> None:
        async with over_stdio(fake_cluster.url, "sk-not-a-key") as mcp:
            for _ in range(2):
                refusal = await mcp.refused("list_sandboxes")
                assert (
                    refusal
                    == "Error executing tool list_sandboxes: unauthenticated: unknown or revoked API key"
                )
            assert "create_sandbox" in await mcp.tool_names()

    asyncio.run(scenario())


def test_an_org_key_acts_in_the_project_named_by_project(fake_cluster: c.Cluster) -> None:
    made = c.new_project(fake_cluster)

    async def scenario() -> None:
        async with over_stdio(fake_cluster.url, fake_cluster.admin_key, project=made.name) as mcp:
            created = await mcp.ok("create_sandbox", {"limits": c.SMALL})
        sb = created.split()[2].rstrip(":")
        assert [each.id for each in fake_cluster.store.list_sandboxes(made.id)] == [sb]

    try:
        asyncio.run(scenario())
    finally:
        c.delete_all(fake_cluster, made)
