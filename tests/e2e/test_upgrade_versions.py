"""Issue 16's upgrade while sandboxes run (ADR 0079), with a changed version string: a pair of `space
controlplane run` replicas on a real PostgreSQL and a real runsc node joined with `space node join`.

1. The pair starts at once on a fresh database: the schema is migrated exactly once (one replica's log says
   it migrated, the other's that it found the schema there: the advisory lock of store/migrate.py).
2. A sandbox runs; the node is restarted (SIGTERM, as its service manager would) as version N+1
   (`SPACE_VERSION_OVERRIDE`): it adopts the sandbox, which never stopped (same id, its uptime went on,
   exec works), and `space node list`'s record shows the new version.
3. One replica is restarted as N+1 while the other stays N: both answer /healthz with their own version,
   both serve the sandbox, and the restarted one finds the schema at head (no second migration).
4. The node is drained, restarted as N+2 and comes back: ready, reporting N+2, still drained (no sandbox
   placed on it) until it is uncordoned; then a new sandbox runs on it.

The version string changes what each process reports, not its code: what a real N+1 adds (a migration of
its own, a protocol change) is covered where it lives (tests/store/test_store.py: one migrator of several;
tests/node/test_node_protocol*: ranges refused and accepted)."""

from __future__ import annotations

import contextlib
import pathlib
import secrets
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from space.cli.node_join import AGENT_USER
from space.core import errors
from space.core.versions import space_version
from space.node.helper.netaddr import node_tag
from space.node.local import LocalNode
from space.sdk import Space
from tests.support import cluster as c
from tests.support import postgres
from tests.support.host import loop_devices_for, network_traces

pytestmark = pytest.mark.root

postgres_url = postgres.postgres_url
READY_TIMEOUT_S = 600.0
LOOP_RELEASE_S = 60.0
NEXT = "99.0.0-next"  # "N+1": any version token the running code is not
AFTER_NEXT = "99.1.0"  # "N+2"
MIGRATED = "database schema migrated from empty to "
ALREADY = "database schema already at "


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    with c.root_scratch("upgrade") as made:
        yield made


def _space(*argv: str) -> str:
    done = c.space_cli(*argv)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _version_of(service: c.Service, url: str) -> str | None:
    """The version a replica's /healthz answers; None while it does not answer."""
    service.check_alive()
    with contextlib.suppress(httpx.HTTPError, ValueError):
        answer = httpx.get(f"{url}/healthz", timeout=2.0)
        if answer.status_code == 200:
            return str(answer.json()["version"])
    return None


def _wait_serving(replica: c.Service, url: str) -> None:
    try:
        c.wait_for(lambda: _version_of(replica, url), timeout=c.START_TIMEOUT_S, what=replica.name)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{replica.log_tail(6000)}") from None


def _uptime(sandbox: object) -> float:
    return float(sandbox.exec("cut -d' ' -f1 /proc/uptime").stdout)  # type: ignore[attr-defined]


def _node(sp: Space, join: c.Service) -> dict[str, object] | None:
    join.check_alive()
    ready = [n.data for n in sp.nodes.list() if n.data.get("status") == "ready" and n.data.get("capacity")]
    return ready[0] if ready else None


def _reporting(node: dict[str, object] | None, release: str) -> dict[str, object] | None:
    return node if node is not None and node.get("space_version") == release else None


def _purge(data_dir: pathlib.Path, cgroup_parent: str) -> dict[str, object]:
    """Destroy what the stopped node left (sandboxes, network, btrfs image); what is left on the host."""
    import pwd

    try:
        uid = pwd.getpwnam(AGENT_USER).pw_uid
    except KeyError:
        uid = 0
    ids = c.sandbox_ids_in(data_dir)
    if data_dir.exists():
        import asyncio

        node = LocalNode(data_dir, agent_user=uid, cgroup_parent=cgroup_parent)
        node.start_helper()
        try:
            asyncio.run(node.stop(purge=True))
        except errors.RuntimeFailure as exc:  # a loop device the kernel releases late (test_fleet_three...)
            if "loop devices still attached" not in exc.message:
                raise
    started = time.monotonic()
    while loop_devices_for(str(data_dir)) and time.monotonic() - started < LOOP_RELEASE_S:
        time.sleep(0.5)
    left: dict[str, object] = {k: v for k, v in c.host_leftovers(data_dir, ids).items() if v}
    traces = network_traces(node_tag(data_dir.resolve()))
    if traces:
        left["network"] = traces
    for group in pathlib.Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}"):
        with contextlib.suppress(OSError):
            group.rmdir()
    return left


def _replica(root: pathlib.Path, i: int, port: int, database: str, token_file: pathlib.Path) -> c.Service:
    argv = [sys.executable, "-m", "space.cli.main", "controlplane", "run", "--database", database,
            "--listen", f"127.0.0.1:{port}", "--data-dir", str(root / f"cp{i}"),
            "--node-token-file", str(token_file)]  # fmt: skip
    return c.Service(f"cp{i}", argv, root / f"cp{i}.log")


