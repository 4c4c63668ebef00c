"""Crash injection everywhere (issue 11): a real one-node cluster (root helper, node agent, control plane;
real runsc, btrfs, network namespaces, a local object store) drives one sandbox through every operation
while its processes SIGKILL themselves at kill points; each is restarted, the cluster converges, and the
invariant checker sweeps the database, the node and the object store after every operation.

- `make test`: the kill points of SUBSET, a fixed choice that covers every component (control plane, node
  agent, root helper, object store) and every operation; each of them must fire.
- `make soak` (SPACE_SOAK=1): EVERY exported point armed, fire-once; a point the scenario never reaches
  fails the test unless `unreached_reason` says why.
The kill points come from space.controlplane.failpoints.all_points() (derived from the lifecycle table,
the node routes, the helper's verb table and the artifact parts), so a new step is covered automatically.
"""

from __future__ import annotations

import os

import pytest

from space.controlplane.failpoints import all_points
from tests.support.crash_scenario import Outcome, run_scenario
from tests.support.crashcluster import CrashCluster, start_crash_cluster

SOAK = bool(os.environ.get("SPACE_SOAK"))

#: (operation, kill point) of `make test`: each component and each operation at least once. (The helper's
#: sandbox.create/checkpoint/destroy points fire first in the agent's warm-start preparation, whose
#: interruption leaks a sandbox today: ADR 0038, finding 5; the soak arms them.)
SUBSET = (
    ("create", "cp.pending.create.after"),
    ("create", "agent.put_sandbox.after"),
    ("pause", "agent.pause_sandbox.after"),
    ("resume", "cp.resuming.resumed.before"),
    ("stop", "helper.sandbox.stop.before"),
    ("start", "agent.start_sandbox.before"),
    ("checkpoint", "agent.create_snapshot.before"),
    ("fork", "agent.fork.after"),
    ("rollback", "agent.rollback.before"),
    ("suspend", "objectstore.part_written"),
    ("suspend", "suspend.uploaded"),
    ("restore", "objectstore.part_read"),
    ("restore", "cp.suspended.restore.after"),
    ("delete", "cp.deleting.deleted.before"),
    # The agent dies as the background teardown reaches it (ADR 0073: DELETE has answered already).
    ("delete", "agent.delete_sandbox.before"),
    ("suspend", "helper.snapshot.export.after"),
)

#: Events the scenario's operations never cause: each is reached by another harness or test.
ELSEWHERE = {
    "fail": "a step that fails for good (storage faults, tests/controlplane reconciler tests)",
    "crash": "a runtime that dies by itself (recovery tests in tests/controlplane and tests/e2e)",
    "recover": "recovery of a crashed or failed sandbox (tests/controlplane/test_controlplane_suspend.py)",
    "recovered": "recovery of a crashed or failed sandbox (tests/controlplane/test_controlplane_suspend.py)",
}
#: Node routes and helper verbs that are no step of a lifecycle operation.
NOT_A_STEP = {
    "agent": "data plane or diagnostics, no lifecycle step",
    "helper": "a verb no lifecycle operation of the scenario uses",
}


#: Transitions the control plane's code never commits today (findings of ADR 0038, routed to their owners).
NEVER_COMMITTED = {
    ("running", "checkpoint"): "a user checkpoint is a node call without the checkpointing state "
    "(controlplane/api/snapshots.take_snapshot)",
    ("checkpointing", "checkpointed"): "nothing enters checkpointing (see running.checkpoint)",
}


def unreached_reason(point: str) -> str | None:
    """Why the scenario may not reach `point` (None: it must)."""
    parts = point.split(".")
    if parts[0] == "cp" and len(parts) == 4:
        _cp, state, event, _phase = parts
        if event in ELSEWHERE:
            return ELSEWHERE[event]
        if (state, event) in NEVER_COMMITTED:
            return NEVER_COMMITTED[(state, event)]
        if state in ("failed", "crashed"):
            return "leaving a failed or crashed state (recovery tests)"
        if event == "delete" and state not in ("running", "stopped", "paused"):
            return "delete while a step is in flight (tests/model, the lifecycle model)"
        return None
    if parts[0] in NOT_A_STEP:
        return NOT_A_STEP[parts[0]]
    return None


def report(cluster: CrashCluster, outcome: Outcome, points: list[str]) -> None:
    fired = cluster.fired()
    total = sum(len(v) for v in fired.values())
    print(
        f"\ncrash injection: {len(points)} kill points exported, {total} fired, {len(cluster.deaths)} deaths"
    )
    for step in outcome.steps:
        print(f"  {step.operation:<12} {step.seconds:6.1f}s  died at {step.fired}")
    for death in cluster.deaths:
        print(f"  restart {death.component:<12} after {death.point}: {death.restart_s:.1f}s")


@pytest.mark.root
@pytest.mark.timeout(7200 if SOAK else 900)
def test_every_kill_point_of_the_scenario_converges() -> None:
    exported = all_points()
    points = sorted(p for component in exported.values() for p in component)
    assert len(points) == len(set(points)), "a kill point is exported twice"
    chosen = [point for _operation, point in SUBSET]
    assert set(chosen) <= set(points), f"SUBSET names points no table exports: {set(chosen) - set(points)}"
    with start_crash_cluster("*" if SOAK else ",".join(chosen)) as cluster:
        outcome = run_scenario(cluster)
        report(cluster, outcome, points)
        fired = {p for names in cluster.fired().values() for p in names}
        assert outcome.problems() == [], "invariants violated:\n" + "\n".join(outcome.problems())
        assert cluster.unexplained() == [], f"deaths no kill point explains: {cluster.unexplained()}"
        if SOAK:
            unreached = [p for p in points if p not in fired and unreached_reason(p) is None]
            assert unreached == [], f"exported kill points the scenario never reached: {unreached}"
        else:
            assert set(chosen) <= fired, f"kill points of SUBSET that never fired: {set(chosen) - fired}"
