"""Crash convergence for real: the control plane is a subprocess, SIGKILLed while creates, pauses, resumes
and deletes are in flight, then started again on the same database. Whatever moment the kill hit, the
database and the node must converge: every record settles in its desired state (nothing stuck in an -ing
state), the node runs exactly one sandbox per live record, in the recorded state, and nothing else.

A killed control plane leaves the leases of the rows it was working on; the restarted one (a new process,
so a new lease owner) waits for them to expire (reconciler LEASE_S). The measured convergence time is
printed (`-s`) and bounded by LEASE_S plus a margin.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from space.controlplane.reconciler.loop import LEASE_S
from space.core.lifecycle import State
from tests.support import cluster as c

DELAYS_MS = (0, 20, 50, 100, 200)
SETTLE_MARGIN_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    """One cluster for the module (starting one costs seconds); the last test checks that everything the
    earlier ones did converged too."""
    with c.start_fake_cluster(tmp_path_factory.mktemp("crash")) as made:
        yield made


def in_thread(call: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the control plane died under the request: the point
            call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def one_guest_each(cluster: c.Cluster) -> None:
    """Every live sandbox has exactly one daemon process on the node, a stopped or deleted one none."""
    processes = cluster.node.guest_processes()
    for sb in cluster.records().values():
        expected = 1 if sb.state in (State.RUNNING, State.PAUSED) else 0
        assert processes.pop(sb.id, 0) == expected, f"{sb.id} ({sb.state}): daemons on the node"
    assert processes == {}, f"daemons of sandboxes the database does not have live: {processes}"


def stranded_leases(cluster: c.Cluster, owner: str) -> list[str]:
    now = cluster.store.now()
    return [
        f"{sb.id}:{sb.state}->{sb.desired_state}"
        for sb in cluster.records().values()
        if sb.lease_owner == owner and sb.lease_until is not None and sb.lease_until > now
    ]


def test_running_sandboxes_survive_a_control_plane_crash(cluster: c.Cluster) -> None:
    """Sandboxes that were running before a crash are not disturbed by it (nor by the restart)."""
    with cluster.sdk() as sp:
        kept = sp.sandboxes.create(limits=c.SMALL)
        kept.files.write("f", b"before the crash")
        pid_before = cluster.node.guest_processes()
        cluster.cp.kill()
        cluster.cp.start_and_wait()
        assert kept.refresh().state == "running"
        assert kept.files.read("f") == b"before the crash"
        assert cluster.node.guest_processes() == pid_before
    cluster.wait_converged(10)


def test_a_retry_with_the_same_idempotency_key_after_a_crash_is_answered(cluster: c.Cluster) -> None:
    """A client whose create died with the control plane retries it with the same Idempotency-Key (the SDK
    does that by itself on a transport error). The key's first request never finished, so the restarted
    control plane must not make the retry wait for it (there is nobody left to finish it), nor create a
    second sandbox: the retry gets the sandbox, within a bounded time."""
    http = cluster.http(cluster.admin_key, timeout=30)
    body = {"template": "python", "limits": c.SMALL}
    headers = {"Idempotency-Key": "create-across-a-crash"}
    before = set(cluster.records())
    thread = in_thread(lambda: http.post("/v1/sandboxes", json=body, headers=headers))
    # Kill once the request has recorded the sandbox (its idempotency record is then "in progress").
    c.wait_for(lambda: set(cluster.records()) - before, timeout=20, interval=0.005, what="the new record")
    cluster.cp.kill()
    thread.join(30)
    cluster.cp.start_and_wait()
    started = time.monotonic()
    try:
        retry = http.post("/v1/sandboxes", json=body, headers=headers, timeout=15)
    except httpx.ReadTimeout:
        pytest.fail(
            f"the retry got no answer in {time.monotonic() - started:.0f}s: the dead request's idempotency "
            "record blocks it (API: WAIT_TIMEOUT_S=120 s then 409; the store takes a stale record over only "
            "after stale_after_s=300 s)"
        )
    assert retry.status_code == 201, retry.text
    assert set(cluster.records()) - before == {retry.json()["id"]}, "exactly one sandbox for one request"
    # Its convergence is checked with everything else by the last test of the module.


def test_sigkill_while_lifecycle_requests_are_in_flight_converges(cluster: c.Cluster) -> None:
    http = cluster.http(cluster.admin_key, timeout=30)
    body = {"template": "python", "limits": c.SMALL}
    report = []
    with cluster.sdk() as sp:
        for delay_ms in DELAYS_MS:
            to_pause = sp.sandboxes.create(limits=c.SMALL)
            to_resume = sp.sandboxes.create(limits=c.SMALL)
            to_resume.pause()
            to_delete = sp.sandboxes.create(limits=c.SMALL)
            to_stop = sp.sandboxes.create(limits=c.SMALL)
            threads = [
                in_thread(lambda: http.post("/v1/sandboxes", json=body)),
                in_thread(lambda: http.post("/v1/sandboxes", json={**body, "wait": False})),
                in_thread(lambda s=to_pause.id: http.post(f"/v1/sandboxes/{s}/pause")),
                in_thread(lambda s=to_resume.id: http.post(f"/v1/sandboxes/{s}/resume")),
                in_thread(lambda s=to_delete.id: http.delete(f"/v1/sandboxes/{s}")),
                in_thread(
                    lambda s=to_stop.id: http.post(f"/v1/sandboxes/{s}/stop", params={"wait": "false"})
                ),
            ]
            time.sleep(delay_ms / 1000)  # when the kill hits: the point of the test, not an assertion
            owner = cluster.cp.owner
            cluster.cp.kill()
            for thread in threads:
                thread.join(30)
            stranded = stranded_leases(cluster, owner)
            in_flight = [
                f"{sb.id}:{sb.state}" for sb in cluster.records().values() if sb.state != sb.desired_state
            ]
            report.append(f"kill at {delay_ms} ms: {len(in_flight)} unsettled, leases left: {stranded}")
            cluster.cp.start_and_wait()

    restarted = time.monotonic()
    took = cluster.wait_converged(LEASE_S + SETTLE_MARGIN_S)
    print(f"\nconverged {took:.1f}s after the last restart (LEASE_S={LEASE_S}); " + "; ".join(report))
    one_guest_each(cluster)
    records = cluster.records()
    assert len(records) >= 3 * len(DELAYS_MS), "the sandboxes made before each kill are all there"
    # Converged means settled for good: a later look finds the same.
    assert time.monotonic() - restarted < LEASE_S + SETTLE_MARGIN_S + 5
    assert cluster.converged() is None