def test_node_and_replica_restarted_as_the_next_version_while_a_sandbox_runs(
    postgres_url: str, root: pathlib.Path
) -> None:
    current = space_version()
    assert current != NEXT
    database = postgres.new_database(postgres_url)
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    cgroup_parent = f"space-upg-{secrets.token_hex(3)}"
    config = root / "space.toml"
    config.write_text(f'[node]\ncgroup_parent = "{cgroup_parent}"\ntemplates = "python"\n')
    config.chmod(0o600)
    ports = [c.free_port(), c.free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    replicas = [_replica(root, i, port, database, token_file) for i, port in enumerate(ports)]
    node_dir = root / "node"
    join = c.Service(
        "join",
        [sys.executable, "-m", "space.cli.main", "node", "join", urls[0], "--token-file", str(root / "token"),
         "--data-dir", str(node_dir), "--config", str(config), "--listen", f"127.0.0.1:{c.free_port()}"],
        root / "join.log",
    )  # fmt: skip
    sandbox = None
    admin_key = ""
    try:
        # 1. the pair starts at once on an empty database: one of them migrates it
        for replica in replicas:
            replica.start()
        for replica, url in zip(replicas, urls, strict=True):
            _wait_serving(replica, url)
        assert [_version_of(r, u) for r, u in zip(replicas, urls, strict=True)] == [current, current]
        logs = [r.log_path.read_text(errors="replace") for r in replicas]
        assert sorted(log.count(MIGRATED) for log in logs) == [0, 1], logs
        assert sorted(log.count(ALREADY) for log in logs) == [0, 1], logs
        admin_key = _space("controlplane", "admin-key", "create", "--database", database)
        (root / "token").write_text(_space("controlplane", "token", "create", "--database", database) + "\n")
        (root / "token").chmod(0o600)
        join.start()
        with Space(url=urls[0], api_key=admin_key) as sp:
            # A node reports its release with its runtime, in a heartbeat after it registered (ADR 0079).
            node = c.wait_for(lambda: _reporting(_node(sp, join), current), timeout=READY_TIMEOUT_S,
                              interval=0.5, what="the node's release")  # fmt: skip
            sandbox = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
            sandbox.files.write("/work/kept", b"before the upgrade\n")
            before = _uptime(sandbox)
            # 2. the node restarts as N+1 (the agent and its helper): the sandbox is adopted, never stopped
            join.stop(timeout=120)
            assert join.proc is not None and join.proc.returncode == 0, join.log_tail()
            stopped_at = time.monotonic()
            join.extra_env = {"SPACE_VERSION_OVERRIDE": NEXT}
            join.start()
            c.wait_for(
                lambda: (_node(sp, join) or {}).get("space_version") == NEXT, timeout=READY_TIMEOUT_S,
                interval=0.5, what="the node as N+1",
            )  # fmt: skip
            assert f"SPACE {NEXT} starting (agent)" in (node_dir / "agent.log").read_text(errors="replace")
            adopted = sp.sandboxes.get(sandbox.id)
            assert adopted.state == "running" and adopted.data["node_id"] == node["id"]
            assert adopted.files.read("/work/kept") == b"before the upgrade\n"
            assert _uptime(adopted) >= before + (time.monotonic() - stopped_at) - 1.0, "it never stopped"
            assert [n.id for n in sp.nodes.list()] == [node["id"]]  # the same node, not a new one
        # 3. one replica restarts as N+1 while the other stays N: both serve, nothing migrates again
        replicas[1].stop()
        replicas[1].extra_env = {"SPACE_VERSION_OVERRIDE": NEXT}
        replicas[1].start()
        _wait_serving(replicas[1], urls[1])
        assert [_version_of(r, u) for r, u in zip(replicas, urls, strict=True)] == [current, NEXT]
        for url in urls:
            with Space(url=url, api_key=admin_key) as sp:
                assert sp.sandboxes.get(sandbox.id).exec("cat /work/kept").stdout == "before the upgrade\n"
                assert [n.data["space_version"] for n in sp.nodes.list()] == [NEXT]
        logs = [r.log_path.read_text(errors="replace") for r in replicas]
        assert sum(log.count(MIGRATED) for log in logs) == 1, logs
        assert logs[1].count(ALREADY) == (2 if MIGRATED in logs[0] else 1), logs[1][-3000:]
        assert f"SPACE {NEXT} starting (controlplane)" in logs[1]
        with Space(url=urls[1], api_key=admin_key) as sp:
            sp.sandboxes.get(sandbox.id).delete()
            sandbox = None
            # 4. the node is drained, upgraded again and comes back: ready, N+2, drained until uncordoned
            node_id = str(node["id"])
            sp.nodes.drain(node_id)
            c.wait_for(
                lambda: sp.nodes.get(node_id).admin == "drained", timeout=120, interval=0.5, what="drained"
            )
            join.stop(timeout=120)
            assert join.proc is not None and join.proc.returncode == 0, join.log_tail()
            join.extra_env = {"SPACE_VERSION_OVERRIDE": AFTER_NEXT}
            join.start()
            c.wait_for(
                lambda: (_node(sp, join) or {}).get("space_version") == AFTER_NEXT, timeout=READY_TIMEOUT_S,
                interval=0.5, what="the drained node back as N+2",
            )  # fmt: skip
            assert sp.nodes.get(node_id).admin == "drained"  # an upgrade does not undo the operator's hold
            sp.nodes.uncordon(node_id)
            sandbox = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
            assert sandbox.data["node_id"] == node_id and sandbox.exec("echo back").stdout == "back\n"
            sandbox.delete()
            sandbox = None
    finally:
        if sandbox is not None:
            with contextlib.suppress(Exception), Space(url=urls[0], api_key=admin_key) as sp:
                sp.sandboxes.get(sandbox.id).delete()
        join.stop(timeout=120)
        for replica in replicas:
            replica.stop()
        left = _purge(node_dir, cgroup_parent)
    assert join.proc is not None and join.proc.returncode == 0, join.log_tail()
    assert left == {}
