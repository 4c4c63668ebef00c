"""Load on the real installation (`real_cluster`: root helper, runsc node agent, control plane, SQLite):
several SDK clients create, use and delete sandboxes at once, with 0 errors; once they stop and every
sandbox is deleted, nothing the installation holds keeps growing (bench/load_bench.py does the work).

Phase A warms the installation up (connection pools, import caches, the allocator's high-water mark);
phase B repeats the same work; a leak grows again in phase B, a high-water mark does not. So the bounds
compare the state after B with the state after A:
- open fds of the control plane, node agent and root helper: at most FD_SLACK (2 x clients + 1) more (phase B
  makes at least MIN_CYCLES_B > FD_SLACK sandboxes, so one leaked fd per sandbox breaks it);
- RSS: at most RSS_SLACK_MIB more per component (measured noise on this machine: under 1 MiB per phase;
  a leak of 1 MiB per sandbox breaks it);
- processes under the data directory: back to the count before the load (no holder, runsc or gofer left);
- database: no live sandbox, at most ROWS_PER_CYCLE rows per sandbox made (its tombstone and events), and
  no table grows while the installation is quiet.

`make soak` (SPACE_SOAK=1): phases of SOAK_PHASE_S seconds each with SOAK_CLIENTS clients.
"""

from __future__ import annotations

import os
import time

import pytest
from bench import load_bench as lb

from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

SOAK = os.environ.get("SPACE_SOAK") == "1"
CLIENTS = 3
CYCLES_A, CYCLES_B = 1, 3  # per client
SOAK_CLIENTS, SOAK_PHASE_S = 6, 150.0
# The control plane keeps TWO pools to the node (control and data calls) and each may hold one more
# connection per concurrent client after B than after A (httpx drops expired connections only when the
# pool is next used). Phase B makes more sandboxes than that, so one leaked fd per sandbox still breaks it.
FD_SLACK = 2 * (SOAK_CLIENTS if SOAK else CLIENTS) + 1
MIN_CYCLES_B = FD_SLACK + 1
RSS_SLACK_MIB = 6
ROWS_PER_CYCLE = 12
QUIET_S = 2.0


def _phase(cluster: c.RealCluster, baseline: int) -> tuple[lb.LoadResult, dict[str, object]]:
    local = cluster.local
    if SOAK:
        result = lb.run_load(local.url, local.api_key, clients=SOAK_CLIENTS, seconds=SOAK_PHASE_S)
    else:
        result = lb.run_load(local.url, local.api_key, clients=CLIENTS, cycles=CYCLES_A)
    lb.settle(local.url, local.api_key, local.data_dir, baseline_processes=baseline, timeout=120)
    time.sleep(1.0)  # closed connections' fds go
    return result, lb.measure(lb.component_pids(local), local.data_dir)


def test_clients_create_use_delete_with_no_error_and_no_growth_after(real_cluster: c.RealCluster) -> None:
    local = real_cluster.local
    baseline = len(lb.processes_under(local.data_dir))
    pids = lb.component_pids(local)
    assert {"controlplane", "agent", "helper"} <= set(pids), pids

    result_a, after_a = _phase(real_cluster, baseline)
    if SOAK:
        result_b, after_b = _phase(real_cluster, baseline)
    else:
        result_b = lb.run_load(local.url, local.api_key, clients=CLIENTS, cycles=CYCLES_B)
        lb.settle(local.url, local.api_key, local.data_dir, baseline_processes=baseline, timeout=120)
        time.sleep(1.0)
        after_b = lb.measure(lb.component_pids(local), local.data_dir)
    report = {"a": result_a.summary(), "b": result_b.summary(), "after_a": after_a, "after_b": after_b}
    print(f"load: {report}")  # the numbers, with `pytest -s`

    assert result_a.errors == [] and result_b.errors == [], report
    assert result_b.cycles >= MIN_CYCLES_B, report
    assert lb.component_pids(local) == pids, "a component restarted during the load"
    comps_a, comps_b = after_a["components"], after_b["components"]
    assert isinstance(comps_a, dict) and isinstance(comps_b, dict)
    for name in pids:
        assert comps_b[name]["fds"] <= comps_a[name]["fds"] + FD_SLACK, (name, report)
        grown_mib = (comps_b[name]["rss_kib"] - comps_a[name]["rss_kib"]) / 1024
        assert grown_mib <= RSS_SLACK_MIB, (name, grown_mib, report)
    assert after_b["processes"] == baseline, report

    db_a, db_b = after_a["database"], after_b["database"]
    assert isinstance(db_a, dict) and isinstance(db_b, dict)
    assert db_b["live_sandboxes"] == 0, report
    grown_rows = sum(db_b["rows"].values()) - sum(db_a["rows"].values())
    assert grown_rows <= ROWS_PER_CYCLE * result_b.cycles, (grown_rows, report)
    time.sleep(QUIET_S)
    quiet = lb.database_state(local.data_dir)
    assert quiet["rows"] == db_b["rows"], (
        f"tables grow while nothing happens: {db_b['rows']} -> {quiet['rows']}"
    )
