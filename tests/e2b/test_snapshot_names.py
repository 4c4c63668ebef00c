"""Named snapshots usable as templates: SPACE's API first (`name` on a full snapshot, `from_snapshot` on a
create, by id or name, SDK and CLI), then E2B's `create_snapshot(name)`, `Sandbox.create(name)`,
`list_snapshots(name=...)` and `delete_snapshot(name)` through the `e2b` SDK; another tenant's ids and
names are 404 everywhere. On the fake driver (the checkpoint is the fake's; the real one is in
test_gaps_real)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import e2b
import httpx
import pytest
from e2b.api.client.models import Error

from space.core import errors
from space.objectstore.backends import open_store as open_objects
from space.sdk import Space
from tests.support import cluster as c
from tests.support.e2b_cluster import E2bCluster


@pytest.fixture
def tenants(e2b_fake: E2bCluster) -> Iterator[tuple[c.Project, c.Project]]:
    mine, theirs = c.new_project(e2b_fake.cluster), c.new_project(e2b_fake.cluster)
    try:
        yield mine, theirs
    finally:
        for project in (mine, theirs):
            c.delete_all(e2b_fake.cluster, project)


def _e2b(e2b_fake: E2bCluster, key: str) -> httpx.Client:
    return httpx.Client(base_url=e2b_fake.api_url, headers={"X-API-Key": key}, timeout=60)


def _status(answer: httpx.Response, status: int) -> None:
    assert answer.status_code == status, (answer.request.method, answer.request.url, answer.text)
    assert Error.from_dict(answer.json()).code == status


def test_space_api_names_a_full_snapshot_and_creates_from_it(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]
) -> None:
    mine, theirs = tenants
    with mine.sdk() as sp, theirs.sdk() as other:
        source = sp.sandboxes.create(env={"FROM": "source"}, metadata={"role": "source"})
        first = source.snapshots.create(full=True, name="golden")
        assert first.name == "golden" and first.kind == "full"
        assert [s.name for s in source.snapshots.list() if s.id == first.id] == ["golden"]
        newer = source.snapshots.create(full=True, name="golden")  # a name used again: the newer one
        child = sp.sandboxes.create(from_snapshot="golden", env={"EXTRA": "1"}, metadata={"role": "child"})
        record = e2b_fake.cluster.store.load_sandbox(child.id)
        assert record is not None and record.forked_from == source.id and record.fork_snapshot_id == newer.id
        assert record.env == {"FROM": "source", "EXTRA": "1"} and child.metadata == {"role": "child"}
        assert child.state == "running" and record.template == "python"
        by_id = sp.sandboxes.create(from_snapshot=first.id)
        by_id_record = e2b_fake.cluster.store.load_sandbox(by_id.id)
        assert by_id_record is not None and by_id_record.fork_snapshot_id == first.id
        _refusals(sp, other, source.id, first.id)


def _refusals(sp: Space, other: Space, source_id: str, snapshot_id: str) -> None:
    source = sp.sandboxes.ref(source_id)
    with pytest.raises(errors.InvalidArgument):  # a disk snapshot has no name
        source.snapshots.create(full=False, name="disk-one")
    for bad in ("snap-looks-like-an-id", "team/x", "x:tag", "", "n" * 129, "-dash"):
        with pytest.raises(errors.InvalidArgument):
            source.snapshots.create(full=True, name=bad)
    # What a sandbox from a snapshot takes from its source is not the create's to set.
    with pytest.raises(errors.InvalidArgument) as fixed:
        sp.sandboxes.create("python", from_snapshot="golden", limits={"cpus": 1})
    assert fixed.value.details["field"] == "limits"
    for missing in ("nothing-called-this", "snap-" + "0" * 26, "snap-../../v1", "golden%2f.."):
        with pytest.raises(errors.NotFound):
            sp.sandboxes.create(from_snapshot=missing)
    # Another tenant: neither the name nor the id is theirs to use, and their own name is their own.
    for ref in ("golden", snapshot_id):
        with pytest.raises(errors.NotFound):
            other.sandboxes.create(from_snapshot=ref)
    with pytest.raises(errors.NotFound):
        other.sandboxes.ref(source_id).snapshots.create(full=True, name="golden")


def test_e2b_named_snapshots_through_the_sdk(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project], monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs = tenants
    monkeypatch.setenv("E2B_API_KEY", mine.key)
    monkeypatch.setenv("E2B_API_URL", e2b_fake.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_fake.sandbox_url)
    monkeypatch.setenv("E2B_DOMAIN", "space.invalid")
    sbx = e2b.Sandbox.create()
    snap = sbx.create_snapshot(name="e2b-named")
    assert snap.names == ["e2b-named"] and snap.snapshot_id.startswith("snap-")
    again = sbx.create_snapshot(name="e2b-named")
    listed = e2b.Sandbox.list_snapshots(name="e2b-named").next_items()
    assert [s.snapshot_id for s in listed] == [snap.snapshot_id, again.snapshot_id]
    assert [s.snapshot_id for s in sbx.list_snapshots(name="e2b-named").next_items()] == [
        snap.snapshot_id, again.snapshot_id,
    ]  # fmt: skip
    assert e2b.Template.exists("e2b-named") and e2b.Template.exists(again.snapshot_id)  # as templates
    alias = _e2b(e2b_fake, mine.key).get("/templates/aliases/e2b-named").json()
    assert alias == {"templateID": again.snapshot_id, "public": False}
    child = e2b.Sandbox.create("e2b-named")  # the name as a template: the newest snapshot of it
    record = e2b_fake.cluster.store.load_sandbox(child.sandbox_id)
    assert record is not None and record.fork_snapshot_id == again.snapshot_id
    assert child.get_info().state.value == "running"
    # Another tenant sees nothing of it and can use or delete none of it.
    them = _e2b(e2b_fake, theirs.key)
    assert them.get("/snapshots", params={"name": "e2b-named"}).json() == []
    _status(them.post("/v2/sandboxes", json={"templateID": "e2b-named"}), 404)  # for them: no such template
    _status(them.delete("/templates/e2b-named"), 404)
    for ref in ("e2b-named", again.snapshot_id):  # not a template of theirs either
        _status(them.get(f"/templates/aliases/{ref}"), 404)
    _status(them.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "e2b-named"}), 404)
    assert len(e2b.Sandbox.list_snapshots(name="e2b-named").next_items()) == 2  # untouched
    # Deleting the name deletes every snapshot of it (E2B deletes the template with its builds).
    assert e2b.Sandbox.delete_snapshot("e2b-named") is True
    assert e2b.Sandbox.list_snapshots(name="e2b-named").next_items() == []
    assert e2b.Sandbox.delete_snapshot("e2b-named") is False
    assert not e2b.Template.exists("e2b-named") and not e2b.Template.exists(again.snapshot_id)
    mine_api = _e2b(e2b_fake, mine.key)
    _status(mine_api.post("/v2/sandboxes", json={"templateID": "e2b-named"}), 404)  # a template name again
    oversized = mine_api.post(
        f"/sandboxes/{sbx.sandbox_id}/snapshots", content=json.dumps({"name": "n" * 300})
    )
    _status(oversized, 400)


def _artifacts(e2b_fake: E2bCluster, project_id: str, sandbox_id: str) -> list[str]:
    assert e2b_fake.cluster.store_url is not None
    objects = open_objects(e2b_fake.cluster.store_url)
    return objects.list(f"sandboxes/{project_id}/{sandbox_id}/")


def _until_no_artifacts(e2b_fake: E2bCluster, project_id: str, sandbox_id: str) -> list[str]:
    """The collector removes a deleted snapshot's artifact in the background (every 2 s)."""
    deadline = time.monotonic() + 60
    while (left := _artifacts(e2b_fake, project_id, sandbox_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_named_snapshot_outlives_its_sandbox(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project], monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's semantics (ADR 0060): snapshot with a name, kill the sandbox, list the snapshot, create
    sandboxes from it (restored from object storage), delete it: 404 afterwards, its artifact gone. The
    same through SPACE's own API and SDK; another tenant reaches none of it."""
    mine, theirs = tenants
    monkeypatch.setenv("E2B_API_KEY", mine.key)
    monkeypatch.setenv("E2B_API_URL", e2b_fake.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_fake.sandbox_url)
    monkeypatch.setenv("E2B_DOMAIN", "space.invalid")
    store = e2b_fake.cluster.store
    sbx = e2b.Sandbox.create()
    snap = sbx.create_snapshot(name="outlives")
    unnamed = sbx.create_snapshot()
    assert sbx.kill() is True
    child = e2b.Sandbox.create("outlives")  # waits for the kill, which keeps the named snapshot
    assert child.get_info().state.value == "running"
    record = store.load_sandbox(child.sandbox_id)
    assert record is not None and record.fork_snapshot_id == snap.snapshot_id
    assert record.forked_from == sbx.sandbox_id
    source = store.load_sandbox(sbx.sandbox_id)
    assert source is not None and source.state == "deleted"
    listed = [s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()]
    assert snap.snapshot_id in listed and unnamed.snapshot_id not in listed  # an unnamed one went with it
    assert [s.snapshot_id for s in e2b.Sandbox.list_snapshots(name="outlives").next_items()] == [
        snap.snapshot_id
    ]
    by_source = e2b.Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()  # the killed one's
    assert [s.snapshot_id for s in by_source] == [snap.snapshot_id]
    them = _e2b(e2b_fake, theirs.key).get("/snapshots", params={"sandboxID": sbx.sandbox_id})
    assert them.status_code == 200 and them.json() == []
    with mine.sdk() as sp, theirs.sdk() as other:
        kept = sp.snapshots.list(name="outlives")
        assert [s.id for s in kept] == [snap.snapshot_id] and kept[0].locations == ["objectstore"]
        assert sp.sandboxes.create(from_snapshot=snap.snapshot_id).state == "running"  # by id too
        for ref in ("outlives", snap.snapshot_id):  # another tenant: nothing of it, like a missing one
            assert other.snapshots.list(name=ref) == []
            with pytest.raises(errors.NotFound):
                other.sandboxes.create(from_snapshot=ref)
            with pytest.raises(errors.NotFound):
                other.snapshots.delete(ref)
        _status(_e2b(e2b_fake, theirs.key).delete("/templates/outlives"), 404)
        assert e2b.Sandbox.delete_snapshot("outlives") is True
        assert e2b.Sandbox.list_snapshots(name="outlives").next_items() == []
        _status(_e2b(e2b_fake, mine.key).post("/v2/sandboxes", json={"templateID": "outlives"}), 404)
        with pytest.raises(errors.NotFound):
            sp.sandboxes.create(from_snapshot=snap.snapshot_id)
        assert _until_no_artifacts(e2b_fake, mine.id, sbx.sandbox_id) == []

        # SPACE's own API: a named snapshot, its sandbox deleted, then listed, used and deleted by name.
        sb = sp.sandboxes.create(env={"FROM": "source"})
        sb.snapshots.create(full=True, name="space-kept")
        sb.delete()
        assert [s.sandbox_id for s in sp.snapshots.list(name="space-kept")] == [sb.id]
        assert [s.name for s in sp.snapshots.list() if s.sandbox_id == sb.id] == ["space-kept"]
        made = sp.sandboxes.create(from_snapshot="space-kept")
        made_record = store.load_sandbox(made.id)
        assert made.state == "running" and made_record is not None and made_record.env == {"FROM": "source"}
        sp.snapshots.delete("space-kept")
        assert sp.snapshots.list(name="space-kept") == []
        with pytest.raises(errors.NotFound):
            sp.snapshots.delete("space-kept")
        with pytest.raises(errors.InvalidArgument):
            sp.snapshots.list(after="not-a-snapshot-id")
        assert _until_no_artifacts(e2b_fake, mine.id, sb.id) == []
