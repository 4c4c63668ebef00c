"""Scale in simulation (issue 11): hundreds of simulated node agents against two real control-plane replicas
on PostgreSQL; create throughput, reconciler lag, scheduling latency and database writes per sandbox
operation as the fleet grows. docs/scale.md plans 1,000 nodes and a million sandboxes from these numbers.

Run as root (PostgreSQL runs as `postgres`): `python -m bench.scale_sim [--fleets 10,50,200,500]
[--sandboxes 200]`. For each fleet size, on a fresh database: two control planes
(`python -m space.controlplane.server`, the real thing) and a FakeFleet (tests/support/fake_fleet.py:
every node enrols, heartbeats every 2 s and answers the node RPC in memory) start; then
- idle window: what the fleet costs with nothing to do (heartbeat write transactions/s, WAL bytes/s,
  heartbeat round trip, CPU of each control plane and of PostgreSQL);
- create: `--sandboxes` POST /v1/sandboxes (wait=false) spread over both replicas by `--concurrency`
  clients; until every one is running:
    create throughput   sandboxes running per second, first request to last running;
    scheduling latency  API answer -> the create reaching its node (the simulated node's clock);
    reconciler lag      API answer -> the record running (wish -> done);
- delete: the same for DELETE (wait=false) until every record is deleted;
- database writes per operation: write transactions (xid counter) and WAL bytes of the phase less the
  idle rate over the same time, divided by the number of sandboxes; rows inserted/updated/deleted per
  table (pg_stat_user_tables); with pg_stat_statements (the server this script starts preloads it) the
  statements each phase ran most often and longest.

The machine running this is also the machine under test (2 cores here): the simulator's own CPU is
reported next to the numbers so a saturated simulator is seen as one. Writes bench/results/scale-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import httpx
import sqlalchemy as sa
from tests.support.cluster import ControlPlane, bootstrap, wait_for
from tests.support.fake_fleet import FakeFleet
from tests.support.postgres import PG_BIN, PostgresServer, fresh_database, start_server, stop_server

from bench.stats import percentile, write_json

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- database counters --------------------------------------------------------------------------------------
@dataclass
class Counters:
    at: float
    xid: int
    wal: int
    tables: dict[str, tuple[int, int, int]]
    statements: dict[str, tuple[int, float]] | None


def counters(engine: sa.Engine) -> Counters:
    """Write transactions so far (the xid counter: only writing transactions take one; this read takes one
    too, subtracted by `writes_between`), WAL position, tuples per table, and statements if available."""
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT txid_current(), pg_current_wal_lsn() - '0/0'::pg_lsn")).one()
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        tables = {
            r[0]: (int(r[1]), int(r[2]), int(r[3]))
            for r in conn.execute(
                sa.text("SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables")
            )
        }
        statements = None
        with contextlib.suppress(sa.exc.DBAPIError), conn.begin_nested():
            statements = {
                str(r[0]): (int(r[1]), float(r[2]))
                for r in conn.execute(
                    sa.text(
                        "SELECT query, calls, total_exec_time FROM pg_stat_statements "
                        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    )
                )
            }
        conn.commit()
    return Counters(time.monotonic(), int(row[0]), int(row[1]), tables, statements)


def writes_between(a: Counters, b: Counters) -> dict[str, Any]:
    seconds = max(b.at - a.at, 1e-6)
    tables = {}
    for name, after in b.tables.items():
        before = a.tables.get(name, (0, 0, 0))
        delta = tuple(x - y for x, y in zip(after, before, strict=True))
        if any(delta):
            tables[name] = dict(zip(("ins", "upd", "del"), delta, strict=True))
    return {
        "seconds": round(seconds, 2),
        "write_xacts": b.xid - a.xid - 1,
        "wal_bytes": b.wal - a.wal,
        "tables": tables,
        "statements": _statements_between(a, b),
    }


def _statements_between(a: Counters, b: Counters, top: int = 8) -> list[dict[str, Any]] | None:
    if a.statements is None or b.statements is None:
        return None
    rows = []
    for query, (calls, ms) in b.statements.items():
        before = a.statements.get(query, (0, 0.0))
        if calls - before[0] > 0:
            rows.append({"calls": calls - before[0], "ms": round(ms - before[1], 1), "query": _short(query)})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def _short(query: str) -> str:
    text = " ".join(query.split())
    return text[:160]


# -- CPU of the processes involved ---------------------------------------------------------------------------
def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def postgres_pids(server: PostgresServer) -> list[int]:
    """The postmaster and its children (backends, walwriter, checkpointer...)."""
    master = server.pid()
    if master is None:
        return []
    pids = [master]
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (proc / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == master:
                    pids.append(int(proc.name))
    return pids


@dataclass
class CpuWatch:
    """CPU use (fraction of one core) of named process groups over a window."""

    groups: dict[str, list[int]]
    started: float = 0.0
    before: dict[str, float] | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        self.before = {name: cpu_seconds(pids) for name, pids in self.groups.items()}

    def stop(self) -> dict[str, float]:
        assert self.before is not None
        seconds = max(time.monotonic() - self.started, 1e-6)
        return {
            name: round((cpu_seconds(pids) - self.before[name]) / seconds, 2)
            for name, pids in self.groups.items()
        }


# -- the phases ---------------------------------------------------------------------------------------------
def _ms_stats(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    return {"p50_ms": round(percentile(samples, 50), 1), "p99_ms": round(percentile(samples, 99), 1),
            "max_ms": round(max(samples), 1), "n": len(samples)}  # fmt: skip


async def _requests(
    urls: list[str], key: str, method: str, targets: list[str | None], concurrency: int
) -> tuple[dict[str, float], list[float], list[str]]:
    """Send one request per target (None: a create; else the sandbox id to delete), spread over the
    replicas; (sandbox id -> wall time of the answer, round trips in ms, errors)."""
    answered: dict[str, float] = {}
    round_trips: list[float] = []
    failures: list[str] = []
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
    for item in enumerate(targets):
        queue.put_nowait(item)
    clients = [
        httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=60.0) for u in urls
    ]

    async def worker() -> None:
        while not queue.empty():
            index, target = queue.get_nowait()
            http = clients[index % len(clients)]
            started = time.perf_counter()
            try:
                if target is None:
                    answer = await http.post("/v1/sandboxes", json={"template": "python", "wait": False})
                else:
                    answer = await http.delete(f"/v1/sandboxes/{target}", params={"wait": "false"})
                answer.raise_for_status()
                round_trips.append((time.perf_counter() - started) * 1000)
                answered[target or answer.json()["id"]] = time.time()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                failures.append(f"{method} {target}: {exc!r}"[:300])

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    return answered, round_trips, failures


def _states(engine: sa.Engine, project_id: str) -> dict[str, tuple[str, float]]:
    """sandbox id -> (state, updated_at as Unix seconds) for a project."""
    query = sa.text("SELECT id, state, updated_at FROM sandboxes WHERE project_id = :p")
    with engine.connect() as conn:
        return {r[0]: (r[1], _unix(r[2])) for r in conn.execute(query, {"p": project_id})}


def _unix(value: Any) -> float:
    if hasattr(value, "timestamp"):
        return float(value.timestamp()) if value.tzinfo else float(value.replace(tzinfo=UTC).timestamp())
    return float(value)


def _wait_all(
    engine: sa.Engine, project_id: str, ids: set[str], state: str, timeout: float
) -> dict[str, float]:
    """Poll until every id is in `state`; id -> the record's updated_at when it got there."""
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        for sid, (now_state, updated) in _states(engine, project_id).items():
            if sid in ids and now_state == state and sid not in done:
                done[sid] = updated
        if len(done) == len(ids):
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids) - len(done)} of {len(ids)} sandboxes not {state} after {timeout}s")
        time.sleep(0.1)


