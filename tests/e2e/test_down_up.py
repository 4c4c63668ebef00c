"""`space down` then `space up` on the same data directory, then `space sandbox create` at once (issue 11,
"found when tried as a user would": the create used to hang for 120 s on the previous node record).

The node keeps its identity across the restart (one node record: `offline` after `space down`, which
deregistered it, and ready again after `space up`), a clean `space down` does not fence away the sandboxes
it leaves running (ADR 0033: the agent stops first, deregisters, then releases its lease),
so the next `space up` adopts the old sandbox, files and all, and a create right after `space up` is
placed and running well within the old 120 s."""

from __future__ import annotations

import time

import pytest

from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from tests.support.cluster import free_port
from tests.support.space_up import Cli

pytestmark = pytest.mark.root

CREATE_BOUND_S = 60.0


def nodes(cli: Cli) -> list[tuple[str, str]]:
    store = Store(sqlite_url(cli.data_dir))
    try:
        return [(node.id, node.status) for node in store.list_nodes(None)]
    finally:
        store.close()


@pytest.mark.timeout(900)  # two `space up`s and a `space down`: minutes on a loaded 2-core machine
def test_down_up_then_create_at_once_and_the_old_sandbox_is_still_there(cli: Cli) -> None:
    port = free_port()
    up = ("up", "--data-dir", str(cli.data_dir), "--port", str(port), "--detach")
    cli.run(*up, timeout=900)
    old = str(cli.json("sandbox", "create", "--json")["id"])
    cli.run("files", "write", old, "/work/kept.txt", stdin=b"kept across down and up\n")
    ((node_id, status),) = nodes(cli)
    assert status == "ready"

    stopping = time.monotonic()
    cli.run("down", "--data-dir", str(cli.data_dir), timeout=300)
    down_s = time.monotonic() - stopping
    assert nodes(cli) == [(node_id, "offline")], cli.logs()  # deregistered: not lost, not scheduled
    cli.run(*up, timeout=900)
    up_s = time.monotonic() - stopping - down_s
    started = time.monotonic()
    new = cli.json("sandbox", "create", "--json")
    took = time.monotonic() - started
    assert new["state"] == "running" and took < CREATE_BOUND_S, (new, took, cli.logs())
    print(f"\n`space down` {down_s:.1f} s, `space up` {up_s:.1f} s, then create {took:.1f} s")

    assert nodes(cli) == [(node_id, "ready")]  # the same node, not a second record
    assert cli.json("sandbox", "get", old, "--json")["state"] == "running"
    assert cli.run("files", "read", old, "/work/kept.txt").stdout == b"kept across down and up\n"
    assert cli.run("exec", str(new["id"]), "--", "echo", "new").stdout == b"new\n"
    for sandbox_id in (str(new["id"]), old):
        cli.run("sandbox", "delete", sandbox_id)
