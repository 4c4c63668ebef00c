"""E2B's control API on the fake driver, driven by the `e2b` SDK's own classes with only E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL set: create, get_info, list (filters, order, pages), set_timeout, pause and
connect, kill, fork and snapshots; every raw answer round-trips through the SDK's generated models."""

from __future__ import annotations

from collections.abc import Iterator

import e2b
import httpx
import pytest
from e2b.api.client.models import ListedSandbox, Sandbox, SandboxDetail, SandboxMetric, TemplateAliasResponse

from tests.support import cluster as c
from tests.support.e2b_cluster import E2bCluster


@pytest.fixture
def project(e2b_fake: E2bCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[c.Project]:
    made = c.new_project(e2b_fake.cluster)
    monkeypatch.setenv("E2B_API_KEY", made.key)
    monkeypatch.setenv("E2B_API_URL", e2b_fake.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_fake.sandbox_url)
    monkeypatch.setenv("E2B_DOMAIN", "space.invalid")
    try:
        yield made
    finally:
        c.delete_all(e2b_fake.cluster, made)


def _api(e2b_fake: E2bCluster, key: str) -> httpx.Client:
    return httpx.Client(base_url=e2b_fake.api_url, headers={"X-API-Key": key}, timeout=60)


def test_create_get_list_kill_round_trip(e2b_fake: E2bCluster, project: c.Project) -> None:
    sbx = e2b.Sandbox.create(metadata={"purpose": "test", "n": "1"})
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state.value == "running"
    assert info.metadata == {"purpose": "test", "n": "1"}
    api = _api(e2b_fake, project.key)
    detail = api.get(f"/sandboxes/{sbx.sandbox_id}")
    assert detail.status_code == 200, detail.text
    SandboxDetail.from_dict(detail.json())
    listed = api.get("/v2/sandboxes")
    assert listed.status_code == 200
    assert [ListedSandbox.from_dict(item).sandbox_id for item in listed.json()] == [sbx.sandbox_id]
    assert sbx.kill() is True
    assert e2b.Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.RUNNING])).next_items() == []
    assert api.delete(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
    assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["code"] == 404


def test_list_filters_order_and_pages(e2b_fake: E2bCluster, project: c.Project) -> None:
    made = [e2b.Sandbox.create(metadata={"group": "g1", "odd": "a b&c=d", "i": str(i)}) for i in range(3)]
    other = e2b.Sandbox.create(metadata={"group": "g2"})
    ids = [s.sandbox_id for s in made]
    pages = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"group": "g1"}), limit=2)
    first = pages.next_items()
    assert [s.sandbox_id for s in first] == ids[::-1][:2]  # newest first
    assert pages.has_next
    assert [s.sandbox_id for s in pages.next_items()] == ids[:1]
    assert not pages.has_next
    # Two pairs, one value with the separators E2B's SDK encodes twice: all pairs must match.
    query = e2b.SandboxQuery(metadata={"odd": "a b&c=d", "i": "1"})
    assert [s.sandbox_id for s in e2b.Sandbox.list(query=query).next_items()] == [ids[1]]
    api = _api(e2b_fake, project.key)
    asc = api.get("/v2/sandboxes", params={"order": "asc", "template": "base"})
    assert [ListedSandbox.from_dict(s).sandbox_id for s in asc.json()] == [*ids, other.sandbox_id]
    assert api.get("/v2/sandboxes", params={"template": "no-such-template"}).json() == []
    assert e2b.Template.exists("base") and e2b.Template.exists("python")
    assert not e2b.Template.exists("no-such-template")
    TemplateAliasResponse.from_dict(api.get("/templates/aliases/base").json())
    started = api.get(f"/sandboxes/{ids[1]}").json()["startedAt"]
    after = api.get("/v2/sandboxes", params={"startedAfter": started, "order": "asc"}).json()
    assert [s["sandboxID"] for s in after] == [ids[1], ids[2], other.sandbox_id]  # inclusive, to the µs
    bad_queries = ({"nextToken": "not-a-token"}, {"state": "running,x"}, {"limit": "0"}, {"limit": "101"})
    for bad in bad_queries:
        answer = api.get("/v2/sandboxes", params=bad)
        assert answer.status_code == 400, (bad, answer.text)
        assert set(answer.json()) >= {"code", "message"} and answer.json()["code"] == 400
    # A token made for one order is refused for the other.
    token = api.get("/v2/sandboxes", params={"limit": 1}).headers["X-Next-Token"]
    mixed = api.get("/v2/sandboxes", params={"limit": 1, "order": "asc", "nextToken": token})
    assert mixed.status_code == 400