@dataclass
class Setup:
    engine: sa.Engine
    project_id: str
    admin_key: str
    control_planes: list[ControlPlane]
    fleet: FakeFleet
    cpu: dict[str, list[int]]


@contextlib.contextmanager
def installation(
    database_url: str, nodes: int, root: pathlib.Path, server: PostgresServer | None, heartbeat_s: float = 2.0
) -> Iterator[Setup]:
    """Two control planes on `database_url` and a fleet of `nodes` simulated nodes, all registered."""
    store, _org, project_id, admin_key = bootstrap(database_url)
    store.close()
    token_file = root / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    cps = []
    for i in range(2):
        (root / f"cp{i}").mkdir(parents=True, exist_ok=True)
        cps.append(ControlPlane(root / f"cp{i}", token_file, database_url=database_url, name=f"cp{i}"))
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    fleet = FakeFleet([cp.url for cp in cps], token_file.read_text().strip(), nodes, heartbeat_s=heartbeat_s)
    try:
        for cp in cps:
            cp.start()
        for cp in cps:
            wait_for(cp.healthy, timeout=60, interval=0.1, what=f"{cp.name} healthy")
        fleet.start()

        # Every node registered and ready; a fleet the control planes cannot keep ready (heartbeats slower
        # than the lost-node timeout) is measured as it is, with its node statuses in the report.
        deadline = time.monotonic() + 60 + nodes * 0.2
        while _statuses(engine).get("ready", 0) < nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        if fleet.registered() == 0:
            raise RuntimeError(f"no simulated node could register: {_statuses(engine)}")
        cpu = {f"cp{i}": [cp.pid] for i, cp in enumerate(cps) if cp.pid is not None}
        cpu["simulator"] = [os.getpid()]
        if server is not None:
            cpu["postgres"] = postgres_pids(server)
        yield Setup(engine, project_id, admin_key, cps, fleet, cpu)
    finally:
        fleet.close()
        for cp in cps:
            cp.stop(timeout=10)
        engine.dispose()


