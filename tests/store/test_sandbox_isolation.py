"""A sandbox's isolation in the store (issue 15, docs/adr/0076-isolation-per-sandbox.md), on SQLite and on
PostgreSQL (those cases carry the `root` mark): the default, the values, forks, and migration 0013 over
rows that exist already."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from space.controlplane.store import Store, migrate, open_store, sqlite_url
from space.controlplane.store.migrate import downgrade
from space.core.errors import InvalidArgument


@pytest.fixture
def fresh_url(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty database of its own (the migration test moves its schema down and up)."""
    if backend == "sqlite":
        return sqlite_url(tmp_path)
    base_url = str(request.getfixturevalue("postgres_url"))
    admin = sa.create_engine(sa.make_url(base_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text('DROP DATABASE IF EXISTS "space_isolation" WITH (FORCE)'))
            conn.execute(sa.text('CREATE DATABASE "space_isolation"'))
    finally:
        admin.dispose()
    return sa.make_url(base_url).set(database="space_isolation").render_as_string(hide_password=False)


def _project(store: Store) -> str:
    return store.create_project(store.create_org("acme").id, "default").id


def test_the_default_is_gvisor_and_microvm_is_kept(store: Store) -> None:
    project = _project(store)
    plain = store.create_sandbox(project, "python")
    vm = store.create_sandbox(project, "python", isolation="microvm")
    assert plain.isolation == "gvisor"
    assert store.get_sandbox(project, vm.id).isolation == "microvm"  # type: ignore[union-attr]
    assert {sb.id: sb.isolation for sb in store.list_sandboxes(project)} == {
        plain.id: "gvisor",
        vm.id: "microvm",
    }


@pytest.mark.parametrize("forged", ["microvm\n", "kvm", "", "MICROVM", " gvisor", "runsc", "qemu"])
def test_a_forged_isolation_is_refused_and_nothing_is_recorded(store: Store, forged: str) -> None:
    project = _project(store)
    with pytest.raises(InvalidArgument) as caught:
        store.create_sandbox(project, "python", isolation=forged)  # type: ignore[arg-type]
    assert caught.value.details["field"] == "isolation"
    assert store.list_sandboxes(project) == []


def test_a_fork_keeps_its_sources_isolation_and_cannot_change_it(store: Store) -> None:
    project = _project(store)
    vm = store.create_sandbox(project, "python", isolation="microvm")
    assert store.create_sandbox(project, "python", forked_from=vm.id).isolation == "microvm"
    assert store.create_sandbox(project, "python", forked_from=vm.id, isolation="microvm").isolation == (
        "microvm"
    )
    with pytest.raises(InvalidArgument):
        store.create_sandbox(project, "python", forked_from=vm.id, isolation="gvisor")
    assert len(store.list_sandboxes(project)) == 3


def test_the_database_refuses_an_isolation_the_code_does_not_know(db_url: str, store: Store) -> None:
    project = _project(store)
    sb = store.create_sandbox(project, "python")
    engine = sa.create_engine(db_url)
    try:
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("UPDATE sandboxes SET isolation = 'kvm' WHERE id = :id"), {"id": sb.id})
    finally:
        engine.dispose()


def test_upgrading_to_0013_makes_every_existing_sandbox_gvisor(fresh_url: str) -> None:
    migrate(fresh_url)
    with open_store(fresh_url) as s:
        project = _project(s)
        older = [s.create_sandbox(project, "python").id for _ in range(3)]
    downgrade(fresh_url, "0012")  # the schema before isolation existed, with its rows
    engine = sa.create_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert "isolation" not in {c["name"] for c in sa.inspect(conn).get_columns("sandboxes")}
            assert conn.execute(sa.text("SELECT count(*) FROM sandboxes")).scalar_one() == 3
    finally:
        engine.dispose()
    migrate(fresh_url)
    with open_store(fresh_url) as s:
        assert [s.load_sandbox(i).isolation for i in older] == ["gvisor"] * 3  # type: ignore[union-attr]
        assert s.create_sandbox(project, "python", isolation="microvm").isolation == "microvm"
