"""`space up` over the real runsc node (ADR 0021): the node agent's RPC refuses the cluster's `node.token`
(which only enrols) and accepts only the node's own RPC token, kept 0600 by the agent's user in the data
directory; `space down` then `space up` keeps the one node (same id, identity and token), at whatever port
the new agent listens on, instead of registering a second one."""

from __future__ import annotations

import contextlib
import json
import pwd
import re

import httpx
import pytest

from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import NodeRecord
from space.controlplane.store.store import Store
from space.node.agent.identity import default_identity_file, default_rpc_token_file, identity_dir
from tests.support.cluster import free_port, wait_for
from tests.support.space_up import Cli

pytestmark = pytest.mark.root


def agent_uid() -> int:
    try:
        return pwd.getpwnam("space").pw_uid
    except KeyError:
        return 0


def one_ready_node(store: Store) -> NodeRecord:
    def ready() -> NodeRecord | None:
        nodes = store.list_nodes(None)
        assert len(nodes) == 1, f"more than one node registered: {nodes}"
        return nodes[0] if nodes[0].status == "ready" and nodes[0].capacity else None

    return wait_for(ready, timeout=120, interval=0.5, what="the node ready")


def rpc(url: str, token: str, path: str = "/node/v1/info") -> httpx.Response:
    return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=15)


def test_the_agents_rpc_refuses_the_cluster_token_and_a_restart_keeps_the_node(cli: Cli) -> None:
    port = free_port()
    up = cli.run("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach", timeout=900)
    assert re.search(r"^SPACE_URL=", up.stdout.decode(), re.M), up.stdout
    store = Store(sqlite_url(cli.data_dir))
    try:
        node = one_ready_node(store)
        cluster_token = (cli.data_dir / "node.token").read_text().strip()
        rpc_token = default_rpc_token_file(cli.data_dir).read_text().strip()
        identity = json.loads(default_identity_file(cli.data_dir).read_text())
        assert identity["node_id"] == node.id and rpc_token != cluster_token
        # The node's secrets: its own user's, owner-only.
        assert identity_dir(cli.data_dir).stat().st_mode & 0o777 == 0o700
        for path in (default_rpc_token_file(cli.data_dir), default_identity_file(cli.data_dir)):
            assert path.stat().st_mode & 0o777 == 0o600, path
            assert path.stat().st_uid == agent_uid(), path
        # The cluster token is refused on every RPC route; the node's own token is accepted.
        for path in ("/node/v1/info", "/node/v1/sandboxes", "/node/v1/no-such-route"):
            answer = rpc(node.url, cluster_token, path)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "unauthenticated"
        assert rpc(node.url, rpc_token).status_code == 200
        # ... and the control plane reaches the node with it.
        sandbox_id = str(cli.json("sandbox", "create", "--json")["id"])
        assert cli.run("exec", sandbox_id, "--", "echo", "through the node's own token").stdout == (
            b"through the node's own token\n"
        )

        cli.run("down", "--data-dir", str(cli.data_dir), timeout=300)
        cli.run("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach", timeout=900)

        # The record stays "ready" at the old agent's url until the new agent re-registers: wait for the
        # url the node answers on with its own token (the new agent listens on a new port).
        def reregistered() -> NodeRecord | None:
            record = one_ready_node(store)
            with contextlib.suppress(httpx.HTTPError):
                if rpc(record.url, rpc_token).status_code == 200:
                    return record
            return None

        again = wait_for(reregistered, timeout=120, interval=0.5, what="the node re-registered")
        assert again.id == node.id  # the same node, re-registered with its identity (at any port)
        assert json.loads(default_identity_file(cli.data_dir).read_text()) == identity
        assert default_rpc_token_file(cli.data_dir).read_text().strip() == rpc_token
        assert rpc(again.url, cluster_token).status_code == 401
        fresh = str(cli.json("sandbox", "create", "--json")["id"])
        assert cli.run("exec", fresh, "--", "echo", "again").stdout == b"again\n"
    finally:
        store.close()
