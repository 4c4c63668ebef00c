"""Template records and uploads below the API (ADR 0055): the status swaps and their guards, the bounded build
log, names per project, and an OCI archive stored once as an artifact before its build starts (a real
SQLite store and a real local-directory object store; the node is scripted)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from space.controlplane.e2b.templates import template_alias
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store, open_store
from space.controlplane.store.templates import TEMPLATE_LOG_BYTES, TEMPLATE_LOG_LINE
from space.controlplane.template_builds import OCI_UPLOAD, TemplateBuilds
from space.controlplane.template_sources import SOURCE_ENTRY, receive_source
from space.core import errors
from space.node.agent.template_travel import source_prefix
from space.objectstore.artifacts import read_entry_bytes
from space.objectstore.backends import open_store as open_objects
from space.objectstore.manifest import read_manifest

SPEC = {"from": "python", "steps": []}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    made = open_store(sqlite_url(tmp_path))
    yield made
    made.close()


def _project(store: Store, name: str = "p") -> str:
    org = store.create_org(f"org-{name}")
    return store.create_project(org.id, name).id


def test_status_swaps_are_guarded_and_names_are_per_project(store: Store) -> None:
    mine, theirs = _project(store, "mine"), _project(store, "theirs")
    made = store.create_template(
        mine, "t", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )
    assert store.create_template(
        theirs, "t", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )
    with pytest.raises(errors.AlreadyExists):
        store.create_template(
            mine, "t", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
        )
    assert store.get_template(theirs, made.id) is None and store.find_template(theirs, "t") != made
    done: dict[str, Any] = {"node_id": None, "size_bytes": 1, "default_user": None, "workdir": None}
    assert store.finish_template(made.id, "b", **done) is None  # not its lease owner
    assert store.fail_template(made.id, "x", expired_before=store.now()) is None  # its lease has not passed
    ready = store.finish_template(made.id, "a", **done)
    assert ready is not None and ready.status == "ready" and ready.lease_owner is None
    assert store.fail_template(made.id, "late", owner="a") is None  # settled once
    assert store.purge_template(made.id) is False  # only from deleting
    assert store.mark_template_deleting(theirs, made.id) is None  # another project's
    deleting = store.mark_template_deleting(mine, made.id)
    assert deleting is not None and deleting.status == "deleting"
    assert store.mark_template_deleting(mine, made.id) is not None  # again: a retry
    assert store.finish_template(made.id, "a", **done) is None
    assert store.purge_template(made.id) is True
    assert store.find_template(mine, "t") is None
    assert store.create_template(
        mine, "t", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )


def test_the_build_log_keeps_its_newest_256_kib(store: Store) -> None:
    project = _project(store)
    made = store.create_template(
        project, "t", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )
    store.append_template_log(made.id, ["x" * (TEMPLATE_LOG_LINE + 100)])
    first = store.template_log(made.id)
    assert len(first) == 1 and first[0].line.endswith("[cut]") and len(first[0].line) < TEMPLATE_LOG_LINE + 10
    line = "y" * 1000
    for batch in range(6):
        store.append_template_log(made.id, [f"{batch:03d}{i:05d}{line}" for i in range(60)])
    kept = store.template_log(made.id, limit=10_000)
    record = store.get_template(project, made.id)
    assert record is not None and record.log_truncated
    assert record.log_bytes == sum(len(k.line) for k in kept) <= TEMPLATE_LOG_BYTES
    assert record.log_bytes > TEMPLATE_LOG_BYTES - 2 * len(line)  # no more dropped than needed
    assert kept[-1].line.startswith("00500059") and [k.id for k in kept] == sorted(k.id for k in kept)
    assert store.template_log(made.id, after=kept[-2].id) == [kept[-1]]


class _Node:
    def __init__(self) -> None:
        self.builds: list[tuple[str, dict[str, Any]]] = []

    async def build_template(self, name: str, spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.builds.append((name, spec))
        yield {"done": {"name": name, "size_bytes": 1, "metadata": {}}}

    async def delete_template(self, name: str) -> dict[str, Any]:
        return {"name": name, "deleted": True}


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_an_oci_archive_is_stored_once_then_built(store: Store, tmp_path: pathlib.Path) -> None:
    objects = open_objects(f"file://{tmp_path / 'objects'}")
    node = _Node()
    project = _project(store)
    store.register_node(
        "http://127.0.0.1:9/n", "t" * 32, capacity={"cpus": 1, "memory_mb": 512, "sandboxes": 4}
    )
    builds = TemplateBuilds(store, lambda _node_id: node, owner="test-owner")

    async def scenario() -> None:
        waiting = await builds.start(project, "imported", {"from": OCI_UPLOAD, "steps": [{"run": "true"}]})
        assert (waiting.status, waiting.source, waiting.node_id) == ("building", OCI_UPLOAD, None)
        assert waiting.spec["from"] == f"oci:{waiting.id}" and node.builds == []  # it waits for its archive
        with pytest.raises(errors.TooLarge):
            await receive_source(builds, objects, waiting, _chunks(b"a" * 600, b"b" * 600), limit=1000)
        with pytest.raises(errors.Unavailable):
            await receive_source(builds, None, waiting, _chunks(b"tar"))
        started = await receive_source(builds, objects, waiting, _chunks(b"layer-1 ", b"layer-2"))
        assert started.node_id is not None and started.source == "oci:archive"
        again = store.get_template(project, waiting.id)
        assert again is not None
        with pytest.raises(errors.Conflict):
            await receive_source(builds, objects, again, _chunks(b"other"))
        for _ in range(100):
            if store.get_template(project, waiting.id).status == "ready":  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.05)
        await builds.aclose()

    asyncio.run(scenario())
    made = store.find_template(project, "imported")
    assert made is not None and made.status == "ready"
    assert node.builds == [
        (
            made.node_name,
            {"from": f"oci:{made.id}", "steps": [{"run": "true"}], "user": None, "start_cmd": None},
        )
    ]
    manifest = read_manifest(objects, source_prefix(made.id))
    assert read_entry_bytes(objects, manifest, SOURCE_ENTRY, data_key=None) == b"layer-1 layer-2"
    with pytest.raises(errors.InvalidArgument):
        asyncio.run(
            builds.start(project, "x", {"from": f"oci:{made.id}", "steps": []})
        )  # another's staged archive
    # Deleting it removes its archive (and a published copy, had the node published one) from the store.
    builds.objects = objects
    assert asyncio.run(builds.delete(project, made)) is True
    with pytest.raises(errors.NotFound):
        read_manifest(objects, source_prefix(made.id))
    assert store.find_template(project, "imported") is None


def test_e2b_alias_lookup_sees_the_projects_templates_and_the_built_ins_only(store: Store) -> None:
    mine, theirs = _project(store, "mine"), _project(store, "theirs")
    own = store.create_template(
        mine, "own", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )
    other = store.create_template(
        theirs, "other", spec=SPEC, source="python", node_id=None, lease_owner="a", lease_s=60
    )
    services: Any = SimpleNamespace(store=store)

    def lookup(alias: str) -> dict[str, Any]:
        return asyncio.run(template_alias(alias, cast(Any, SimpleNamespace(project_id=mine)), services))

    assert lookup("own") == lookup(own.id) == lookup(own.node_name) == {"templateID": own.id, "public": False}
    assert lookup("base") == {"templateID": "base", "public": True}
    for alias in ("other", other.id, other.node_name, "Not/A/Name", "no-such-template"):
        with pytest.raises(errors.NotFound):
            lookup(alias)