def _statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM nodes GROUP BY status")).all()
    return {str(status): int(count) for status, count in rows}


def measure_idle(setup: Setup, seconds: float) -> dict[str, Any]:
    watch = CpuWatch(setup.cpu)
    beats_before = len(setup.fleet.beat_ms)
    first = counters(setup.engine)
    watch.start()
    time.sleep(seconds)
    cpu = watch.stop()
    last = counters(setup.engine)
    writes = writes_between(first, last)
    per_s = writes["seconds"]
    beats = len(setup.fleet.beat_ms) - beats_before
    server_cores = _server_cores(cpu)
    return {
        "cpu_cores": cpu,
        # CPU of the control planes and PostgreSQL per heartbeat: what the fleet costs, whatever the load.
        "cpu_ms_per_heartbeat": round(server_cores * per_s * 1000 / max(beats, 1), 2),
        "write_xacts_per_s": round(writes["write_xacts"] / per_s, 1),
        "wal_bytes_per_s": round(writes["wal_bytes"] / per_s),
        "heartbeat": _ms_stats(setup.fleet.beat_ms[beats_before:]),
        "writes": writes,
    }


def _server_cores(cpu: dict[str, float]) -> float:
    return sum(v for k, v in cpu.items() if k != "simulator")


def measure_phase(setup: Setup, kind: str, targets: list[str | None], *, concurrency: int,
                  idle: dict[str, Any], timeout: float) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """Creates (targets all None) or deletes (sandbox ids); the numbers of the phase and the ids."""
    urls = [cp.url for cp in setup.control_planes]
    watch = CpuWatch(setup.cpu)
    first = counters(setup.engine)
    watch.start()
    started = time.time()
    answered, round_trips, failures = asyncio.run(
        _requests(urls, setup.admin_key, "POST" if kind == "create" else "DELETE", targets, concurrency)
    )
    target_state = "running" if kind == "create" else "deleted"
    done = _wait_all(setup.engine, setup.project_id, set(answered), target_state, timeout)
    finished = time.time()
    cpu = watch.stop()
    last = counters(setup.engine)
    writes = writes_between(first, last)
    n = max(len(answered), 1)
    background_xacts = idle["write_xacts_per_s"] * writes["seconds"]
    background_wal = idle["wal_bytes_per_s"] * writes["seconds"]
    result: dict[str, Any] = {
        "sandboxes": len(answered),
        "errors": len(failures),
        "first_errors": failures[:3],
        "throughput_per_s": round(len(done) / max(max(done.values(), default=finished) - started, 1e-6), 1),
        "api_round_trip": _ms_stats(round_trips),
        "reconciler_lag": _ms_stats([(done[s] - answered[s]) * 1000 for s in done]),
        "cpu_cores": cpu,
        "cpu_ms_per_op": round(
            (_server_cores(cpu) - _server_cores(idle["cpu_cores"])) * writes["seconds"] * 1000 / n, 1
        ),
        "write_xacts_per_op": round((writes["write_xacts"] - background_xacts) / n, 1),
        "wal_bytes_per_op": round((writes["wal_bytes"] - background_wal) / n),
        "writes": writes,
    }
    if kind == "create":
        at_node = setup.fleet.created_at_node()
        result["scheduling_latency"] = _ms_stats(
            [(at_node[s] - answered[s]) * 1000 for s in done if s in at_node]
        )
        per_node = {}
        for node in setup.fleet.nodes:
            per_node[node.index] = len(node.sandboxes)
        result["nodes_used"] = sum(1 for v in per_node.values() if v)
    return result, list(answered)


