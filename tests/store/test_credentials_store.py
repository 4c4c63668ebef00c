"""The credential store on both database backends (SQLite, and PostgreSQL as a throwaway server): scopes,
rotation, sealed values, audit order, and concurrent first puts of one name (one creates, the others
rotate; never two rows, never a lost value)."""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from space.controlplane.credentials.service import CredentialService
from space.controlplane.store import Store, migrate, sqlite_url
from space.controlplane.store.credentials import CredentialFields
from tests.support import postgres as pg_support

postgres_url = pg_support.postgres_url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.root)])
def store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path)
    else:
        url = pg_support.fresh_database(request.getfixturevalue("postgres_url"), "space_credentials")
    migrate(url)
    made = Store(url)
    yield made
    made.close()


def fields(**kw: Any) -> CredentialFields:
    return CredentialFields(hosts=["api.example.com"], **kw)


def test_scopes_rotation_and_audit(store: Store, tmp_path: pathlib.Path) -> None:
    service = CredentialService.open(store, tmp_path / "keys")
    org = store.create_org(f"o-{secrets.token_hex(3)}")
    project = store.create_project(org.id, "p")
    sandbox = store.create_sandbox(project.id, "python")
    for scope, value in (("org", b"org"), ("project", b"project"), ("sandbox", b"sandbox")):
        service.put(
            org_id=org.id, project_id=project.id, sandbox_id=sandbox.id, scope=scope, name="k",  # type: ignore[arg-type]
            fields=fields(), value=value, actor="key:t",
        )  # fmt: skip
    resolved = service.credentials.resolve(org.id, project.id, sandbox.id, ["k"])["k"]
    assert resolved is not None and resolved.scope == "sandbox"
    assert service.backend(resolved.vault).get(resolved.vault_ref) == b"sandbox"
    service.put(
        org_id=org.id, project_id=project.id, sandbox_id=sandbox.id, scope="sandbox", name="k",
        fields=CredentialFields(), value=b"rotated", actor="key:t",
    )  # fmt: skip
    again = service.credentials.resolve(org.id, project.id, sandbox.id, ["k"])["k"]
    assert again is not None and again.version == 2
    assert service.backend(again.vault).get(again.vault_ref) == b"rotated"
    assert service.credentials.unreferenced_blobs() == []
    log = service.credentials.list_audit(org.id, "k", scope="sandbox", scope_id=sandbox.id, project_id=None)
    assert [e.action for e in log] == ["create", "rotate"]
    assert [e.id for e in log] == sorted(e.id for e in log)


def test_concurrent_first_puts_make_one_credential(store: Store, tmp_path: pathlib.Path) -> None:
    service = CredentialService.open(store, tmp_path / "keys")
    org = store.create_org(f"o-{secrets.token_hex(3)}")
    project = store.create_project(org.id, "p")
    values = [f"value-{i}".encode() for i in range(8)]

    def put(value: bytes) -> str:
        change = service.put(
            org_id=org.id, project_id=project.id, sandbox_id=None, scope="project", name="race",
            fields=fields(), value=value, actor="key:t",
        )  # fmt: skip
        return change.action

    with ThreadPoolExecutor(len(values)) as pool:
        outcomes = list(pool.map(put, values))
    assert sorted(outcomes) == ["create"] + ["rotate"] * (len(values) - 1)
    (record,) = service.credentials.list_credentials(org.id, project.id)
    assert record.version == len(values)
    assert service.backend(record.vault).get(record.vault_ref) in values
    assert service.credentials.unreferenced_blobs() == []  # every replaced value was deleted
