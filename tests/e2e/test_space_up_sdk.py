"""The SDK against a whole local installation with the real runsc node (`real_cluster`: root helper, node
agent as the `space` user, control plane, SQLite): what only a real isolation driver shows — processes
that live through pause/resume and come back with a full-checkpoint rollback — and the idle policy with a
real guest daemon (whose own health polls must not count as activity)."""

from __future__ import annotations

import time

import pytest

from space.sdk import NotFound
from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster


def running_pids(sb: object) -> dict[str, int | None]:
    return {p.id: p.pid for p in sb.processes.list() if p.running}  # type: ignore[attr-defined]


def test_processes_live_through_pause_resume_and_return_with_a_full_rollback(
    real_cluster: c.RealCluster,
) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            assert sb.exec("cat /proc/version").stdout.startswith("Linux version"), "a guest kernel answers"
            process = sb.processes.start("sleep 3600", tag="survivor")
            sb.files.write("/work/state.txt", b"before")
            before = running_pids(sb)
            assert process.id in before

            assert sb.pause().state == "paused"
            assert sb.resume().state == "running"
            assert running_pids(sb) == before, "pause/resume keeps the very same processes"

            snap = sb.snapshots.create(full=True)
            assert snap.kind == "full"
            assert sb.refresh().state == "running" and running_pids(sb) == before

            process.signal("SIGKILL")
            c.wait_for(lambda: process.id not in running_pids(sb), timeout=10, what="process killed")
            sb.files.write("/work/state.txt", b"after")

            assert sb.rollback(snap).state == "running"
            assert sb.files.read("/work/state.txt") == b"before"
            assert running_pids(sb) == before, "the checkpoint brought the process back"
        finally:
            sb.delete(wait=True)  # answered once deleted, not once deleting (ADR 0073)
        with pytest.raises(NotFound):
            sp.sandboxes.get(sb.id)


def test_an_idle_sandbox_is_paused_and_the_next_request_resumes_it(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        created = time.monotonic()
        sb = sp.sandboxes.create(idle_timeout_s=2, limits={"cpus": 0.5, "memory_mb": 256})
        try:
            sb.processes.start("sleep 3600")  # a process that does nothing is not activity
            c.wait_for(lambda: sb.refresh().state == "paused", timeout=30, interval=0.2, what="idle pause")
            assert time.monotonic() - created >= 2
            assert sb.exec("echo awake").stdout == "awake\n"
            assert sb.refresh().state == "running"
        finally:
            sb.delete()