def measure_single(setup: Setup, count: int) -> dict[str, Any]:
    """`count` creates one after the other, each waited for: the latencies without a queue in front."""
    scheduling, lag = [], []
    url = setup.control_planes[0].url
    headers = {"Authorization": f"Bearer {setup.admin_key}"}
    ids = []
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as http:
        for _ in range(count):
            answer = http.post("/v1/sandboxes", json={"template": "python", "wait": False})
            answer.raise_for_status()
            answered, sandbox_id = time.time(), answer.json()["id"]
            done = _wait_all(setup.engine, setup.project_id, {sandbox_id}, "running", 60)
            lag.append((done[sandbox_id] - answered) * 1000)
            reached = setup.fleet.created_at_node().get(sandbox_id)
            if reached is not None:
                scheduling.append((reached - answered) * 1000)
            ids.append(sandbox_id)
        for sandbox_id in ids:
            http.delete(f"/v1/sandboxes/{sandbox_id}", params={"wait": "false"}).raise_for_status()
    _wait_all(setup.engine, setup.project_id, set(ids), "deleted", 60)
    return {"scheduling_latency": _ms_stats(scheduling), "reconciler_lag": _ms_stats(lag)}


def run_fleet(database_url: str, nodes: int, sandboxes: int, *, concurrency: int, idle_s: float,
              server: PostgresServer | None = None, timeout: float = 300.0,
              singles: int = 10) -> dict[str, Any]:  # fmt: skip
    """One fleet size on the (fresh) database at `database_url`: idle, create, delete."""
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="space-scale-") as tmp, \
            installation(database_url, nodes, pathlib.Path(tmp), server) as setup:  # fmt: skip
        registered_at = time.monotonic()
        start_statuses = _statuses(setup.engine)
        idle = measure_idle(setup, idle_s)
        single = measure_single(setup, singles)
        timings = {
            "start_s": round(registered_at - begun, 1),
            "single_s": round(time.monotonic() - registered_at - idle_s, 1),
        }
        phase = {"concurrency": concurrency, "idle": idle, "timeout": timeout}
        created, ids = measure_phase(setup, "create", [None] * sandboxes, **phase)
        deleted, _ = measure_phase(setup, "delete", list(ids), **phase)
        statuses = _statuses(setup.engine)
        return {
            "nodes": nodes,
            "node_statuses": statuses,
            "node_statuses_at_start": start_statuses,
            "heartbeat_failures": sum(n.beat_failures for n in setup.fleet.nodes),
            "re_registrations": sum(n.registrations - 1 for n in setup.fleet.nodes if n.registrations),
            "node_rpc_calls": dict(setup.fleet.rpc_calls),
            "idle": idle,
            "single": single,
            "create": created,
            "delete": deleted,
            "seconds": round(time.monotonic() - registered_at, 1),
            "timings": timings,
        }


def heartbeat_cost(database_url: str, server: PostgresServer | None, *, nodes: int = 20,
                   heartbeat_s: float = 0.2,
                   seconds: float = 20.0, priority: int = 0) -> dict[str, Any]:  # fmt: skip
    """CPU per heartbeat: a small fleet beating fast (nodes / heartbeat_s offered per second), so the
    heartbeats dominate what the control planes and PostgreSQL do; CPU of the window / beats answered.
    Holds on a busy machine too: a starved control plane answers fewer beats, not cheaper ones."""
    with tempfile.TemporaryDirectory(prefix="space-scale-") as tmp, \
            installation(database_url, nodes, pathlib.Path(tmp), server, heartbeat_s) as setup:  # fmt: skip
        if priority:
            # On a machine shared with other work, a starved control plane answers fewer beats at the same
            # CPU, which hides the cost of one; a higher priority for the processes measured shows it.
            for pid in [pid for pids in setup.cpu.values() for pid in pids]:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, priority)
        time.sleep(2.0)
        idle = measure_idle(setup, seconds)
        beats = idle["heartbeat"].get("n", 0)
        cpu = idle["cpu_cores"]
        per_beat = {name: round(cores * seconds * 1000 / max(beats, 1), 2) for name, cores in cpu.items()}
        return {"nodes": nodes, "offered_per_s": round(nodes / heartbeat_s, 1), "answered_per_s":
                round(beats / seconds, 1), "cpu_ms_per_beat": per_beat, "heartbeat": idle["heartbeat"],
                "write_xacts_per_beat": round(idle["writes"]["write_xacts"] / max(beats, 1), 2),
                "wal_bytes_per_beat": round(idle["writes"]["wal_bytes"] / max(beats, 1))}  # fmt: skip


