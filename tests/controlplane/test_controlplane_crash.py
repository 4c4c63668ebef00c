"""Crash convergence for real: the control plane is a subprocess, SIGKILLed while creates, pauses, resumes
and deletes are in flight, then started again on the same database. Whatever moment the kill hit, the
database and the node must converge: every record settles in its desired state (nothing stuck in an -ing
state), the node runs exactly one sandbox per live record, in the recorded state, and nothing else.

A killed control plane leaves the leases of the rows it was working on; the restarted one (a new process,
so a new lease owner) waits for them to expire (reconciler LEASE_S). The measured convergence time is
printed (`-s`) and bounded by LEASE_S plus a margin. To pay that wait once, one module-scoped scenario does
all the kills and the tests check its outcome.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from space.controlplane.reconciler.loop import LEASE_S
from space.core.lifecycle import State
from tests.support import cluster as c

DELAYS_MS = (0, 20, 50, 100, 200)
SETTLE_MARGIN_S = 20.0
RETRY_MARGIN_S = 10.0  # the retried sandbox was stranded once (one lease); then it is quick


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


@dataclass
class Scenario:
    report: list[str] = field(default_factory=list)
    converged_after: float | None = None
    not_converged: str | None = None
    retry: tuple[int, dict[str, Any]] | None = None
    retry_error: str | None = None
    retry_took: float | None = None


IDEM_BODY = {"template": "python", "limits": c.SMALL, "env": {"ROUND": "idempotent"}}
IDEM_HEADERS = {"Idempotency-Key": "create-across-a-crash"}


def kill_and_restart(
    cluster: c.Cluster, threads: list[threading.Thread], report: list[str], what: str
) -> None:
    owner = cluster.cp.owner
    cluster.cp.kill()
    for thread in threads:
        thread.join(30)
    stranded = stranded_leases(cluster, owner)
    unsettled = [f"{sb.id}:{sb.state}" for sb in cluster.records().values() if sb.state != sb.desired_state]
    report.append(f"{what}: {len(unsettled)} unsettled, {len(stranded)} leases of the dead process")
    cluster.cp.start_and_wait()


@pytest.fixture(scope="module")
def scenario(cluster: c.Cluster) -> Scenario:
    """Kill the control plane (1) once a create with an Idempotency-Key has recorded its sandbox, then retry
    that create with the same key, as a client (the SDK) does after a transport error; (2) at several
    delays after firing a create (wait and no-wait), a pause, a resume, a stop and a delete. Then wait for
    convergence."""
    result = Scenario()
    http = cluster.http(cluster.admin_key, timeout=30)
    body = {"template": "python", "limits": c.SMALL}

    # (1) The create's idempotency record is "in progress" when its process dies.
    before = set(cluster.records())
    thread = in_thread(lambda: http.post("/v1/sandboxes", json=IDEM_BODY, headers=IDEM_HEADERS))
    c.wait_for(lambda: set(cluster.records()) - before, timeout=20, interval=0.005, what="the new record")
    kill_and_restart(cluster, [thread], result.report, "kill after an idempotent create recorded its sandbox")

    def retry() -> None:
        """Like the SDK: the same key again after a transport error (the kills below cause some too)."""
        started = time.monotonic()
        deadline = started + LEASE_S + RETRY_MARGIN_S
        while result.retry is None and result.retry_error is None:
            try:
                answer = http.post(
                    "/v1/sandboxes", json=IDEM_BODY, headers=IDEM_HEADERS, timeout=deadline - time.monotonic()
                )
                result.retry = (answer.status_code, answer.json())
            except httpx.TimeoutException as exc:
                result.retry_error = f"{type(exc).__name__}: {exc}"
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    result.retry_error = "the control plane stayed unreachable"
                time.sleep(0.2)
        result.retry_took = time.monotonic() - started

    retrying = threading.Thread(target=retry, daemon=True)
    retrying.start()  # meanwhile, more crashes:

    # (2) Kills at several moments of several requests in flight.
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
            kill_and_restart(cluster, threads, result.report, f"kill {delay_ms} ms into 6 requests")

    try:
        result.converged_after = cluster.wait_converged(LEASE_S + SETTLE_MARGIN_S)
    except AssertionError as exc:
        result.not_converged = str(exc)
    retrying.join(LEASE_S + RETRY_MARGIN_S + 10)
    print("\n" + "\n".join(result.report) + f"\nconverged after the last restart: {result.converged_after}s")
    return result


def test_sigkill_while_lifecycle_requests_are_in_flight_converges(
    cluster: c.Cluster, scenario: Scenario
) -> None:
    assert scenario.not_converged is None, scenario.not_converged
    assert scenario.converged_after is not None and scenario.converged_after < LEASE_S + SETTLE_MARGIN_S
    one_guest_each(cluster)
    assert len(cluster.records()) >= 3 * len(DELAYS_MS), "the sandboxes made before each kill are all there"
    # Settled for good: a second look finds the same.
    assert cluster.converged() is None


def test_a_retry_with_the_same_idempotency_key_after_a_crash_is_answered(
    cluster: c.Cluster, scenario: Scenario
) -> None:
    """The key's first request never finished, and there is nobody left to finish it: the restarted control
    plane must answer the retry (once the sandbox has settled, so within LEASE_S and a margin) rather than
    make it wait for the dead request, and must not create a second sandbox."""
    assert scenario.retry_error is None, (
        f"the retry got no answer in {scenario.retry_took:.0f}s ({scenario.retry_error}): the dead request's "
        "idempotency record blocks it (api/app.py _idempotent waits WAIT_TIMEOUT_S=120 s for it, then 409; "
        "store.begin_idempotent takes a stale record over only after stale_after_s=300 s)"
    )
    assert scenario.retry is not None
    status, body = scenario.retry
    assert status == 201, body
    made = [sb.id for sb in cluster.records().values() if sb.env.get("ROUND") == "idempotent"]
    assert made == [body["id"]], "exactly one sandbox for one request"
