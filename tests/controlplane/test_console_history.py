"""What the console's snapshot tree and credentials page read (ADR 0061), through the real API processes of
the shared fake-driver cluster:

- a completed rollback leaves the sandbox event `sandbox.rolled_back` naming its snapshot, written with the
  transition (so later snapshots can be drawn as a branch off it); attacked: another tenant rolling back the
  victim's sandbox, or its own sandbox to the victim's snapshot, or an encoded id, is a 404 that writes no
  event anywhere, and the victim's events stay unreadable to it;
- `GET /v1/credentials` carries each credential's usage from what its node reported (injections, refusals,
  the newest of each), never a value; attacked: a same-named credential of another project and an org
  credential seen from another project count none of the victim's uses; a credential deleted and made again
  under its name starts from nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core.ids import new_snapshot_id
from tests.support import cluster as c
from tests.support.node_identity import as_node, audit

fake_cluster = c.fake_cluster
ROLLED_BACK = "sandbox.rolled_back"


@pytest.fixture(scope="module")
def two(fake_cluster: c.Cluster) -> Iterator[tuple[c.Project, str, c.Project, str]]:
    with c.two_tenants(fake_cluster) as tenants:
        yield tenants


def rollbacks(http: httpx.Client, sandbox_id: str) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/events", params={"kind": ROLLED_BACK})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["events"])


def snapshot(http: httpx.Client, sandbox_id: str, **body: Any) -> dict[str, Any]:
    answer = http.post(f"/v1/sandboxes/{sandbox_id}/snapshots", json=body)
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def test_a_rollback_is_an_event_naming_its_snapshot(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, attacker, own = two
    http = victim.http()
    first = snapshot(http, sandbox_id, full=True, name="before-change")
    second = snapshot(http, sandbox_id)  # a disk snapshot
    assert rollbacks(http, sandbox_id) == []
    for target in (first, second):
        answer = http.post(f"/v1/sandboxes/{sandbox_id}/rollback", json={"snapshot_id": target["id"]})
        assert answer.status_code == 200, answer.text
    events = rollbacks(http, sandbox_id)
    assert [e["detail"]["snapshot_id"] for e in events] == [first["id"], second["id"]]
    assert events[0]["detail"] == {
        "snapshot_id": first["id"],
        "snapshot_kind": "full",
        "snapshot_name": "before-change",
    }
    assert events[1]["detail"]["snapshot_kind"] == "disk" and events[1]["detail"]["snapshot_name"] is None
    assert events[0]["message"] == f"rolled back to full snapshot before-change ({first['id']})"
    # Written with the transition: the event is not older than the snapshot it names, and the sandbox
    # is running again when it can be read.
    assert events[0]["at"] >= first["created_at"]
    assert http.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "running"

    # The attacker: the victim's sandbox, its own sandbox with the victim's snapshot, encoded and made-up
    # ids. Each is a 404 and no event is written on either side.
    evil = attacker.http()
    tries = [
        (sandbox_id, first["id"]),
        (own, first["id"]),
        (own, new_snapshot_id()),
        (sandbox_id.replace("-", "%2D"), first["id"]),
    ]
    for target_sandbox, snapshot_id in tries:
        answer = evil.post(f"/v1/sandboxes/{target_sandbox}/rollback", json={"snapshot_id": snapshot_id})
        assert answer.status_code == 404, (target_sandbox, answer.text)
        assert answer.json()["error"]["code"] == "not_found"
    assert len(rollbacks(http, sandbox_id)) == 2 and rollbacks(evil, own) == []
    assert evil.get(f"/v1/sandboxes/{sandbox_id}/events", params={"kind": ROLLED_BACK}).status_code == 404
    bad = evil.post(f"/v1/sandboxes/{own}/rollback", json={"snapshot_id": "snap-" + "x" * 5000})
    assert bad.status_code in (400, 413, 422), bad.text
    # A read-only key of the victim reads the history but cannot roll back.
    _id, reader = victim.new_key("read-only")
    refused = victim.http(reader).post(
        f"/v1/sandboxes/{sandbox_id}/rollback", json={"snapshot_id": first["id"]}
    )
    assert refused.status_code == 403 and len(rollbacks(victim.http(reader), sandbox_id)) == 2


def admin_key(project: c.Project) -> str:
    return project.new_key("admin")[1]


def usage_of(http: httpx.Client, name: str, scope: str = "project") -> dict[str, Any]:
    answer = http.get("/v1/credentials")
    assert answer.status_code == 200, answer.text
    (found,) = [
        cred for cred in answer.json()["credentials"] if (cred["name"], cred["scope"]) == (name, scope)
    ]
    return dict(found["usage"])


def put(http: httpx.Client, name: str, value: str, **body: Any) -> None:
    answer = http.put(f"/v1/credentials/{name}", json={"value": value, "hosts": ["api.example.com"], **body})
    assert answer.status_code == 200, answer.text


def test_credentials_carry_their_usage_never_values(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, attacker, own = two
    name, org_name = f"use-{secrets.token_hex(3)}", f"org-use-{secrets.token_hex(3)}"
    values = [f"value-{secrets.token_hex(8)}" for _ in range(3)]
    victim_admin, attacker_admin = victim.http(admin_key(victim)), attacker.http(admin_key(attacker))
    put(victim_admin, name, values[0])
    put(attacker_admin, name, values[1])  # the same name in the other project
    org = fake_cluster.http(fake_cluster.admin_key)
    put(org, org_name, values[2], scope="org")
    try:
        fresh = usage_of(victim.http(), name)
        assert fresh == {"injected": 0, "last_used_at": None, "refused": 0, "last_refused_at": None}
        host = "api.example.com"
        events = [
            {"sandbox_id": sandbox_id, "action": "injected", "credential": name, "host": host},
            {"sandbox_id": sandbox_id, "action": "injected", "credential": name, "host": host},
            {"sandbox_id": sandbox_id, "action": "rate_limited", "credential": name, "host": host},
            {"sandbox_id": sandbox_id, "action": "placeholder_blocked", "credential": name, "host": host},
            {"sandbox_id": sandbox_id, "action": "egress_denied", "host": "evil.example.net"},
            {"sandbox_id": sandbox_id, "action": "injected", "credential": org_name, "host": host},
        ]
        with as_node(fake_cluster) as (node_id, identity):
            reported = audit(fake_cluster, node_id, identity, events)
            assert reported.status_code == 200 and reported.json()["accepted"] == len(events), reported.text
            own_use = [{"sandbox_id": own, "action": "injected", "credential": org_name, "host": host}]
            assert audit(fake_cluster, node_id, identity, own_use).status_code == 200

        mine = usage_of(victim.http(), name)
        assert (mine["injected"], mine["refused"]) == (2, 2), mine
        assert (
            mine["last_used_at"]
            and mine["last_refused_at"]
            and mine["last_used_at"] <= mine["last_refused_at"]
        )
        # The read-only key sees the same, and no answer carries a value.
        _id, reader = victim.new_key("read-only")
        listed = victim.http(reader).get("/v1/credentials")
        assert all(value not in listed.text for value in values)
        assert usage_of(victim.http(reader), name) == mine
        # The org credential from each project: only that project's uses.
        assert usage_of(victim.http(), org_name, "org")["injected"] == 1
        assert usage_of(attacker.http(), org_name, "org")["injected"] == 1
        assert usage_of(org, org_name, "org")["injected"] == 2  # the org admin sees every project's
        # `space credential list` shows the same counts.
        from typer.testing import CliRunner

        from space.cli.main import app

        listed_cli = CliRunner().invoke(
            app, ["--url", fake_cluster.url, "--api-key", victim.key, "credential", "list"]
        )
        assert listed_cli.exit_code == 0, listed_cli.output
        (line,) = [row for row in listed_cli.stdout.splitlines() if row.startswith(f"{name} ")]
        assert "2 (2 refused)" in line and all(value not in listed_cli.stdout for value in values)
        # The attacker's own credential of that name: none of the victim's uses.
        assert usage_of(attacker.http(), name)["injected"] == 0
        assert all(value not in attacker.http().get("/v1/credentials").text for value in values[::2])

        # Deleted and made again under its name: a new credential, nothing used yet.
        assert victim_admin.delete(f"/v1/credentials/{name}").status_code == 200
        put(victim_admin, name, values[0])
        assert usage_of(victim.http(), name)["injected"] == 0
    finally:
        victim_admin.delete(f"/v1/credentials/{name}")
        attacker_admin.delete(f"/v1/credentials/{name}")
        org.delete(f"/v1/credentials/{org_name}", params={"scope": "org"})