def test_timeout_pause_and_connect(e2b_fake: E2bCluster, project: c.Project) -> None:
    sbx = e2b.Sandbox.create(timeout=120)
    before = sbx.get_info().end_at
    sbx.set_timeout(3600)
    extended = sbx.get_info().end_at
    assert (extended - before).total_seconds() > 3000
    e2b.Sandbox.connect(sbx.sandbox_id, timeout=60)  # running: connect only extends, never shortens
    assert sbx.get_info().end_at == extended
    assert sbx.pause() is True
    assert sbx.pause() is False  # 409: already paused
    assert sbx.get_info().state.value == "paused"
    paused = e2b.Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [sbx.sandbox_id]
    api = _api(e2b_fake, project.key)
    resumed = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 600})
    assert resumed.status_code == 201, resumed.text  # it was paused: resumed
    Sandbox.from_dict(resumed.json())
    assert resumed.json()["sandboxID"] == sbx.sandbox_id
    assert sbx.get_info().state.value == "running"
    again = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 600})
    assert again.status_code == 200  # already running
    # E2B's filesystem-only pause is SPACE's stop; connect starts it again.
    assert sbx.pause(mode="filesystem") is True
    record = e2b_fake.cluster.store.load_sandbox(sbx.sandbox_id)
    assert record is not None and record.state.value == "stopped"
    e2b.Sandbox.connect(sbx.sandbox_id)
    assert sbx.get_info().state.value == "running"
    sbx.set_timeout(0)  # now: the sandbox is deleted (its on_timeout), and gone from E2B's view
    c.wait_for(lambda: _gone(sbx), timeout=60, what="expired sandbox gone")


def _gone(sbx: e2b.Sandbox) -> bool:
    try:
        sbx.get_info()
    except e2b.SandboxNotFoundException:
        return True
    return False


def test_fork_snapshots_metrics_and_network(e2b_fake: E2bCluster, project: c.Project) -> None:
    sbx = e2b.Sandbox.create()
    forks = sbx.fork(count=2, timeout=900)
    assert len(forks) == 2 and all(isinstance(f, e2b.Sandbox) for f in forks)
    for child in forks:
        info = child.get_info()
        assert info.state.value == "running" and child.sandbox_id != sbx.sandbox_id
        assert 800 < (info.end_at - info.started_at).total_seconds() < 1000
    snapshot = sbx.create_snapshot()
    assert snapshot.names == [snapshot.snapshot_id]
    listed = [s.snapshot_id for s in e2b.Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
    assert snapshot.snapshot_id in listed and len(listed) == 2  # the fork's checkpoint is one too
    assert e2b.Sandbox.list_snapshots(sandbox_id=forks[0].sandbox_id).next_items() == []
    assert e2b.Sandbox.list_snapshots(name="no-such-name").next_items() == []
    pages = e2b.Sandbox.list_snapshots(limit=1)  # the project's, one page at a time
    assert [s.snapshot_id for s in pages.next_items()] == listed[:1] and pages.has_next
    assert [s.snapshot_id for s in pages.next_items()] == listed[1:] and not pages.has_next
    named = e2b.Sandbox.list_snapshots(name=snapshot.snapshot_id).next_items()
    assert [s.snapshot_id for s in named] == [snapshot.snapshot_id]
    from_snapshot = e2b.Sandbox.create(template=snapshot.snapshot_id)
    record = e2b_fake.cluster.store.load_sandbox(from_snapshot.sandbox_id)
    assert record is not None and record.forked_from == sbx.sandbox_id
    api = _api(e2b_fake, project.key)
    from_it = {"templateID": snapshot.snapshot_id}
    retried = [api.post("/v2/sandboxes", json=from_it, headers={"Idempotency-Key": "s1"}) for _ in range(2)]
    assert [r.status_code for r in retried] == [201, 201]
    assert retried[0].json()["sandboxID"] == retried[1].json()["sandboxID"] != from_snapshot.sandbox_id
    assert e2b.Sandbox.delete_snapshot(snapshot.snapshot_id) is True
    assert e2b.Sandbox.delete_snapshot(snapshot.snapshot_id) is False
    named = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "team/x:default"})
    assert named.status_code == 400 and named.json()["code"] == 400  # no project or tag parts in a name
    # Network rules are SPACE's egress policy.
    sbx.update_network({"allow_out": ["example.com"], "deny_out": ["10.0.0.0/8"]})
    policy = project.http().get(f"/v1/sandboxes/{sbx.sandbox_id}/egress").json()
    assert policy["allow"] == ["example.com"] and policy["deny"] == ["10.0.0.0/8"]
    # Metrics: the fake node samples every second.
    samples = c.wait_for(sbx.get_metrics, timeout=30, interval=0.5, what="metrics")
    assert samples[0].cpu_count >= 1 and samples[0].mem_total > 0
    raw = api.get(f"/sandboxes/{sbx.sandbox_id}/metrics").json()
    for item in raw:
        SandboxMetric.from_dict(item)
    assert api.get(f"/sandboxes/{sbx.sandbox_id}/metrics", params={"start": 1, "end": 2}).json() == []


