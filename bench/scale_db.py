"""The database at the planned scale (issue 11, docs/scale.md): 1,000 nodes and 1,000,000 sandboxes in a
real PostgreSQL, and the store calls the control plane makes all the time, timed with the real code.

Run as root: `python -m bench.scale_db [--nodes 1000] [--sandboxes 1000000]`. The rows are bulk-copied in
SQL from one node and one sandbox made by the real store (so every column holds what the code writes),
spread evenly over the nodes, all `running` (stable: nothing to do). Then, each call repeated and its
median reported:

  claim_work          the reconciler's poll (every 0.5 s per replica when idle): nothing needs work
  list_nodes_ready    the scheduler's and the jobs' node listing
  choose_node         the scheduler's choice for one new sandbox (disk admission reads every node's
                      placed sandboxes)
  sandboxes_on_node   one node's sandboxes (heartbeat stale-copy check, lost nodes, disk admission)
  heartbeat           one node's heartbeat write
  load_sandbox        one record by id (orphan collection does one per sandbox a node lists)
  list_idle_sandboxes the idle-pause job (every second per replica): running sandboxes with a timeout
  list_sandboxes_with_policy  the snapshot scheduler's listing (every second, leader only)

and the size of the tables and their indexes. Writes bench/results/scale-db-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from tests.support.cluster import bootstrap

from bench.scale_sim import fresh_with_statements, postgres_with_statements
from bench.stats import write_json
from space.controlplane.scheduler import choose_node
from space.controlplane.store.store import Store
from space.core.lifecycle import Event, State

#: Ids made in SQL that match the id pattern: 25 of md5's hex digits with 0, 1, 8, 9 mapped into the
#: base32 alphabet, then a final character from the allowed last set.
ID_BODY_SQL = "translate(substr(md5({seed}), 1, 25), '0189', 'wxyz') || 'a'"
CAPACITY = {"cpus": 64.0, "memory_mb": 1 << 20, "sandboxes": 1 << 14, "disk_mb": 4_000_000,
            "disk_free_mb": 4_000_000, "disk_reserve_mb": 10_000}  # fmt: skip


def _columns(engine: sa.Engine, table: str) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT column_name FROM information_schema.columns WHERE table_name = :t "
                "ORDER BY ordinal_position"
            ),
            {"t": table},
        )
        return [r[0] for r in rows]


def copy_rows(
    engine: sa.Engine, table: str, template_id: str, count: int, overrides: dict[str, str]
) -> float:
    """INSERT `count` copies of row `template_id` of `table`, with SQL expressions (over `i`, 1..count)
    for some columns; seconds it took."""
    columns = _columns(engine, table)
    select = ", ".join(overrides.get(c, f't."{c}"') for c in columns)
    quoted = ", ".join(f'"{c}"' for c in columns)
    started = time.monotonic()
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} ({quoted}) SELECT {select} FROM {table} t, "
                    "generate_series(1, :n) i WHERE t.id = :template"),
            {"n": count, "template": template_id},
        )  # fmt: skip
    return time.monotonic() - started


def populate(store: Store, engine: sa.Engine, project_id: str, nodes: int, sandboxes: int) -> dict[str, Any]:
    node = store.enrol_node("node-" + "a" * 25 + "a", "http://node.test/0", identity="x" * 32,
                            seal_rpc_token=lambda _id: b"sealed", capacity=CAPACITY,
                            templates=["python"])  # fmt: skip
    # An idle timeout, as agents' sandboxes usually have: the idle-pause job scans those.
    sb = store.create_sandbox(project_id, "python", idle_timeout_s=3600)
    sb = store.update_observed(sb.id, expected_generation=sb.generation, node_id=node.id)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATE)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATED)
    assert sb.state == State.RUNNING
    node_id_sql = "'node-' || " + ID_BODY_SQL.format(seed="'n' || i")
    nodes_s = copy_rows(engine, "nodes", node.id, nodes - 1, {
        "id": node_id_sql, "url": "t.url || '/' || i"})  # fmt: skip
    # Sandbox i lives on node (i mod nodes): the template node for 0, else the copy with seed i mod nodes.
    on_node = f"CASE WHEN i % {nodes} = 0 THEN t.node_id ELSE 'node-' || " + \
        ID_BODY_SQL.format(seed=f"'n' || (i % {nodes})") + " END"  # fmt: skip
    sandboxes_s = copy_rows(engine, "sandboxes", sb.id, sandboxes - 1, {
        "id": "'sb-' || " + ID_BODY_SQL.format(seed="'s' || i"), "node_id": on_node})  # fmt: skip
    with engine.connect() as conn:
        conn.execute(sa.text("ANALYZE"))
        conn.commit()
    return {"node_id": node.id, "sandbox_id": sb.id, "insert_nodes_s": round(nodes_s, 1),
            "insert_sandboxes_s": round(sandboxes_s, 1)}  # fmt: skip


STATEMENT_TOTALS = sa.text(
    "SELECT coalesce(sum(calls), 0), coalesce(sum(rows), 0), "
    "coalesce(sum(shared_blks_hit + shared_blks_read), 0), coalesce(sum(total_exec_time), 0) "
    "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND query NOT LIKE '%pg_stat_statements%'"
)


def timed(engine: sa.Engine, call: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Median and max wall time of `call`, and per call what PostgreSQL did for it (pg_stat_statements:
    statements, rows, buffer pages touched, execution time): the pages are what does not depend on how
    busy the machine is."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        conn.commit()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    with engine.connect() as conn:
        calls, rows, pages, pg_ms = conn.execute(STATEMENT_TOTALS).one()
    return {"median_ms": round(statistics.median(samples), 2), "max_ms": round(max(samples), 2), "n": repeat,
            "statements": round(float(calls) / repeat, 1), "rows": round(float(rows) / repeat),
            "pages": round(float(pages) / repeat), "pg_ms": round(float(pg_ms) / repeat, 2)}  # fmt: skip


def sizes(engine: sa.Engine) -> dict[str, Any]:
    found = {}
    with engine.connect() as conn:
        for table in ("sandboxes", "nodes"):
            row = conn.execute(
                sa.text(f"SELECT pg_relation_size('{table}'), pg_indexes_size('{table}'), "
                        f"(SELECT count(*) FROM {table})")
            ).one()  # fmt: skip
            found[table] = {"table_mb": round(row[0] / 2**20, 1), "indexes_mb": round(row[1] / 2**20, 1),
                            "rows": int(row[2])}  # fmt: skip
    return found


def measure(url: str, nodes: int, sandboxes: int, repeat: int) -> dict[str, Any]:
    store, _org, project_id, _key = bootstrap(url)
    engine = sa.create_engine(url)
    try:
        made = populate(store, engine, project_id, nodes, sandboxes)
        record = store.load_sandbox(made["sandbox_id"])
        assert record is not None
        fresh = store.create_sandbox(project_id, "python")  # a pending one for the scheduler to place
        calls: dict[str, Callable[[], Any]] = {
            "claim_work": lambda: store.claim_work("scale-db", 16, 8.0),
            "list_nodes_ready": lambda: store.list_nodes("ready"),
            "sandboxes_on_node": lambda: store.list_sandboxes_on_node(made["node_id"]),
            "heartbeat": lambda: store.heartbeat(made["node_id"], used={"cpus": 1.0, "memory_mb": 512}),
            "load_sandbox": lambda: store.load_sandbox(record.id),
            "list_idle_sandboxes": store.list_idle_sandboxes,
            "list_sandboxes_with_policy": store.list_sandboxes_with_policy,
        }
        results: dict[str, Any] = {name: timed(engine, call, repeat) for name, call in calls.items()}
        results["choose_node"] = timed(engine, lambda: choose_node(store, fresh), 1)
        return {"nodes": nodes, "sandboxes": sandboxes, "populate": made, "calls": results,
                "sizes": sizes(engine)}  # fmt: skip
    finally:
        engine.dispose()
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sandboxes", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    with postgres_with_statements() as server:
        url = fresh_with_statements(server, "scale_db")
        report = measure(url, args.nodes, args.sandboxes, args.repeat)
    report["machine"] = {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    path = write_json(report, "scale-db")
    print(json.dumps(report, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
