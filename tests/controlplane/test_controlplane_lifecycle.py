"""The sandbox lifecycle through the SDK, over a real control plane and a fake-driver node: what the API
answers, what the database records and what the node runs must agree after every step."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from websockets.sync.client import connect

from space.sdk import InvalidState, NotFound, Sandbox, Space
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project


def on_node(cluster: c.Cluster, sandbox_id: str) -> str | None:
    """The node's state of the sandbox (None if the node does not have it)."""
    item = cluster.node.sandboxes().get(sandbox_id)
    return None if item is None else str(item["state"])


def gone(sp: Space, sandbox_id: str) -> bool:
    try:
        sp.sandboxes.get(sandbox_id)
    except NotFound:
        return True
    return False


def settled(cluster: c.Cluster, sb: Sandbox, state: str) -> None:
    """The API, the database and the node all say `state`, and nothing is in flight."""
    sb.refresh()
    assert (sb.state, sb.data["desired_state"]) == (state, state), sb.data
    record = cluster.store.load_sandbox(sb.id)
    assert record is not None and (record.state, record.desired_state) == (state, state)
    assert on_node(cluster, sb.id) == state


def test_create_exec_files_pause_resume_stop_start_delete(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(env={"GREETING": "hello"}, limits=c.SMALL)
        assert sb.state == "running" and sb.data["node_id"] == fake_cluster.node_record().id  # type: ignore[union-attr]
        assert sb.data["env"] == {"GREETING": "hello"} and sb.data["limits"]["cpus"] == c.SMALL["cpus"]
        settled(fake_cluster, sb, "running")
        assert [s.id for s in sp.sandboxes.list()] == [sb.id]
        assert sp.sandboxes.get(sb.id).id == sb.id

        r = sb.exec('echo "$GREETING"; echo oops >&2; exit 3')
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hello\n", "oops\n")
        r = sb.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
        assert (r.exit_code, r.stdout) == (0, "['a b', 'c']\n")

        assert sb.files.write("dir/a.txt", b"data\x00\xff") == 6
        assert sb.files.read("dir/a.txt") == b"data\x00\xff"
        assert [e["name"] for e in sb.files.list("dir")] == ["a.txt"]
        assert sb.files.stat("dir/a.txt")["size"] == 6
        sb.files.rename("dir/a.txt", "dir/b.txt")
        assert not sb.files.exists("dir/a.txt") and sb.files.exists("dir/b.txt")
        big = os.urandom(3 << 20)
        sb.files.write("big.bin", big)
        assert sb.files.read("big.bin") == big

        sb.pause()
        settled(fake_cluster, sb, "paused")
        sb.resume()
        settled(fake_cluster, sb, "running")
        assert sb.exec("cat dir/b.txt").stdout == "data\x00\ufffd"

        sb.stop()
        settled(fake_cluster, sb, "stopped")
        with pytest.raises(Exception, match="stopped"):
            sb.exec("true")
        sb.start()
        settled(fake_cluster, sb, "running")
        assert sb.files.read("dir/b.txt") == b"data\x00\xff", "the disk is kept across stop/start"

        deleted = sb.delete()  # answers once `deleting`; the teardown goes on in the background (ADR 0073)
        assert (deleted.state, deleted.data["desired_state"]) == ("deleting", "deleted")
        with pytest.raises(InvalidState, match="deleting"):
            sb.exec("true")
        c.wait_for(lambda: gone(sp, sb.id), timeout=30, what=f"{sb.id} deleted")
        with pytest.raises(NotFound):
            sp.sandboxes.get(sb.id)
        assert on_node(fake_cluster, sb.id) is None
        assert sp.sandboxes.list() == []
        record = fake_cluster.store.load_sandbox(sb.id)
        assert record is not None and record.state == "deleted" and record.deleted_at is not None


def test_exec_on_a_paused_sandbox_resumes_it(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("f", b"kept")
        sb.pause()
        settled(fake_cluster, sb, "paused")
        assert sb.exec("cat f").stdout == "kept"
        settled(fake_cluster, sb, "running")
        sb.pause()
        assert sb.files.read("f") == b"kept", "a file read resumes it too"
        settled(fake_cluster, sb, "running")


def test_snapshot_and_rollback(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("a.txt", b"v1")
        disk = sb.snapshots.create()
        assert (disk.kind, disk.sandbox_id) == ("disk", sb.id)
        sb.files.write("a.txt", b"v2")
        sb.files.write("b.txt", b"later")
        full = sb.snapshots.create(full=True)
        assert full.kind == "full"
        assert [s.id for s in sb.snapshots.list()] == [disk.id, full.id]
        sb.files.write("a.txt", b"v3")

        sb.rollback(disk)
        settled(fake_cluster, sb, "running")
        assert sb.files.read("a.txt") == b"v1"
        assert not sb.files.exists("b.txt")

        sb.rollback(full)
        settled(fake_cluster, sb, "running")
        assert (sb.files.read("a.txt"), sb.files.read("b.txt")) == (b"v2", b"later")
        assert sb.exec("echo alive").stdout == "alive\n"


def test_fork(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        parent = sp.sandboxes.create(env={"K": "V"}, limits=c.SMALL)
        parent.files.write("state.txt", b"from the parent")
        child = parent.fork()
        assert child.id != parent.id
        assert child.data["forked_from"] == parent.id and child.data["env"] == {"K": "V"}
        settled(fake_cluster, child, "running")
        assert child.files.read("state.txt") == b"from the parent"
        child.files.write("state.txt", b"changed in the child")
        assert parent.files.read("state.txt") == b"from the parent", "the child is a copy"
        twins = parent.fork(2)
        assert len({t.id for t in twins}) == 2
        for twin in twins:
            settled(fake_cluster, twin, "running")
            assert twin.files.read("state.txt") == b"from the parent"
        assert len(sp.sandboxes.list()) == 4
        # The parent goes on as before, and deleting it leaves the children alone.
        settled(fake_cluster, parent, "running")
        parent.delete()
        settled(fake_cluster, child, "running")
        assert child.exec("cat state.txt").stdout == "changed in the child"


def test_idle_timeout_pauses_and_the_next_exec_resumes(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        created = time.monotonic()
        sb = sp.sandboxes.create(idle_timeout_s=2, limits=c.SMALL)
        assert sb.data["idle_timeout_s"] == 2
        c.wait_for(lambda: sb.refresh().state == "paused", timeout=20, interval=0.2, what="paused when idle")
        assert time.monotonic() - created >= 2, "paused before its idle timeout"
        settled(fake_cluster, sb, "paused")
        assert sb.exec("echo back").stdout == "back\n"
        settled(fake_cluster, sb, "running")
        # Activity keeps it running: while requests keep coming, it is never paused.
        deadline = time.monotonic() + 3  # longer than the idle timeout
        while time.monotonic() < deadline:
            assert sb.exec("true").exit_code == 0
            assert fake_cluster.store.load_sandbox(sb.id).desired_state == "running"  # type: ignore[union-attr]
            time.sleep(0.5)
        # Then, left alone, it is paused again.
        c.wait_for(lambda: sb.refresh().state == "paused", timeout=20, interval=0.2, what="paused again")


def test_ttl_deletes_the_sandbox(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        created = time.monotonic()
        sb = sp.sandboxes.create(ttl_s=2, limits=c.SMALL)
        assert sb.data["ttl_s"] == 2 and on_node(fake_cluster, sb.id) == "running"

        def gone() -> bool:
            try:
                sp.sandboxes.get(sb.id)
            except NotFound:
                return True
            return False

        c.wait_for(gone, timeout=20, interval=0.2, what="deleted after its ttl")
        assert time.monotonic() - created >= 2, "deleted before its ttl"
        c.wait_for(lambda: on_node(fake_cluster, sb.id) is None, timeout=10, what="gone from the node")


def leftover_processes(cluster: c.Cluster, sandbox_id: str) -> list[int]:
    """Pids of host processes still running in the sandbox's directory (the fake driver's sandboxes are
    host processes)."""
    found = c.processes_in(cluster.node.data_dir / "sandboxes" / sandbox_id)
    return [int(line.split(":")[0]) for line in found]


@pytest.mark.parametrize("how", ["delete", "stop"])
def test_no_process_of_a_sandbox_survives_its_delete_or_stop(
    fake_cluster: c.Cluster, project: c.Project, how: str
) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        process = sb.processes.start("sleep 600", tag="background")
        assert process.pid is not None
        assert [p.id for p in sb.processes.list() if p.running] == [process.id]
        getattr(sb, how)()
        deadline = time.monotonic() + 3  # the node answered the step already; let the kernel reap
        while leftover_processes(fake_cluster, sb.id) and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = leftover_processes(fake_cluster, sb.id)
        c.kill_pids(leaked)
        assert leaked == [], f"processes of {sb.id} still run after `{how}`: {leaked}"


def test_pty_for_a_member(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
    url = (
        fake_cluster.url.replace("http://", "ws://")
        + f"/v1/sandboxes/{sb.id}/pty?cmd=/bin/sh&rows=24&cols=80"
    )
    with connect(url, additional_headers={"Authorization": f"Bearer {project.key}"}, open_timeout=10) as ws:
        ws.send(b"echo pty-$((40 + 2))\n")
        seen = b""
        deadline = time.monotonic() + 15
        while b"pty-42" not in seen and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                data = ws.recv(timeout=1)
                seen += data if isinstance(data, bytes) else data.encode()
        assert b"pty-42" in seen, seen
        ws.send(b"exit\n")
