"""The sandbox events route (GET /v1/sandboxes/{id}/events), the SDK's `events()` and `space sandbox events`
against a real control plane (fake driver): events read back oldest first with a cursor, a kind filter
and a page size; and attacked: another tenant's sandbox id answers exactly like a missing one, oversized or
negative cursors and limits and malformed kinds are 422 naming the parameter, encoded ids never reach the
store."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from space.core.ids import new_sandbox_id
from tests.support import cluster as c

fake_cluster = c.fake_cluster


@pytest.fixture(scope="module")
def two(fake_cluster: c.Cluster) -> Iterator[tuple[c.Project, str, c.Project, str]]:
    with c.two_tenants(fake_cluster) as tenants:
        yield tenants


def _record(cluster: c.Cluster, sandbox_id: str) -> list[int]:
    store = cluster.store
    return [
        store.record_event(
            sandbox_id, "sandbox.crashed", "the runtime died (memory limit)", {"exit": 137}
        ).id,
        store.record_event(sandbox_id, "sandbox.recovered", "recovered from snap-1", {"from": "snap-1"}).id,
        store.record_event(sandbox_id, "node.lost", "node n1 was lost").id,
    ]


def test_events_read_back_with_cursor_kind_and_limit(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, _attacker, _other = two
    ids = _record(fake_cluster, sandbox_id)
    http = victim.http()
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/events", params={"after": ids[0] - 1})
    assert answer.status_code == 200, answer.text
    events = answer.json()["events"]
    assert [e["id"] for e in events] == ids and answer.json()["next_after"] is None
    assert events[0]["kind"] == "sandbox.crashed" and events[0]["detail"] == {"exit": 137}
    assert events[0]["sandbox_id"] == sandbox_id and events[0]["at"]
    page = http.get(f"/v1/sandboxes/{sandbox_id}/events", params={"after": ids[0] - 1, "limit": 2}).json()
    assert [e["id"] for e in page["events"]] == ids[:2] and page["next_after"] == ids[1]
    rest = http.get(f"/v1/sandboxes/{sandbox_id}/events", params={"after": page["next_after"]}).json()
    assert [e["id"] for e in rest["events"]] == ids[2:]
    only = http.get(f"/v1/sandboxes/{sandbox_id}/events", params={"kind": "sandbox.recovered"}).json()
    assert [e["id"] for e in only["events"]][-1] == ids[1]
    assert {e["kind"] for e in only["events"]} == {"sandbox.recovered"}

    with victim.sdk() as sp:
        found = sp.sandboxes.get(sandbox_id).events(after=ids[0] - 1, kind="sandbox.crashed")
    assert [e.number for e in found] == [ids[0]] and found[0].message == "the runtime died (memory limit)"
    assert found[0].detail == {"exit": 137} and found[0].kind == "sandbox.crashed"

    from typer.testing import CliRunner

    from space.cli.main import app

    base = ["--url", fake_cluster.url, "--api-key", victim.key, "sandbox", "events", sandbox_id]
    result = CliRunner().invoke(app, [*base, "--after", str(ids[0] - 1), "--json"])
    assert result.exit_code == 0, result.output
    assert [e["id"] for e in json.loads(result.stdout)] == ids
    table = CliRunner().invoke(app, [*base, "--kind", "node.lost"])
    assert table.exit_code == 0 and "node n1 was lost" in table.stdout, table.output


def test_another_tenants_sandbox_is_a_missing_one(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, attacker, _own = two
    _record(fake_cluster, sandbox_id)
    missing = new_sandbox_id()
    http = attacker.http()
    foreign = http.get(f"/v1/sandboxes/{sandbox_id}/events")
    absent = http.get(f"/v1/sandboxes/{missing}/events")
    assert foreign.status_code == absent.status_code == 404
    assert foreign.json()["error"]["code"] == absent.json()["error"]["code"] == "not_found"
    assert foreign.json()["error"]["message"].replace(sandbox_id, "X") == absent.json()["error"][
        "message"
    ].replace(missing, "X")
    assert "sandbox.crashed" not in foreign.text
    # The victim still reads its own.
    assert victim.http().get(f"/v1/sandboxes/{sandbox_id}/events").status_code == 200


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 501}, "limit"),
        ({"limit": 10**30}, "limit"),
        ({"limit": 0}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"after": -1}, "after"),
        ({"after": 1 << 63}, "after"),
        ({"after": "1e3"}, "after"),
        ({"kind": "Node.Lost"}, "kind"),
        ({"kind": "node..lost"}, "kind"),
        ({"kind": "a/b"}, "kind"),
        ({"kind": "../sandbox"}, "kind"),
        ({"kind": "x" * 33}, "kind"),
        ({"kind": "x" * 60_000}, "kind"),  # (httpx sends no longer query)
        ({"kind": "node.lost\x00"}, "kind"),
        ({"kind": ""}, "kind"),
    ],
)
def test_malformed_parameters_are_422_naming_them(two, params: dict[str, object], field: str) -> None:  # type: ignore[no-untyped-def]
    _victim, _sb, attacker, own = two
    answer = attacker.http().get(f"/v1/sandboxes/{own}/events", params=params)
    assert answer.status_code in {413, 414, 422}, answer.text  # a huge query may be refused before routing
    if answer.status_code == 422:
        assert answer.json()["error"]["code"] == "validation_error"
        assert field in answer.json()["error"]["details"]["fields"], answer.text


@pytest.mark.parametrize("raw", ["sb-..%2F..", "%2e%2e", "sb-x%00", "..%5C", "sb-" + "a" * 5000])
def test_encoded_ids_never_reach_the_store(two, raw: str) -> None:  # type: ignore[no-untyped-def]
    _victim, _sb, attacker, _own = two
    answer = attacker.http().get(f"/v1/sandboxes/{raw}/events")
    assert answer.status_code in {400, 404, 414, 422}, answer.text
    assert "error" in answer.json() and "events" not in answer.json()
