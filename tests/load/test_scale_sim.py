"""The scale simulator itself (bench/scale_sim.py over tests/support/fake_fleet.py), small: two real
control planes on PostgreSQL and a dozen simulated nodes; every node enrols and heartbeats, every create
reaches a simulated node and every sandbox runs, then is deleted, and each number the simulator reports
is measured, not assumed (the database counters see the writes of the phase)."""

from __future__ import annotations

from bench import scale_sim

from tests.support import postgres
from tests.support.postgres import new_database

postgres_url = postgres.postgres_url

NODES = 8
SANDBOXES = 8
#: The idle window: longer than one heartbeat period of the simulated nodes (2 s), so each beats in it even
#: when a loaded machine delays their loop (a 1 s window saw none once).
IDLE_S = 2.5


def test_simulated_fleet_against_two_replicas_on_postgres(postgres_url: str) -> None:
    result = scale_sim.run_fleet(
        new_database(postgres_url), NODES, SANDBOXES, concurrency=6, idle_s=IDLE_S, timeout=120, singles=2
    )
    print(f"scale simulation: {scale_sim.summary_rows([result])}")  # the numbers, with `pytest -s`
    assert result["node_statuses"] == {"ready": NODES}, result
    created, deleted, idle = result["create"], result["delete"], result["idle"]
    assert created["sandboxes"] == SANDBOXES and created["errors"] == 0, created
    assert deleted["sandboxes"] == SANDBOXES and deleted["errors"] == 0, deleted
    # Every create reached a simulated node, after the API answered it.
    assert created["scheduling_latency"]["n"] == SANDBOXES, created
    assert 0 < created["scheduling_latency"]["p50_ms"] <= created["reconciler_lag"]["p99_ms"] + 1000, created
    assert created["nodes_used"] >= 1 and created["throughput_per_s"] > 0, created
    assert result["node_rpc_calls"]["PUT /sandboxes/{id}"] >= SANDBOXES, result["node_rpc_calls"]
    assert result["node_rpc_calls"]["DELETE /sandboxes/{id}"] >= SANDBOXES, result["node_rpc_calls"]
    # The counters saw the work: a create writes its row and its transitions; heartbeats write nodes.
    assert 2 <= created["write_xacts_per_op"] <= 60, created
    assert 1 <= deleted["write_xacts_per_op"] <= 60, deleted
    assert idle["heartbeat"]["n"] >= 1, idle
    alone = result["single"]
    assert alone["scheduling_latency"]["n"] == 2 and alone["reconciler_lag"]["n"] == 2, alone