def test_first_api_shapes_and_idempotent_create(e2b_fake: E2bCluster, project: c.Project) -> None:
    """What SDK 2.45 sends (v1 create with `secure` and `allow_internet_access`, v1 connect, v1 list) and
    2.63's Idempotency-Key (up to 255 characters)."""
    api = _api(e2b_fake, project.key)
    old_body = {"templateID": "base", "timeout": 300, "metadata": {"sdk": "2.45"}, "envVars": {"A": "1"},
                "secure": True, "allow_internet_access": True}  # fmt: skip
    created = api.post("/sandboxes", json=old_body)
    assert created.status_code == 201, created.text
    sandbox = Sandbox.from_dict(created.json())
    assert sandbox.template_id == "base" and sandbox.envd_version >= "0.4.0" and sandbox.envd_access_token
    connected = api.post(f"/sandboxes/{sandbox.sandbox_id}/connect", json={"timeout": 300})
    assert connected.status_code == 200
    assert Sandbox.from_dict(connected.json()).envd_access_token == sandbox.envd_access_token  # stable
    listed = api.get("/sandboxes", params={"metadata": "sdk=2.45"}).json()
    assert [ListedSandbox.from_dict(s).sandbox_id for s in listed] == [sandbox.sandbox_id]
    key = "retry-" + "x" * 240
    first = api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": key})
    again = api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": key})
    assert first.status_code == again.status_code == 201
    assert first.json()["sandboxID"] == again.json()["sandboxID"]
    bad = api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": "x" * 256})
    assert bad.status_code == 400 and bad.json()["code"] == 400


def test_auto_pause_keeps_an_expired_sandbox_and_connect_brings_it_back(
    e2b_fake: E2bCluster, project: c.Project
) -> None:
    sbx = e2b.Sandbox.create(lifecycle={"on_timeout": "pause"})
    info = sbx.get_info()
    assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}  # the SDK gives a dict
    sbx.set_timeout(0)  # expires now: kept (suspended), not deleted
    c.wait_for(lambda: sbx.get_info().state.value == "paused", timeout=60, what="expired sandbox paused")
    record = e2b_fake.cluster.store.load_sandbox(sbx.sandbox_id)
    assert record is not None and record.desired_state.value in ("suspended", "paused")  # kept
    back = e2b.Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert back.get_info().state.value == "running"
    assert (back.get_info().end_at - info.started_at).total_seconds() > 500
