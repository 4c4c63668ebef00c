"""The control plane's /mcp endpoint with the `mcp` SDK's own client (streamable HTTP), on the shared fake
cluster: what the tools answer, and the attacks (no key and a bad key, a read-only key creating, another
tenant's sandbox through every tool that takes one, oversized arguments and bodies, endless output, a
huge file read whole). The same tools on real runsc sandboxes, and over stdio: test_mcp_runsc.py."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from space.core.ids import new_sandbox_id, new_snapshot_id
from space.mcp.tools import MAX_ARGUMENT_CHARS, READ_LIMIT_BYTES, TOOLS, WRITE_LIMIT_BYTES
from tests.support import cluster as c
from tests.support.mcp_clients import McpCaller, first_word_after, over_http

fake_cluster = c.fake_cluster
project = c.project

SMALL = {"cpus": 0.1, "memory_mb": 64}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}


@pytest.fixture(scope="module")
def limited(fake_cluster: c.Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.ControlPlane]:
    """A second control plane on the shared cluster's database and node, with a small request rate."""
    cp = c.ControlPlane(
        tmp_path_factory.mktemp("mcp-limited-cp"), fake_cluster.token_file,
        database_url=fake_cluster.database_url, name="mcp-limited",
    )  # fmt: skip
    cp.extra_env = {
        "SPACE_API_REQUESTS_PER_S": str(LIMITED_RATE),
        "SPACE_API_REQUEST_BURST": str(LIMITED_BURST),
    }
    cp.start()
    try:
        c.wait_for(cp.healthy, timeout=c.START_TIMEOUT_S, interval=0.1, what="limited control plane healthy")
        yield cp
    finally:
        cp.stop(timeout=5)


LIMITED_RATE = 0.5
LIMITED_BURST = 3


def run(scenario: object) -> None:
    asyncio.run(scenario)  # type: ignore[arg-type]


async def new_sandbox(mcp: McpCaller) -> str:
    return first_word_after(await mcp.ok("create_sandbox", {"limits": SMALL}), "Created sandbox ")


@pytest.mark.parametrize("authorization", [None, "Bearer sk-not-a-key", "Basic dXNlcjpwYXNz"])
def test_no_key_or_a_bad_key_is_a_401_before_mcp_reads_anything(
    fake_cluster: c.Cluster, authorization: str | None
) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    answer = httpx.post(f"{fake_cluster.url}/mcp", json=INITIALIZE, headers=headers, timeout=30)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "unauthenticated"
    assert answer.headers.get("mcp-session-id") is None


def test_tools_listed_and_a_sandbox_driven_through_them(fake_cluster: c.Cluster, project: c.Project) -> None:
    async def scenario() -> None:
        async with over_http(fake_cluster.url, project.key) as mcp:
            assert await mcp.tool_names() == [name for name, _hints in TOOLS]
            sb = await new_sandbox(mcp)
            assert sb in await mcp.ok("list_sandboxes")
            created = await mcp.ok(
                "create_sandbox", {"limits": SMALL, "metadata": {"task": "t1"}, "ttl_s": 600}
            )
            labelled = first_word_after(created, "Created sandbox ")
            assert "metadata=task=t1" in created and "expires 20" in created, created
            assert await mcp.ok("list_sandboxes", {"metadata": {"task": "t1"}}) == (
                f"1 sandbox(es):\n{created.split(': ', 1)[1]}"
            )
            assert await mcp.ok("list_sandboxes", {"metadata": {"task": "t2"}}) == "No sandboxes."
            await mcp.ok("delete_sandbox", {"id": labelled})
            out = await mcp.ok("execute_command", {"id": sb, "command": "echo out; echo err >&2; exit 3"})
            assert out == "exit code 3\n--- stdout ---\nout\n\n--- stderr ---\nerr\n", out
            assert await mcp.ok("write_file", {"id": sb, "path": "notes/a.txt", "content": "héllo\n"}) == (
                f"Wrote 7 bytes to notes/a.txt in {sb}."
            )
            assert await mcp.ok("read_file", {"id": sb, "path": "notes/a.txt"}) == "héllo\n"
            assert await mcp.ok("read_file", {"id": sb, "path": "notes/a.txt", "encoding": "base64"}) == (
                "aMOpbGxvCg=="
            )
            await mcp.ok("write_file", {"id": sb, "path": "b.bin", "content": "AP8A", "encoding": "base64"})
            refusal = await mcp.refused("read_file", {"id": sb, "path": "b.bin"})
            assert "not UTF-8 text" in refusal and "encoding=base64" in refusal
            listing = await mcp.ok("list_files", {"id": sb, "path": "."})
            assert "notes/" in listing and "b.bin" in listing, listing
            # A symlink reads as the file it leads to; a big directory is listed up to the limit, and says so.
            made = "ln -s notes/a.txt link.txt && mkdir many && cd many && touch $(seq 1000 1250)"
            await mcp.ok("execute_command", {"id": sb, "command": made})
            assert await mcp.ok("read_file", {"id": sb, "path": "link.txt"}) == "héllo\n"
            assert "link.txt -> notes/a.txt" in await mcp.ok("list_files", {"id": sb, "path": "."})
            many = (await mcp.ok("list_files", {"id": sb, "path": "many"})).splitlines()
            assert many[0] == "many: 200 entries (type, size in bytes, name)" and many[1].endswith(
                "  1000"
            ), many[:2]
            assert len(many) == 202 and many[-1].startswith("... and more: a listing shows at most 200"), (
                many[-2:]
            )
            assert await mcp.ok("pause_sandbox", {"id": sb}) == f"{sb}  paused  template=python"
            assert await mcp.ok("resume_sandbox", {"id": sb}) == f"{sb}  running  template=python"
            forked = await mcp.ok("fork", {"id": sb, "count": 2})
            children = [line.split()[0] for line in forked.splitlines()[1:]]
            assert forked.startswith(f"Forked {sb} into 2 sandbox(es):") and len(children) == 2, forked
            assert all(f"forked from {sb}" in line for line in forked.splitlines()[1:]), forked
            assert await mcp.ok("read_file", {"id": children[1], "path": "notes/a.txt"}) == "héllo\n"
            for child in children:
                await mcp.ok("delete_sandbox", {"id": child})
            assert f"Deleted sandbox {sb}" in await mcp.ok("delete_sandbox", {"id": sb})
            # Answered once `deleting`; listed as such until the background teardown ends (ADR 0073).
            for _ in range(300):
                listed = await mcp.ok("list_sandboxes")
                if sb not in listed:
                    break
                assert "deleting" in next(line for line in listed.splitlines() if sb in line), listed
                await asyncio.sleep(0.1)
            assert sb not in listed

    run(scenario())