@contextlib.contextmanager
def postgres_with_statements() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server (tests/support/postgres.py) that preloads pg_stat_statements."""
    server = start_server()
    try:
        admin = sa.create_engine(server.url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"))
        admin.dispose()
        _restart(server)
        yield server
    finally:
        stop_server(server)


def _restart(server: PostgresServer) -> None:
    """pg_ctl restart keeps the options of the first start (postmaster.opts) and reads ALTER SYSTEM's."""
    server._run(str(PG_BIN / "pg_ctl"), "-D", str(server.data_dir), "-l", str(server.root / "server.log"),
                "-m", "fast", "-w", "-t", "60", "restart")  # fmt: skip


def fresh_with_statements(server: PostgresServer, name: str) -> str:
    url = fresh_database(server.url(), name)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn, contextlib.suppress(sa.exc.DBAPIError):
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
    engine.dispose()
    return url


def summary_rows(results: list[dict[str, Any]]) -> list[str]:
    """One line per fleet: idle cost, one create alone, a burst of creates, writes per operation."""
    lines = [
        f"{'nodes':>5} | {'hb tx/s':>7} {'hb p50/p99 ms':>14} {'cpu cp0+cp1/pg':>15} | "
        f"{'alone: sched/lag ms':>19} | {'burst/s':>7} {'lag p50/p99 ms':>15} | {'cpu ms/hb':>9} "
        f"{'cpu ms/create':>13} | {'tx/create':>9} "
        f"{'tx/delete':>9} {'WAL B/create':>12} | statuses"
    ]
    for r in results:
        idle, cr, de, one = r["idle"], r["create"], r["delete"], r.get("single", {})
        cpu = idle["cpu_cores"]
        hb, lag = idle["heartbeat"], cr["reconciler_lag"]
        sched_1, lag_1 = one.get("scheduling_latency", {}), one.get("reconciler_lag", {})
        alone = f"{sched_1.get('p50_ms', 0)}/{lag_1.get('p50_ms', 0)}"
        lines.append(
            f"{r['nodes']:>5} | {idle['write_xacts_per_s']:>7} "
            f"{hb.get('p50_ms', 0):>6}/{hb.get('p99_ms', 0):<7} "
            f"{cpu.get('cp0', 0) + cpu.get('cp1', 0):>7.2f}/{cpu.get('postgres', 0):<7} | {alone:>19} | "
            f"{cr['throughput_per_s']:>7} {lag.get('p50_ms', 0):>7}/{lag.get('p99_ms', 0):<7} | "
            f"{idle.get('cpu_ms_per_heartbeat', 0):>9} {cr.get('cpu_ms_per_op', 0):>13} | "
            f"{cr['write_xacts_per_op']:>9} {de['write_xacts_per_op']:>9} {cr['wal_bytes_per_op']:>12} | "
            f"{r['node_statuses']}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fleets", default="10,50,200,500", help="fleet sizes, comma-separated")
    parser.add_argument("--sandboxes", type=int, default=200, help="sandboxes created and deleted per fleet")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    parser.add_argument("--beat-cost", action="store_true", help="only measure the CPU of one heartbeat")
    parser.add_argument("--priority", type=int, default=0, help="nice value of the measured processes")
    args = parser.parse_args(argv)
    if args.beat_cost:
        with postgres_with_statements() as server:
            cost = heartbeat_cost(
                fresh_with_statements(server, "scale_beats"), server, priority=args.priority
            )
        write_json(cost, "scale-beats")
        print(json.dumps(cost, indent=2))
        return 0
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with postgres_with_statements() as server:
        for nodes in [int(n) for n in args.fleets.split(",")]:
            url = fresh_with_statements(server, f"scale_{nodes}")
            print(f"fleet of {nodes} nodes ...", flush=True)
            try:
                result = run_fleet(
                    url, nodes, args.sandboxes, concurrency=args.concurrency, idle_s=args.idle, server=server
                )
            except (TimeoutError, RuntimeError, AssertionError) as exc:
                print(f"fleet of {nodes} nodes failed: {exc!r}", flush=True)
                failed.append({"nodes": nodes, "error": repr(exc)[:2000]})
                continue
            results.append(result)
            write_json({"fleets": results, "failed": failed}, "scale-partial")
            print("\n".join(summary_rows(results)[-1:]), flush=True)
    report = {"machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}, "fleets": results,
              "failed": failed}  # fmt: skip
    path = write_json(report, "scale")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(summary_rows(results)))
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
