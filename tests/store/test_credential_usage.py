"""Credential usage counted from the audit log (`usage_of`, ADR 0061) on both database backends: injections
and refusals per credential id with the newest time of each (aware UTC), other actions and other credentials
of the same name left out, a project's view kept to its project, and the batching of many credentials."""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from space.controlplane.store import Store, migrate, sqlite_url
from space.controlplane.store.credentials import AuditEntry, CredentialStore, CredentialUsage
from space.controlplane.store.credentials import audit as audit_module
from tests.support import postgres as pg_support

postgres_url = pg_support.postgres_url
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.root)])
def store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path)
    else:
        url = pg_support.fresh_database(request.getfixturevalue("postgres_url"), "space_credential_usage")
    migrate(url)
    made = Store(url)
    yield made
    made.close()


def use(
    org: str, project: str, credential_id: str, action: str, name: str = "tok", project_id: str | None = None
) -> AuditEntry:
    return AuditEntry(
        org_id=org, action=action, actor="node:n1", project_id=project_id or project, sandbox_id="sb-x",
        credential_id=credential_id, credential_name=name, scope="project", host="api.example.com",
    )  # fmt: skip


def test_usage_counts_uses_and_refusals_per_credential(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = CredentialStore(store)
    org, project, other = (f"x-{secrets.token_hex(4)}" for _ in range(3))
    write = credentials.audit
    write([use(org, project, "cred-a", "injected")], at=T0)
    write([use(org, project, "cred-a", "injected")], at=T0 + timedelta(minutes=5))
    write([use(org, project, "cred-a", "rate_limited")], at=T0 + timedelta(minutes=1))
    write([use(org, project, "cred-a", "denied")], at=T0 + timedelta(minutes=2))
    write([use(org, project, "cred-a", "fetched_by_node"), use(org, project, "cred-a", "rotate")], at=T0)
    write([use(org, project, "cred-old", "injected")], at=T0)  # the same name, a deleted credential's id
    write([use(org, project, "cred-a", "injected", project_id=other)], at=T0 + timedelta(minutes=9))
    write([use(f"{org}-2", project, "cred-a", "injected")], at=T0)  # another org (same ids, never counted)

    pairs = [("cred-a", "tok"), ("cred-b", "tok2")]
    mine = credentials.usage_of(org, pairs, project_id=project)
    assert mine == {
        "cred-a": CredentialUsage(
            injected=2,
            last_used_at=T0 + timedelta(minutes=5),
            refused=2,
            last_refused_at=T0 + timedelta(minutes=2),
        )
    }
    assert mine["cred-a"].last_used_at is not None and mine["cred-a"].last_used_at.tzinfo is not None
    everywhere = credentials.usage_of(org, pairs, project_id=None)
    assert everywhere["cred-a"].injected == 3 and everywhere["cred-a"].last_used_at == T0 + timedelta(
        minutes=9
    )
    assert credentials.usage_of(org, pairs, project_id=other)["cred-a"].refused == 0
    assert credentials.usage_of(org, [], project_id=None) == {}

    # Many credentials: one query per batch, the same answer.
    monkeypatch.setattr(audit_module, "USAGE_BATCH", 1)
    many = [("cred-a", "tok"), ("cred-old", "tok"), *((f"cred-{i}", f"n{i}") for i in range(3))]
    batched = credentials.usage_of(org, many, project_id=project)
    assert batched["cred-a"] == mine["cred-a"] and batched["cred-old"].injected == 1 and len(batched) == 2
