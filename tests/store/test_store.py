"""The control plane store against SQLite and PostgreSQL (the `db_url` fixture runs each test on both).

PostgreSQL runs as a throwaway server (tests/support/postgres.py); those cases carry the `root` mark.
Concurrency tests use separate engines per thread (as separate replicas would); the multi-process claim
test is in test_store_concurrency.py.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from space.controlplane.store import (
    Store,
    head_revision,
    make_engine,
    migrate,
    open_store,
    sqlite_url,
)
from space.controlplane.store.migrate import current_revision, downgrade
from space.controlplane.store.models import Base
from space.core.errors import AlreadyExists, Conflict, InvalidArgument, InvalidState, NotFound
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits
from tests.support.clock import FakeClock


def _fresh_pg_database(base_url: str, name: str) -> str:
    admin = sa.create_engine(sa.make_url(base_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return sa.make_url(base_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def fresh_url(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty database (no schema yet)."""
    if backend == "sqlite":
        return sqlite_url(tmp_path)
    return _fresh_pg_database(request.getfixturevalue("postgres_url"), "space_fresh")


@pytest.fixture
def project(store: Store) -> str:
    org = store.create_org("acme")
    return store.create_project(org.id, "default").id


def _parallel(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) in n threads released together; exceptions are returned, not raised."""
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        barrier.wait()
        try:
            return fn(i)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


# ---- schema ------------------------------------------------------------------------------------------


def test_models_and_migrations_agree(fresh_url: str) -> None:
    migrate(fresh_url)
    engine = make_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
    finally:
        engine.dispose()
    assert diff == []


def test_migrate_is_idempotent_and_safe_concurrently(fresh_url: str) -> None:
    results = _parallel(4, lambda _i: migrate(fresh_url))
    assert sorted(results) == [False, False, False, True]  # exactly one ran the migrations (the lock)
    assert migrate(fresh_url) is False
    engine = make_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_again(fresh_url: str) -> None:
    migrate(fresh_url)
    downgrade(fresh_url, "base")
    engine = make_engine(fresh_url)
    try:
        assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    with open_store(fresh_url) as s:
        assert s.create_org("again").name == "again"


def test_upgrading_to_0007_moves_known_codes_out_of_the_error_text(fresh_url: str) -> None:
    migrate(fresh_url)
    with open_store(fresh_url) as s:
        project = s.create_project(s.create_org("acme").id, "default").id
        revoked = s.create_sandbox(project, "python")
        s.record_failure(revoked.id, "key_revoked: the key was revoked", code="key_revoked", retry_in_s=0)
        odd = s.create_sandbox(project, "python")
        s.record_failure(odd.id, "not_a_code: words", code="internal", retry_in_s=0)
    downgrade(fresh_url, "0006")  # back to codes only in the text
    migrate(fresh_url)
    with open_store(fresh_url) as s:
        assert s.load_sandbox(revoked.id).error_code == "key_revoked"  # type: ignore[union-attr]
        assert s.load_sandbox(odd.id).error_code is None  # type: ignore[union-attr]


# ---- orgs, projects, keys ----------------------------------------------------------------------------


def test_orgs_and_projects(store: Store) -> None:
    org = store.create_org("acme")
    assert org.id.startswith("org-") and org.created_at.tzinfo is UTC
    with pytest.raises(AlreadyExists):
        store.create_org("acme")
    a = store.create_project(org.id, "a")
    b = store.create_project(org.id, "b")
    with pytest.raises(AlreadyExists):
        store.create_project(org.id, "a")
    other = store.create_org("other")
    assert store.create_project(other.id, "a").org_id == other.id  # names are unique per org only
    with pytest.raises(NotFound):
        store.create_project("org-aaaaaaaaaaaaaaaaaaaaaaaaaa", "x")
    assert sorted(p.id for p in store.list_projects(org.id)) == sorted([a.id, b.id])
    assert store.get_project_by_name(org.id, "b") == b
    assert store.get_project_by_name(other.id, "b") is None
    assert store.get_project(a.id) == a
    assert store.get_org_by_name("acme") == org


def test_api_key_secret_is_never_stored(store: Store, db_url: str) -> None:
    org = store.create_org("acme")
    project = store.create_project(org.id, "p")
    record, secret = store.create_api_key(project.id, org.id, "member")
    assert secret.startswith("space_") and len(secret) == len("space_") + 40
    assert record.prefix == secret[:12] and record.role == "member" and not record.revoked
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = [tuple(row) for row in conn.execute(sa.text("SELECT * FROM api_keys"))]
            cells = [str(cell) for row in rows for cell in row]
    finally:
        engine.dispose()
    assert len(rows) == 1
    assert all(secret not in cell and secret[6:] not in cell for cell in cells)
    assert hashlib.sha256(secret.encode()).hexdigest() in cells
    assert store.authenticate(secret) == record


def test_authenticate_and_revoke(store: Store) -> None:
    org = store.create_org("acme")
    project = store.create_project(org.id, "p")
    org_key, org_secret = store.create_api_key(None, org.id, "admin")
    key, secret = store.create_api_key(project.id, org.id, "read-only")
    assert org_key.project_id is None
    assert store.authenticate(secret) == key
    assert store.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert store.authenticate("") is None
    assert store.authenticate("space_" + "x" * 10_000) is None
    with pytest.raises(NotFound):  # outside the caller's project: indistinguishable from absent
        store.revoke_key(key.id, project_id="prj-aaaaaaaaaaaaaaaaaaaaaaaaaa")
    revoked = store.revoke_key(key.id, project_id=project.id)
    assert revoked.revoked and store.authenticate(secret) is None
    assert store.revoke_key(key.id).revoked_at == revoked.revoked_at  # idempotent
    assert store.authenticate(org_secret) == org_key
    with pytest.raises(InvalidArgument):
        store.create_api_key(project.id, org.id, "root")  # type: ignore[arg-type]
    other = store.create_org("other")
    with pytest.raises(NotFound):  # a project of another org
        store.create_api_key(project.id, other.id, "admin")
    assert sorted(k.id for k in store.list_api_keys(org.id)) == sorted([org_key.id, key.id])
    assert [k.id for k in store.list_api_keys(org.id, project.id)] == [key.id]


# ---- sandboxes ---------------------------------------------------------------------------------------


def test_create_get_list_and_project_isolation(store: Store, project: str) -> None:
    sb = store.create_sandbox(
        project, "python", {"K": "V"}, SandboxLimits(cpus=2.0, memory_mb=1024), idle_timeout_s=600
    )
    assert sb.id.startswith("sb-") and sb.state is State.PENDING and sb.desired_state is State.RUNNING
    assert sb.generation == 0 and sb.env == {"K": "V"} and sb.limits.cpus == 2.0
    assert sb.created_at.tzinfo is UTC and sb.expires_at is None
    assert store.get_sandbox(project, sb.id) == sb
    org = store.create_org("intruders")
    other = store.create_project(org.id, "other").id
    assert store.get_sandbox(other, sb.id) is None
    assert store.get_sandbox(project, "sb-aaaaaaaaaaaaaaaaaaaaaaaaaa") is None
    assert store.list_sandboxes(other) == []
    assert [s.id for s in store.list_sandboxes(project)] == [sb.id]
    with pytest.raises(InvalidArgument):
        store.create_sandbox(project, "Bad/Template")
    with pytest.raises(NotFound):
        store.create_sandbox("prj-aaaaaaaaaaaaaaaaaaaaaaaaaa", "python")
    with pytest.raises(NotFound):  # a fork source in another project is not found
        store.create_sandbox(other, "python", forked_from=sb.id)
    child = store.create_sandbox(project, "python", forked_from=sb.id, fork_snapshot_id="snap-x")
    assert child.forked_from == sb.id and child.state is State.PENDING


def test_cas_success_and_conflict(store: Store, project: str) -> None:
    sb = store.create_sandbox(project, "python")
    creating = store.transition(sb.id, State.PENDING, 0, Event.CREATE, node_id=None)
    assert creating.state is State.CREATING and creating.generation == 1
    with pytest.raises(Conflict) as info:  # a stale generation: someone else moved it
        store.transition(sb.id, State.PENDING, 0, Event.CREATE)
    assert info.value.details["state"] == "creating" and info.value.details["generation"] == 1
    with pytest.raises(Conflict):  # allowed by the table from the expected state, but not the real one
        store.transition(sb.id, State.PENDING, 1, Event.FAIL)
    running = store.transition(sb.id, "creating", 1, "created")
    assert running.state is State.RUNNING and running.generation == 2
    assert store.get_sandbox(project, sb.id) == running
    with pytest.raises(NotFound):
        store.transition("sb-aaaaaaaaaaaaaaaaaaaaaaaaaa", State.RUNNING, 2, Event.PAUSE)


def test_lifecycle_refusal_names_the_state(store: Store, project: str) -> None:
    sb = store.create_sandbox(project, "python")
    with pytest.raises(InvalidState) as info:
        store.transition(sb.id, State.PENDING, 0, Event.PAUSE)
    assert info.value.state == "pending" and "pending" in info.value.message
    assert store.get_sandbox(project, sb.id) == sb  # nothing written


def test_concurrent_cas_has_one_winner(store: Store, project: str) -> None:
    # One Store shared by threads: how the API uses it (sync store behind a thread pool).
    sb = store.create_sandbox(project, "python")
    results = _parallel(8, lambda _i: store.transition(sb.id, State.PENDING, 0, Event.CREATE))
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1 and winners[0].generation == 1
    assert all(isinstance(r, Conflict) for r in results if isinstance(r, Exception)), results


def test_transition_fields_and_deletion(store: Store, project: str, clock: FakeClock) -> None:
    sb = store.create_sandbox(project, "python")
    node = store.register_node("http://n1:7000", "tok")
    sb = store.transition(sb.id, State.PENDING, 0, Event.CREATE, node_id=node.id)
    assert sb.node_id == node.id
    sb = store.transition(
        sb.id, sb.state, sb.generation, Event.FAIL, error="disk full", error_code="storage_exhausted",
        error_permanent=True,
    )  # fmt: skip
    assert sb.state is State.FAILED and sb.error == "disk full" and sb.error_permanent
    assert sb.error_code == "storage_exhausted"
    with pytest.raises(TypeError):
        store.transition(sb.id, sb.state, sb.generation, Event.DELETE, generation=99)
    clock.advance(5)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.DELETE, desired_state=State.DELETED)
    assert sb.error is None and sb.error_code is None and not sb.error_permanent
    assert sb.desired_state is State.DELETED
    sb = store.transition(sb.id, sb.state, sb.generation, Event.DELETED)
    assert sb.state is State.DELETED and sb.deleted_at == clock()
    assert store.list_sandboxes(project) == []
    assert [s.id for s in store.list_sandboxes(project, include_deleted=True)] == [sb.id]
    with pytest.raises(InvalidState):
        store.transition(sb.id, sb.state, sb.generation, Event.DELETE)
    with pytest.raises(InvalidState) as info:
        store.set_desired(sb.id, State.RUNNING)
    assert info.value.state == "deleted"


def test_set_desired_and_update_observed(store: Store, project: str, clock: FakeClock) -> None:
    sb = store.create_sandbox(project, "python")
    sb = store.transition(sb.id, State.PENDING, 0, Event.CREATE)
    sb = store.transition(sb.id, State.CREATING, 1, Event.CREATED)
    paused = store.set_desired(sb.id, State.PAUSED, expected_generation=sb.generation)
    assert paused.desired_state is State.PAUSED and paused.state is State.RUNNING
    assert paused.generation == sb.generation  # desired state is not a state change
    with pytest.raises(Conflict):
        store.set_desired(sb.id, State.RUNNING, expected_generation=sb.generation - 1)
    with pytest.raises(InvalidArgument):
        store.set_desired(sb.id, State.PAUSING)
    later = clock() + timedelta(seconds=30)
    seen = store.update_observed(sb.id, expected_generation=sb.generation, last_activity_at=later)
    assert seen.last_activity_at == later and seen.generation == sb.generation
    with pytest.raises(Conflict):
        store.update_observed(sb.id, expected_generation=0, error="x")
    with pytest.raises(TypeError):
        store.update_observed(sb.id, state="running")
    failed = store.record_failure(sb.id, "node unreachable", code="unavailable", retry_in_s=10)
    failed = store.record_failure(sb.id, "node unreachable", code="unavailable", retry_in_s=10)
    assert failed.attempts == 2 and failed.next_attempt_at == clock() + timedelta(seconds=10)
    assert (failed.error, failed.error_code) == ("node unreachable", "unavailable")
    store.record_activity(sb.id, clock() - timedelta(hours=1))  # never backwards
    assert store.load_sandbox(sb.id) is not None
    assert store.get_sandbox(project, sb.id).last_activity_at == later  # type: ignore[union-attr]
    deleting = store.set_desired(sb.id, State.DELETED)
    assert deleting.attempts == 0 and deleting.next_attempt_at == clock()
    with pytest.raises(InvalidState):  # deletion is irrevocable
        store.set_desired(sb.id, State.RUNNING)
    assert store.set_desired(sb.id, State.DELETED).desired_state is State.DELETED


# ---- work leases -------------------------------------------------------------------------------------


def _settle_running(store: Store, sandbox_id: str) -> None:
    store.transition(sandbox_id, State.PENDING, 0, Event.CREATE)
    store.transition(sandbox_id, State.CREATING, 1, Event.CREATED)


def test_claim_work_selects_what_needs_work(store: Store, project: str, clock: FakeClock) -> None:
    pending = store.create_sandbox(project, "python")
    settled = store.create_sandbox(project, "python")
    _settle_running(store, settled.id)
    expiring = store.create_sandbox(project, "python", ttl_s=60)
    _settle_running(store, expiring.id)
    in_flight = store.create_sandbox(project, "python")
    store.transition(in_flight.id, State.PENDING, 0, Event.CREATE)
    later = store.create_sandbox(project, "python")
    store.record_failure(later.id, "retry later", code="unavailable", retry_in_s=30)
    given_up = store.create_sandbox(project, "python")
    store.record_failure(given_up.id, "template missing", code="not_found", retry_in_s=0, permanent=True)

    claimed = store.claim_work("r1", limit=10, lease_s=5)
    assert {s.id for s in claimed} == {pending.id, in_flight.id}
    assert all(s.lease_owner == "r1" and s.lease_until == clock() + timedelta(seconds=5) for s in claimed)
    assert store.claim_work("r2", limit=10, lease_s=5) == []  # leased

    clock.advance(61)  # leases expired, TTL over, retry time come
    claimed_ids = {s.id for s in store.claim_work("r2", limit=10, lease_s=5)}
    assert claimed_ids == {pending.id, in_flight.id, expiring.id, later.id}
    assert given_up.id not in claimed_ids and settled.id not in claimed_ids
    # A new wish clears the permanent error: the reconciler tries again.
    store.set_desired(given_up.id, State.DELETED)
    assert [s.id for s in store.claim_work("r3", limit=10, lease_s=5)] == [given_up.id]


def test_idle_sandboxes(store: Store, project: str, clock: FakeClock) -> None:
    short = store.create_sandbox(project, "python", idle_timeout_s=60)
    long = store.create_sandbox(project, "python", idle_timeout_s=600)
    never = store.create_sandbox(project, "python")
    for sb in (short, long, never):
        _settle_running(store, sb.id)
    clock.advance(30)
    store.record_activity(long.id)  # long: active later, but its timeout is longer
    clock.advance(61)
    assert [s.id for s in store.list_idle_sandboxes()] == [short.id]
    clock.advance(600)
    assert [s.id for s in store.list_idle_sandboxes()] == [short.id, long.id]
    store.set_desired(short.id, State.PAUSED)  # already being handled
    assert [s.id for s in store.list_idle_sandboxes()] == [long.id]


def test_lease_expiry_lets_another_owner_claim(store: Store, project: str, clock: FakeClock) -> None:
    sb = store.create_sandbox(project, "python")
    assert [s.id for s in store.claim_work("a", 1, lease_s=10)] == [sb.id]
    assert store.claim_work("b", 1, lease_s=10) == []
    clock.advance(5)
    assert store.renew(sb.id, "a", lease_s=10)  # now until t+15
    clock.advance(9)
    assert store.claim_work("b", 1, lease_s=10) == []
    clock.advance(2)
    assert [s.lease_owner for s in store.claim_work("b", 1, lease_s=10)] == ["b"]
    assert not store.renew(sb.id, "a", lease_s=10)  # "a" lost it and must stop
    assert not store.release(sb.id, "a")
    assert store.release(sb.id, "b")
    assert [s.lease_owner for s in store.claim_work("a", 1, lease_s=10)] == ["a"]


def test_claim_work_threads_are_disjoint(db_url: str, clock: FakeClock, project: str) -> None:
    with Store(db_url, clock=clock) as setup:
        created = {setup.create_sandbox(project, "python").id for _ in range(150)}
    stores = [Store(db_url, clock=clock) for _ in range(3)]

    def claim_all(i: int) -> list[str]:
        got: list[str] = []
        while batch := stores[i].claim_work(f"owner-{i}", limit=4, lease_s=300):
            got.extend(s.id for s in batch)
        return got

    try:
        results = _parallel(3, claim_all)
    finally:
        for s in stores:
            s.close()
    assert not any(isinstance(r, Exception) for r in results), results
    flat = [sid for r in results for sid in r]
    assert len(flat) == len(set(flat)) and set(flat) == created


# ---- nodes -------------------------------------------------------------------------------------------


def test_nodes_register_heartbeat_and_lost(store: Store, project: str, clock: FakeClock) -> None:
    n1 = store.register_node(
        "http://n1:7000", "t1", capacity={"cpus": 8, "memory_mb": 16384, "sandboxes": 50}, identity="id1"
    )
    n2 = store.register_node("http://n2:7000", "t2", templates=["python"], labels={"zone": "a"})
    again = store.register_node(
        "http://n1:7000", "t1-new", capacity={"cpus": 4, "memory_mb": 1, "sandboxes": 1}, identity="id1-new"
    )
    assert again.id == n1.id and again.capacity["cpus"] == 4  # idempotent by url
    racing = _parallel(4, lambda i: store.register_node("http://n3:7000", f"t3-{i}"))
    assert len({n.id for n in racing}) == 1, racing  # concurrent first registrations: one row
    # Only the identity of the latest registration authenticates, and only as its own node (ADR 0019).
    assert store.authenticate_node(n1.id, "id1-new") == again
    assert store.authenticate_node(n1.id, "id1") is None
    assert store.authenticate_node(n1.id, "t1-new") is None  # the RPC token is not an identity
    assert store.authenticate_node(n2.id, "id1-new") is None
    assert store.authenticate_node(n2.id, "t2") is None  # registered without an identity: none works
    assert sorted(n.id for n in store.list_nodes()) == sorted([n1.id, n2.id, racing[0].id])

    sb = store.create_sandbox(project, "python")
    store.transition(sb.id, State.PENDING, 0, Event.CREATE, node_id=n1.id)
    clock.advance(20)
    active = clock() - timedelta(seconds=1)
    beat = store.heartbeat(n1.id, used={"sandboxes": 1}, templates=["python"], activity={sb.id: active})
    assert beat.used == {"sandboxes": 1} and beat.templates == ["python"]
    assert store.load_sandbox(sb.id).last_activity_at == active  # type: ignore[union-attr]
    assert [s.id for s in store.list_sandboxes_on_node(n1.id)] == [sb.id]

    clock.advance(15)  # n2 silent for 35 s, n1 for 15 s
    assert store.mark_lost(older_than_s=30) == sorted([n2.id, racing[0].id])
    assert store.mark_lost(older_than_s=30) == []  # reported once
    assert [n.id for n in store.list_nodes()] == [n1.id]
    assert sorted(n.id for n in store.list_nodes("lost")) == sorted([n2.id, racing[0].id])
    assert store.heartbeat(n2.id, used={}).status == "ready"  # it came back
    assert store.set_node_status(n1.id, "draining").status == "draining"
    assert store.heartbeat(n1.id, used={}).status == "draining"
    with pytest.raises(NotFound):
        store.heartbeat("node-aaaaaaaaaaaaaaaaaaaaaaaaaa", used={})


# ---- snapshots ---------------------------------------------------------------------------------------


def test_snapshots(store: Store, project: str) -> None:
    sb = store.create_sandbox(project, "python")
    disk = store.create_snapshot(sb.id, "disk")
    full = store.create_snapshot(sb.id, "full")
    assert disk.state == "creating" and disk.id.startswith("snap-")
    ready = store.mark_snapshot_ready(disk.id, 4096)
    assert ready.state == "ready" and ready.size_bytes == 4096
    assert store.mark_snapshot_ready(disk.id, 1) == ready  # idempotent
    assert sorted(s.id for s in store.list_snapshots(sb.id)) == sorted([disk.id, full.id])
    assert store.get_snapshot(disk.id, project_id=project) == ready
    assert store.get_snapshot(disk.id, project_id="prj-aaaaaaaaaaaaaaaaaaaaaaaaaa") is None
    assert store.delete_snapshot(full.id).state == "deleting"
    with pytest.raises(Conflict):
        store.mark_snapshot_ready(full.id, 1)
    assert [s.id for s in store.list_snapshots(sb.id)] == [disk.id]
    assert [s.id for s in store.list_deleting_snapshots()] == [full.id]
    assert store.purge_snapshot(full.id) and not store.purge_snapshot(full.id)
    assert store.get_snapshot(full.id) is None
    with pytest.raises(NotFound):
        store.create_snapshot("sb-aaaaaaaaaaaaaaaaaaaaaaaaaa", "disk")


def test_snapshot_locations_keys_and_node_moves(store: Store, project: str) -> None:
    """Issue 4 columns: object-storage copy, wrapped key, origin; a sandbox leaving a node keeps only the
    snapshots that have a verified uploaded copy (their node copy is gone with the sandbox)."""
    node = store.register_node("http://n", "tok")
    sb = store.create_sandbox(project, "python", snapshot_policy={"disk_every_s": 60})
    assert store.load_sandbox(sb.id).snapshot_policy == {"disk_every_s": 60}  # type: ignore[union-attr]
    local = store.create_snapshot(sb.id, "disk", node.id, origin="policy", exclusive_bytes=10)
    uploaded = store.create_snapshot(
        sb.id, "full", node.id, prefix="sandboxes/p/s/x", data_key_id="local:k", wrapped_key="d3JhcA==",
        origin="suspend",
    )  # fmt: skip
    assert not uploaded.restorable and uploaded.locations == [f"node:{node.id}"]
    store.mark_snapshot_ready(uploaded.id, 5)
    marked = store.update_snapshot(uploaded.id, restorable=True, uploaded_at=store.now())
    assert marked.restorable and marked.locations == [f"node:{node.id}", "objectstore"]
    assert (marked.data_key_id, marked.wrapped_key, marked.origin) == ("local:k", "d3JhcA==", "suspend")
    with pytest.raises(TypeError):
        store.update_snapshot(uploaded.id, kind="disk")
    assert store.forget_node_snapshots(sb.id, node.id) == 2
    moved = store.get_snapshot(uploaded.id)
    assert moved is not None and moved.node_id is None and moved.locations == ["objectstore"]
    assert store.get_snapshot(local.id).state == "deleting"  # type: ignore[union-attr]
    assert store.delete_snapshots_of(sb.id) == 1
    assert {s.id for s in store.list_deleting_snapshots()} == {local.id, uploaded.id}


def test_report_crash_only_applies_to_live_sandboxes_on_that_node(
    store: Store, project: str, clock: FakeClock
) -> None:
    node = store.register_node("http://n", "tok")
    other = store.register_node("http://m", "tok")
    sb = store.create_sandbox(project, "python")
    assert store.report_crash(sb.id, node.id, notice="x") is None  # pending: no runtime to crash
    sb = store.transition(sb.id, "pending", 0, "create", node_id=node.id)
    sb = store.transition(sb.id, "creating", sb.generation, "created")
    assert store.report_crash(sb.id, other.id, notice="x") is None  # not on that node
    observed = store.now()
    clock.advance(1)
    store.update_observed(sb.id, notice="touched after the observation")
    assert store.report_crash(sb.id, node.id, notice="late", observed_at=observed) is None
    crashed = store.report_crash(sb.id, node.id, notice="runtime died")
    assert crashed is not None and crashed.state == "crashed" and crashed.crash_count == 1
    assert crashed.notice == "runtime died" and crashed.generation == sb.generation + 1
    assert store.report_crash(sb.id, node.id, notice="again") is None  # crashed is not live
    assert [s.id for s in store.list_sandboxes_in_states([State.CRASHED])] == [sb.id]
    assert store.list_sandboxes_with_policy() == []


# ---- idempotency -------------------------------------------------------------------------------------


def test_idempotency_lifecycle(store: Store, clock: FakeClock) -> None:
    first = store.begin_idempotent("prj-1", "k1", "h1")
    assert first.outcome == "new"
    assert store.begin_idempotent("prj-1", "k1", "h1").outcome == "in_progress"
    assert store.begin_idempotent("prj-2", "k1", "h9").outcome == "new"  # scopes are separate
    with pytest.raises(Conflict):
        store.begin_idempotent("prj-1", "k1", "h2")
    store.finish_idempotent("prj-1", "k1", 201, {"id": "sb-1", "n": [1, 2]})
    replay = store.begin_idempotent("prj-1", "k1", "h1")
    assert (replay.outcome, replay.status_code, replay.body) == ("replay", 201, {"id": "sb-1", "n": [1, 2]})
    with pytest.raises(Conflict):
        store.finish_idempotent("prj-1", "k1", 200, {})
    with pytest.raises(NotFound):
        store.finish_idempotent("prj-1", "nope", 200, {})
    # An abandoned (failed) request can be retried; a stale in-progress one can be taken over.
    assert store.begin_idempotent("prj-1", "k2", "h").outcome == "new"
    assert store.abandon_idempotent("prj-1", "k2")
    assert store.begin_idempotent("prj-1", "k2", "h").outcome == "new"
    assert store.begin_idempotent("prj-1", "k2", "h", stale_after_s=60).outcome == "in_progress"
    clock.advance(61)
    assert store.begin_idempotent("prj-1", "k2", "h", stale_after_s=60).outcome == "new"
    assert store.begin_idempotent("prj-1", "k2", "h", stale_after_s=60).outcome == "in_progress"
    clock.advance(3600)
    assert store.purge_idempotency(older_than_s=600) == 3
    assert store.begin_idempotent("prj-1", "k1", "other").outcome == "new"


def test_idempotency_concurrent_begins_have_one_new(db_url: str, clock: FakeClock) -> None:
    stores = [Store(db_url, clock=clock) for _ in range(10)]
    try:
        results = _parallel(10, lambda i: stores[i].begin_idempotent("prj-x", "same", "h").outcome)
        assert sorted(results) == ["in_progress"] * 9 + ["new"], results
        stores[0].finish_idempotent("prj-x", "same", 200, {"ok": True})
        again = _parallel(10, lambda i: stores[i].begin_idempotent("prj-x", "same", "h"))
        assert all(r.outcome == "replay" and r.body == {"ok": True} for r in again), again
    finally:
        for s in stores:
            s.close()


def test_placed_disk_counts_every_sandbox_on_the_node_but_deleted_ones(store: Store, project: str) -> None:
    n1 = store.register_node("http://n1:7000", "t1")
    n2 = store.register_node("http://n2:7000", "t2")

    def placed(disk_mb: int, node_id: str) -> str:
        sb = store.create_sandbox(project, "python", limits=SandboxLimits(disk_mb=disk_mb))
        store.transition(sb.id, State.PENDING, 0, Event.CREATE, node_id=node_id)
        return sb.id

    first = placed(1000, n1.id)
    placed(2000, n1.id)
    placed(4000, n2.id)
    gone = placed(8000, n1.id)
    store.transition(gone, State.CREATING, 1, Event.CREATED)
    store.transition(gone, State.RUNNING, 2, Event.DELETE)
    store.transition(gone, State.DELETING, 3, Event.DELETED)
    assert store.placed_disk_mb(n1.id) == 3000  # pending and creating copies hold their disk already
    assert store.placed_disk_mb(n1.id, besides=first) == 2000
    assert store.placed_disk_mb(n2.id) == 4000
    assert store.placed_disk_mb("nd-unknown") == 0
