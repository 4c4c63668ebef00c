"""`space node ...`: the cluster's nodes as an operator drives them (list, cordon, uncordon, drain, remove:
docs/adr/0065-node-operations.md, through the API with an organisation admin key) and the clean-up of
what a crashed run left of this machine's node (`cleanup`, local, as root)."""

from __future__ import annotations

import pathlib
import time
from typing import Annotated

import typer

from space.cli._common import client, handles_errors, print_json, table
from space.core import errors

node_app = typer.Typer(help="The cluster's nodes, and this machine's node.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
NodeId = Annotated[str, typer.Argument(metavar="NODE_ID")]


def _used(node: dict[str, object]) -> str:
    used, capacity = node.get("used") or {}, node.get("capacity") or {}
    assert isinstance(used, dict) and isinstance(capacity, dict)
    return f"{used.get('memory_mb', 0)}/{capacity.get('memory_mb', 0)} MB, {capacity.get('cpus', 0)} cpus"


@node_app.command("list")
@handles_errors
def node_list(as_json: JsonFlag = False) -> None:
    """List the cluster's nodes: liveness, the operator's hold, room, sandboxes, version, last heartbeat."""
    nodes = client().nodes.list()
    if as_json:
        print_json([node.data for node in nodes])
        return
    rows = [
        [
            n.id, n.data.get("status"), n.admin, _used(n.data), n.data.get("sandboxes", 0),
            n.data.get("moving", 0), ",".join(f"{t}={c}" for t, c in (n.data.get("pools") or {}).items()),
            n.data.get("space_version") or "-", n.data.get("version") or "-", n.data.get("last_heartbeat_at"),
        ]
        for n in nodes
    ]  # fmt: skip
    columns = ["ID", "STATUS", "ADMIN", "MEMORY", "SANDBOXES", "MOVING", "POOLS", "VERSION", "RUNTIME"]
    table(rows, [*columns, "HEARTBEAT"])


@node_app.command("cordon")
@handles_errors
def node_cordon(node_id: NodeId) -> None:
    """No new sandbox is placed on the node; its sandboxes stay (kept across its restarts)."""
    typer.echo(f"{node_id}: {client().nodes.cordon(node_id).admin}")


@node_app.command("uncordon")
@handles_errors
def node_uncordon(node_id: NodeId) -> None:
    """The node takes new sandboxes again (a drain under way stops)."""
    typer.echo(f"{node_id}: {client().nodes.uncordon(node_id).admin}")


@node_app.command("drain")
@handles_errors
def node_drain(
    node_id: NodeId,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the node is drained.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds --wait waits at most.")] = 600.0,
) -> None:
    """Cordon the node and move its sandboxes off (suspended, then restored on another node with room)."""
    space = client()
    node = space.nodes.drain(node_id)
    deadline = time.monotonic() + timeout
    while wait and node.admin == "draining":
        if time.monotonic() > deadline:
            raise errors.Unavailable(
                f"node {node_id} is still draining after {timeout:g} s: {node.data.get('sandboxes')} "
                f"sandboxes on it, {node.data.get('moving')} being moved"
            )
        typer.echo(f"{node_id}: draining, {node.data.get('sandboxes')} sandboxes left", err=True)
        time.sleep(1.0)
        node = space.nodes.get(node_id)
    typer.echo(f"{node_id}: {node.admin}")


@node_app.command("remove")
@handles_errors
def node_remove(node_id: NodeId) -> None:
    """Forget a drained node (or an empty cordoned, lost or offline one); its agent is refused after."""
    client().nodes.remove(node_id)
    typer.echo(f"{node_id}: removed")


@node_app.command("cleanup")
def node_cleanup(
    data_dirs: Annotated[list[pathlib.Path] | None, typer.Argument(help="node data directories")] = None,
    all_test_dirs: Annotated[
        bool, typer.Option("--all-test-dirs", help="also every directory the test suites left in /var/tmp")
    ] = False,
) -> None:
    """Tear down what a crashed run left of a node (sandboxes, network, mounts) and remove its directory."""
    from space.node import cleanup  # the node's machinery is imported by the command that runs it

    argv = [str(path) for path in data_dirs or []] + (["--all-test-dirs"] if all_test_dirs else [])
    raise typer.Exit(cleanup.main(argv))