def test_a_client_of_the_initialize_handshake_era_is_served_too(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    async def scenario() -> None:
        async with over_http(fake_cluster.url, project.key, mode="legacy") as mcp:
            assert mcp.client.protocol_version == "2025-11-25"
            assert "run_code" in await mcp.tool_names()
            assert await mcp.ok("list_sandboxes") == "No sandboxes."

    run(scenario())


def test_a_read_only_key_lists_but_cannot_create_or_change(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    _key_id, read_only = project.new_key("read-only")

    async def scenario() -> None:
        async with over_http(fake_cluster.url, project.key) as member:
            sb = await new_sandbox(member)
        async with over_http(fake_cluster.url, read_only) as mcp:
            assert sb in await mcp.ok("list_sandboxes")
            for name, arguments in [
                ("create_sandbox", {"limits": SMALL}),
                ("execute_command", {"id": sb, "command": "touch /tmp/x"}),
                ("write_file", {"id": sb, "path": "x", "content": "x"}),
                ("delete_sandbox", {"id": sb}),
                ("snapshot", {"id": sb}),
            ]:
                refusal = await mcp.refused(name, arguments)
                assert "permission_denied" in refusal and "read-only" in refusal, (name, refusal)
        assert len(fake_cluster.store.list_sandboxes(project.id)) == 1

    run(scenario())


#: Every tool that takes a sandbox id, with the other arguments it needs.
BY_ID = {
    "delete_sandbox": {},
    "execute_command": {"command": "cat secret.txt"},
    "run_code": {"code": "print(open('secret.txt').read())"},
    "read_file": {"path": "secret.txt"},
    "write_file": {"path": "secret.txt", "content": "overwritten"},
    "list_files": {"path": "."},
    "pause_sandbox": {},
    "resume_sandbox": {},
    "snapshot": {"kind": "disk"},
    "list_snapshots": {},
    "rollback": {"snapshot_id": new_snapshot_id()},
    "fork": {"count": 1},
    "set_egress_policy": {"allow": ["*.example.com"]},
    "login_placeholders": {"credential": "site"},
    "screenshot": {"url": "data:text/html,x"},
    "browser_login": {"credential": "site"},
}


def test_another_tenants_sandbox_is_a_missing_one_through_every_tool(fake_cluster: c.Cluster) -> None:
    victim, attacker = c.new_project(fake_cluster), c.new_project(fake_cluster)
    secret = "secret-" + secrets.token_hex(8)
    assert {name for name, _ in TOOLS if name not in {"create_sandbox", "list_sandboxes"}} == set(BY_ID)

    async def scenario() -> None:
        async with over_http(fake_cluster.url, victim.key) as mcp:
            sb = await new_sandbox(mcp)
            await mcp.ok("write_file", {"id": sb, "path": "secret.txt", "content": secret})
        before = fake_cluster.store.load_sandbox(sb)
        missing = new_sandbox_id()
        async with over_http(fake_cluster.url, attacker.key) as mcp:
            assert sb not in await mcp.ok("list_sandboxes")
            for name, arguments in BY_ID.items():
                foreign = await mcp.refused(name, {"id": sb, **arguments})
                absent = await mcp.refused(name, {"id": missing, **arguments})
                assert foreign.replace(sb, missing) == absent, (name, foreign, absent)
                assert "not_found" in foreign and secret not in foreign, (name, foreign)
        after = fake_cluster.store.load_sandbox(sb)
        assert after is not None and before is not None
        assert (after.state, after.generation) == (before.state, before.generation)
        async with over_http(fake_cluster.url, victim.key) as mcp:
            assert await mcp.ok("read_file", {"id": sb, "path": "secret.txt"}) == secret
            assert await mcp.ok("list_snapshots", {"id": sb}) == f"{sb} has no snapshots."
            assert [each.id for each in fake_cluster.store.list_sandboxes(victim.id)] == [sb]

    try:
        run(scenario())
    finally:
        c.delete_all(fake_cluster, victim)
        c.delete_all(fake_cluster, attacker)


BAD_ID_CALLS = [
    ("list_files", {"path": "."}),
    ("delete_sandbox", {}),
    ("execute_command", {"command": "true"}),
]


def test_oversized_arguments_and_bodies_are_refused(fake_cluster: c.Cluster, project: c.Project) -> None:
    async def scenario() -> None:
        async with over_http(fake_cluster.url, project.key) as mcp:
            sb = await new_sandbox(mcp)
            refusal = await mcp.refused(
                "execute_command", {"id": sb, "command": "x" * (MAX_ARGUMENT_CHARS + 1)}
            )
            assert "at most" in refusal, refusal
            too_big = "a" * (WRITE_LIMIT_BYTES + 1)
            assert "too_large" in await mcp.refused(
                "write_file", {"id": sb, "path": "big", "content": too_big}
            )
            assert "validation error" in await mcp.refused("fork", {"id": sb, "count": 1000})
            assert "validation error" in await mcp.refused(
                "execute_command", {"id": sb, "command": "true", "timeout": -1}
            )
            assert "validation error" in await mcp.refused("list_files", {"id": "x" * 65})
            # Ids that try to leave their path segment: refused as ids, whatever the tool.
            for bad in (
                "../../v1/projects",
                "sb-x/../../../v1/keys",
                "%2e%2e%2fprojects",
                "sb-\u0000",
                ".",
                "..",
            ):
                for name, arguments in BAD_ID_CALLS:
                    refusal = await mcp.refused(name, {"id": bad, **arguments})
                    assert "invalid_argument" in refusal or "not_found" in refusal, (bad, name, refusal)
            # A file above the read limit is not read whole: its size and how to read parts instead.
            await mcp.ok(
                "execute_command", {"id": sb, "command": f"head -c {READ_LIMIT_BYTES + 1} /dev/zero > big"}
            )
            refusal = await mcp.refused("read_file", {"id": sb, "path": "big"})
            assert refusal.startswith("Error executing tool read_file: too_large: big holds 256.0 KiB"), (
                refusal
            )
            assert "execute_command" in refusal
            # Endless output is cut to its head and tail with a note.
            out = await mcp.ok("execute_command", {"id": sb, "command": "seq 1 100000"})
            assert len(out) < 17_000 and out.startswith("exit code 0\n--- stdout ---\n1\n2\n"), out[:100]
            assert out.endswith("99999\n100000\n") and "characters cut here" in out
        # A body above the API's JSON limit is refused before MCP parses it.
        body = {**INITIALIZE, "params": {**INITIALIZE["params"], "padding": "x" * (2 << 20)}}
        answer = httpx.post(
            f"{fake_cluster.url}/mcp",
            content=json.dumps(body),
            headers={"Authorization": f"Bearer {project.key}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert answer.status_code == 413, answer.text

    run(scenario())


def test_mcp_requests_are_rate_limited_per_key(limited: c.ControlPlane, project: c.Project) -> None:
    headers = {
        "Authorization": f"Bearer {project.key}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    statuses: list[int] = []
    started = time.monotonic()
    with httpx.Client(base_url=limited.url, headers=headers, timeout=30) as client:
        while 429 not in statuses and len(statuses) < 30:
            answer = client.post("/mcp", json=INITIALIZE)
            statuses.append(answer.status_code)
        refused = answer
    allowed = LIMITED_BURST + math.ceil((time.monotonic() - started) * LIMITED_RATE)
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
    assert LIMITED_BURST <= len(statuses) - 1 <= allowed, statuses
    assert refused.json()["error"]["code"] == "resource_exhausted"
    assert int(refused.headers["retry-after"]) >= 1
