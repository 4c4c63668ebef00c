"""Metadata, list filters and pages, and deadlines through the HTTP API, on the fake cluster (which has no
object storage: an expired `on_timeout: pause` sandbox is kept paused there; the real-runsc test in
tests/e2e keeps one suspended). docs/adr/0048-metadata-lists-and-deadlines.md."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx

from space.sdk.models import ExecResult
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project


def _create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    answer = client.post("/v1/sandboxes", json={"limits": c.SMALL, **body})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def _list(client: httpx.Client, params: Any = None) -> httpx.Response:
    return client.get("/v1/sandboxes", params=params)


def _ids(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return [item["id"] for item in answer.json()["sandboxes"]]


def _field_of(answer: httpx.Response) -> Any:
    return answer.json()["error"]["details"].get("field")


def test_metadata_filters_order_and_pages(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    other = c.new_project(fake_cluster)
    try:
        first = _create(client, metadata={"env": "prod", "q": "a=b&c d/é"}, wait=False)
        second = _create(client, metadata={"env": "dev"}, on_timeout="pause", ttl_s=3600)
        third = _create(client, metadata={"env": "prod"}, wait=False)
        theirs = _create(other.http(), metadata={"env": "prod", "q": "a=b&c d/é"}, wait=False)
        assert first["metadata"] == {"env": "prod", "q": "a=b&c d/é"} and first["on_timeout"] == "delete"
        assert (second["on_timeout"], second["ttl_s"]) == ("pause", 3600)
        assert datetime.fromisoformat(second["expires_at"]) > datetime.fromisoformat(second["created_at"])
        assert first["expires_at"] is None

        assert _ids(_list(client)) == [third["id"], second["id"], first["id"]]  # newest first by default
        assert _ids(_list(client, {"order": "asc"})) == [first["id"], second["id"], third["id"]]
        # httpx encodes the parameter; the server decodes it once, and the value is matched as it was given.
        assert _ids(_list(client, {"metadata": "q=a=b&c d/é"})) == [first["id"]]
        assert _ids(_list(client, [("metadata", "env=prod"), ("metadata", "q=a=b&c d/é")])) == [first["id"]]
        assert _ids(_list(client, {"metadata": "env=prod"})) == [third["id"], first["id"]]
        assert _ids(_list(client, {"state": "deleted"})) == []
        running = _ids(_list(client, {"state": "running"}))
        assert second["id"] in running and theirs["id"] not in running
        assert _ids(_list(client, {"template": "no-such-template"})) == []
        # created_after: inclusive to the microsecond, any offset; a time without one is refused.
        since = datetime.fromisoformat(second["created_at"])
        assert _ids(_list(client, {"created_after": since.isoformat()})) == [third["id"], second["id"]]
        later = (since + timedelta(microseconds=1)).astimezone(timezone(timedelta(hours=2)))
        assert _ids(_list(client, {"created_after": later.isoformat()})) == [third["id"]]
        naive = _list(client, {"created_after": "2030-01-01T00:00:00"})
        assert (naive.status_code, _field_of(naive)) == (400, "created_after"), naive.text
        assert theirs["id"] not in _ids(_list(client, {"metadata": "q=a=b&c d/é"}))  # never another project's

        page = _list(client, {"limit": 2})
        assert _ids(page) == [third["id"], second["id"]]
        token = page.json()["next_page_token"]
        rest = _list(client, {"limit": 2, "page_token": token})
        assert _ids(rest) == [first["id"]] and "next_page_token" not in rest.json()
        # A token belongs to its project and its filters.
        foreign = _list(other.http(), {"limit": 2, "page_token": token})
        assert (foreign.status_code, _field_of(foreign)) == (400, "page_token"), foreign.text
        refiltered = _list(client, {"limit": 2, "page_token": token, "metadata": "env=prod"})
        assert (refiltered.status_code, _field_of(refiltered)) == (400, "page_token")
        for forged in ("x" * 600, "!!", token[:-4] + "AAAA", "eyJ2IjoxfQ"):
            assert _list(client, {"page_token": forged}).status_code in {400, 422}, forged
    finally:
        c.delete_all(fake_cluster, other)


def test_list_parameters_are_bounded(project: c.Project) -> None:
    client = project.http()
    for params, status in [
        ({"limit": 0}, 422),
        ({"limit": 1001}, 422),
        ({"order": "sideways"}, 422),
        ({"state": "sleeping"}, 400),
        ({"metadata": "no-equals-sign"}, 400),
        ({"metadata": "$.env=prod"}, 400),
        ({"metadata": "env') OR 1=1 --=x"}, 400),
        ({"metadata": 'env"=x'}, 400),
        ({"template": "x" * 65}, 422),
        ([("metadata", f"k{i}=v") for i in range(65)], 422),
        ([("state", "running")] * 33, 422),
    ]:
        answer = _list(client, params)
        assert answer.status_code == status, (params, answer.text)
    assert _list(client, {"limit": 1000}).status_code == 200
    _create(client, wait=False)
    # A value that is no template name matches nothing (E2B filters by ids and aliases).
    for template in ("../etc", "x' OR '1'='1", "team/name:tag", "%2e%2e"):
        assert _ids(_list(client, {"template": template})) == [], template


def test_oversized_or_unsafe_metadata_is_refused_and_nothing_is_created(project: c.Project) -> None:
    client = project.http()
    for metadata in (
        {f"k{i}": "v" for i in range(65)},
        {"k": "v" * 1025},
        {f"k{i}": "v" * 1000 for i in range(17)},
        {"a'; DROP TABLE sandboxes; --": "v"},
        {"$.path": "v"},
        {'a"b': "v"},
    ):
        answer = client.post("/v1/sandboxes", json={"limits": c.SMALL, "metadata": metadata})
        assert (answer.status_code, _field_of(answer)) == (400, "metadata"), answer.text
    assert client.post("/v1/sandboxes", json={"metadata": {"k": 1}}).status_code == 422
    assert client.post("/v1/sandboxes", json={"on_timeout": "explode"}).status_code == 422
    assert _ids(_list(client)) == []


def test_set_timeout_resets_extends_and_refuses(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    sb = _create(client, ttl_s=600)
    path = f"/v1/sandboxes/{sb['id']}/timeout"
    before = datetime.fromisoformat(sb["expires_at"])
    shorter = client.post(path, json={"timeout_s": 60})
    assert shorter.status_code == 200, shorter.text
    shortened = datetime.fromisoformat(shorter.json()["expires_at"])
    assert shortened < before and shorter.json()["ttl_s"] == 60
    kept = client.post(path, json={"timeout_s": 30, "extend_only": True})
    assert kept.json()["expires_at"] == shorter.json()["expires_at"]  # byte for byte
    longer = client.post(path, json={"timeout_s": 3600, "extend_only": True})
    assert datetime.fromisoformat(longer.json()["expires_at"]) > shortened + timedelta(seconds=3000)
    for body in (
        {"timeout_s": -1},
        {"timeout_s": 10**12},
        {"timeout_s": "5"},
        {"timeout_s": True},
        {"timeout_s": 5.5},
        {},
        {"timeout_s": 5, "x": 1},
    ):
        assert client.post(path, json=body).status_code == 422, body
    # Another tenant's sandbox, and one that does not exist: 404 alike, and nothing moved.
    other = c.new_project(fake_cluster)
    try:
        assert other.http().post(path, json={"timeout_s": 0}).status_code == 404
        missing = other.http().post(f"/v1/sandboxes/sb-{'a' * 26}/timeout", json={"timeout_s": 0})
        assert missing.status_code == 404
    finally:
        c.delete_all(fake_cluster, other)
    assert client.get(f"/v1/sandboxes/{sb['id']}").json()["expires_at"] == longer.json()["expires_at"]
    read_only = project.http(project.new_key("read-only")[1])
    assert read_only.post(path, json={"timeout_s": 0}).status_code == 403
    # timeout 0 under on_timeout=delete: deleted now; a deleted sandbox's deadline is a 409 naming it.
    assert client.post(path, json={"timeout_s": 0}).status_code == 200
    c.wait_for(
        lambda: _state(fake_cluster, sb["id"]) == "deleted", timeout=30, what="deleted at its deadline"
    )
    gone = client.post(path, json={"timeout_s": 60})
    assert gone.status_code == 404, gone.text  # a tombstone is not found, as in every other route
    record = fake_cluster.store.load_sandbox(sb["id"])
    assert record is not None and record.state == "deleted"


def _state(cluster: c.Cluster, sandbox_id: str) -> str:
    record = cluster.store.load_sandbox(sandbox_id)
    assert record is not None
    return record.state.value


def test_pause_on_timeout_keeps_the_sandbox_and_it_comes_back_on_use(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    sb = _create(client, ttl_s=600, on_timeout="pause", metadata={"keep": "me"})
    assert (
        client.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "echo kept > kept.txt"}).status_code == 200
    )
    assert client.post(f"/v1/sandboxes/{sb['id']}/timeout", json={"timeout_s": 0}).status_code == 200
    c.wait_for(lambda: _state(fake_cluster, sb["id"]) == "paused", timeout=30, what="paused at its deadline")
    time.sleep(1)  # it stays kept: no deadline is acted on again
    kept = client.get(f"/v1/sandboxes/{sb['id']}").json()
    assert (kept["state"], kept["desired_state"], kept["expires_at"]) == ("paused", "paused", None)
    assert _ids(_list(client, {"state": "paused", "metadata": "keep=me"})) == [sb["id"]]
    events = client.get(f"/v1/sandboxes/{sb['id']}/events").json()["events"]
    assert "sandbox.expired" in [event["kind"] for event in events]
    used = client.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "cat kept.txt"})
    assert used.status_code == 200 and ExecResult.from_wire(used.json()).stdout == "kept\n"
    back = client.get(f"/v1/sandboxes/{sb['id']}").json()
    assert back["state"] == "running"
    fresh = datetime.fromisoformat(back["expires_at"]) - datetime.fromisoformat(back["updated_at"])
    assert fresh == timedelta(seconds=600)  # a fresh deadline of its timeout, from its return


def test_the_sdk_labels_lists_pages_and_sets_timeouts(project: c.Project) -> None:
    with project.sdk() as sp:
        made = [
            sp.sandboxes.create(limits=c.SMALL, metadata={"run": "sdk", "i": str(i)}, wait=False)
            for i in range(3)
        ]
        assert [sb.metadata for sb in made] == [{"run": "sdk", "i": str(i)} for i in range(3)]
        assert [sb.id for sb in sp.sandboxes.list(metadata={"run": "sdk"}, order="asc")] == [
            sb.id for sb in made
        ]
        assert [sb.id for sb in sp.sandboxes.list(metadata={"run": "sdk", "i": "1"})] == [made[1].id]
        since = datetime.fromisoformat(made[1].data["created_at"])
        assert [sb.id for sb in sp.sandboxes.list(metadata={"run": "sdk"}, created_after=since)] == [
            made[2].id, made[1].id,
        ]  # fmt: skip
        page = sp.sandboxes.list_page(metadata={"run": "sdk"}, limit=2)
        assert [sb.id for sb in page.sandboxes] == [made[2].id, made[1].id] and page.next_page_token
        rest = sp.sandboxes.list_page(metadata={"run": "sdk"}, limit=2, page_token=page.next_page_token)
        assert [sb.id for sb in rest.sandboxes] == [made[0].id] and rest.next_page_token is None
        sb = made[0]
        assert sb.expires_at is None
        assert sb.set_timeout(60, extend_only=True).expires_at is None  # no deadline is later than any
        deadline = sb.set_timeout(60).expires_at
        assert deadline is not None and sb.data["ttl_s"] == 60
        assert sb.set_timeout(5, extend_only=True).expires_at == deadline
        assert sp.sandboxes.get(sb.id).expires_at == deadline


def test_a_forks_children_keep_their_sources_metadata_and_on_timeout(project: c.Project) -> None:
    client = project.http()
    source = _create(client, metadata={"lineage": "f1"}, on_timeout="pause", ttl_s=600)
    forked = client.post(f"/v1/sandboxes/{source['id']}/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    children = forked.json()["sandboxes"]
    assert [(ch["metadata"], ch["on_timeout"], ch["forked_from"]) for ch in children] == [
        ({"lineage": "f1"}, "pause", source["id"])
    ] * 2
    listed = _ids(_list(client, {"metadata": "lineage=f1", "order": "asc"}))
    assert listed == [source["id"], *[ch["id"] for ch in children]]


def test_a_fork_given_its_own_metadata_and_on_timeout_gives_them_to_its_children(project: c.Project) -> None:
    client = project.http()
    source = _create(client, metadata={"lineage": "f2"}, on_timeout="pause")
    own = {"metadata": {"lineage": "f2-child"}, "on_timeout": "delete"}
    forked = client.post(f"/v1/sandboxes/{source['id']}/fork", json=own)
    assert forked.status_code == 201, forked.text
    (child,) = forked.json()["sandboxes"]
    assert (child["metadata"], child["on_timeout"]) == ({"lineage": "f2-child"}, "delete")
    snapshots_before = client.get(f"/v1/sandboxes/{source['id']}/snapshots").json()
    # Refused before the checkpoint: a child that cannot be made leaves no snapshot behind.
    refused = client.post(f"/v1/sandboxes/{source['id']}/fork", json={"metadata": {"bad key!": "x"}})
    assert refused.status_code == 400 and refused.json()["error"]["details"]["field"] == "metadata"
    assert client.get(f"/v1/sandboxes/{source['id']}/snapshots").json() == snapshots_before
    bad_mode = client.post(f"/v1/sandboxes/{source['id']}/fork", json={"on_timeout": "explode"})
    assert bad_mode.status_code == 422
