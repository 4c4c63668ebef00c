"""Several control-plane processes on one database never work on the same sandbox at the same time.

Each worker is a separate Python process with its own engine (as a separate replica would be). Workers
drive every sandbox pending -> creating -> running by claim_work / transition / release. If two workers
ever held one sandbox at once, one of their compare-and-swaps would lose (Conflict), or one
(sandbox, generation) step would be claimed twice; the test requires neither to happen, and every
sandbox to end up running with generation 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import sqlalchemy as sa

from space.controlplane.store import Store, make_engine, migrate, sqlite_url
from space.core.lifecycle import State
from tests.support import postgres as pg_support

postgres_url = pg_support.postgres_url  # the session fixture, bound here so pytest finds it

SANDBOXES = 100
WORKERS = 2

WORKER = textwrap.dedent(
    """
    import json, sys, time
    from space.controlplane.store import Store
    from space.core.errors import Conflict
    from space.core.lifecycle import Event, State

    url, owner, project = sys.argv[1], sys.argv[2], sys.argv[3]
    store = Store(url)
    steps, conflicts = [], 0
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()  # the parent releases all workers at once
    while True:
        batch = store.claim_work(owner, limit=3, lease_s=120)
        if not batch:
            # Nothing free: done if every sandbox is running, else another worker holds the rest.
            if all(sb.state is State.RUNNING for sb in store.list_sandboxes(project)):
                break
            time.sleep(0.005)
            continue
        for sb in batch:
            steps.append([sb.id, sb.generation])
            event = Event.CREATE if sb.state is State.PENDING else Event.CREATED
            try:
                store.transition(sb.id, sb.state, sb.generation, event)
            except Conflict:
                conflicts += 1
            store.release(sb.id, owner)
    store.close()
    print(json.dumps({"steps": steps, "conflicts": conflicts}))
    """
)


def _run_workers(url: str, project: str) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, url, f"worker-{i}", project],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(WORKERS)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.root)])
def test_processes_never_work_on_one_sandbox_together(
    backend: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    url = sqlite_url(tmp_path) if backend == "sqlite" else str(request.getfixturevalue("postgres_url"))
    migrate(url)
    engine = make_engine(url)
    try:
        if backend == "postgresql":
            with engine.begin() as conn:
                conn.execute(sa.text(f"TRUNCATE {', '.join(pg_support.STORE_TABLES)}"))
        with Store(engine) as store:
            org = store.create_org("acme")
            project = store.create_project(org.id, "p").id
            created = {store.create_sandbox(project, "python").id for _ in range(SANDBOXES)}

        results = _run_workers(url, project)

        assert [r["conflicts"] for r in results] == [0] * WORKERS
        steps = [tuple(step) for r in results for step in r["steps"]]
        assert len(steps) == len(set(steps)) == 2 * SANDBOXES  # each step claimed exactly once
        assert all(len(r["steps"]) > 0 for r in results), "a worker got no work: no real contention"
        with Store(engine) as store:
            final = store.list_sandboxes(project)
        assert {s.id for s in final} == created
        assert all(s.state is State.RUNNING and s.generation == 2 and s.lease_owner is None for s in final)
    finally:
        engine.dispose()
