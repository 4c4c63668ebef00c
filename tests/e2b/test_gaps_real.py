"""E2B gaps closed in round 2 of issue 13, through E2B's own SDK against a real installation (runsc):
RENAME and CHMOD watch events, a process's envs and cwd in `commands.list()`, a named snapshot used as a
template (also after its sandbox was killed: ADR 0060), and `auto_resume` (a paused sandbox is brought
back by its next use)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import FilesystemEvent, FilesystemEventType, Sandbox

from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture

pytestmark = pytest.mark.root


def _opts(real_cluster: RealCluster) -> dict[str, Any]:  # noqa: F811
    return {
        "api_key": real_cluster.api_key, "api_url": real_cluster.e2b_api_url,
        "sandbox_url": real_cluster.e2b_sandbox_url, "domain": "space.invalid",
    }  # fmt: skip


@pytest.fixture(scope="module")
def sbx(real_cluster: RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    made = Sandbox.create(**_opts(real_cluster), lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        yield made
    finally:
        made.kill()


@pytest.fixture(scope="module")
def readonly_key(real_cluster: RealCluster) -> str:  # noqa: F811
    with httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
    ) as h:
        answer = h.post("/v1/keys", json={"project": "default", "role": "read-only"})
        assert answer.status_code == 201, answer.text
        return str(answer.json()["key"])


def _events_until(handle: object, wanted: set[tuple[str, FilesystemEventType]]) -> list[FilesystemEvent]:
    events: list[FilesystemEvent] = []
    deadline = time.monotonic() + 30
    while not wanted <= {(e.name, e.type) for e in events} and time.monotonic() < deadline:
        events += handle.get_new_events()  # type: ignore[attr-defined]
        time.sleep(0.1)
    return events


def test_watch_reports_rename_and_chmod(sbx: Sandbox) -> None:
    base = f"/tmp/gaps-{secrets.token_hex(4)}"
    sbx.files.write(f"{base}/old.txt", "x")
    sbx.files.write(f"{base}/mode.txt", "y")
    handle = sbx.files.watch_dir(base)
    try:
        sbx.commands.run(f"mv {base}/old.txt {base}/new.txt && chmod 600 {base}/mode.txt")
        wanted = {
            ("old.txt", FilesystemEventType.RENAME),  # envd's inotify: the old name is the RENAME
            ("new.txt", FilesystemEventType.CREATE),
            ("mode.txt", FilesystemEventType.CHMOD),
        }
        events = _events_until(handle, wanted)
        seen = {(e.name, e.type) for e in events}
        assert wanted <= seen, events
        # Nothing was removed or written: a rename is not a REMOVE, a chmod not a WRITE.
        assert not {t for n, t in seen if n in ("old.txt", "mode.txt")} & {
            FilesystemEventType.REMOVE, FilesystemEventType.WRITE,
        }  # fmt: skip
    finally:
        handle.stop()


def test_process_list_has_envs_and_cwd(sbx: Sandbox, real_cluster: RealCluster, readonly_key: str) -> None:  # noqa: F811
    handle = sbx.commands.run("sleep 120", background=True, envs={"GAPS_K": "v1"}, cwd="/tmp", timeout=0)
    try:
        listed = next(p for p in sbx.commands.list() if p.pid == handle.pid)
        assert listed.envs == {"GAPS_K": "v1"}  # what the start asked for, not the inherited environment
        assert listed.cwd == "/tmp"
        assert listed.cmd == "/bin/bash" and listed.args[-1] == "sleep 120"
        # A read-only key lists the processes but not their variables (they may hold secrets).
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-API-Key": readonly_key}
        with httpx.Client(base_url=real_cluster.e2b_sandbox_url, timeout=60) as http:
            answer = http.post("/process.Process/List", json={}, headers=headers)
        assert answer.status_code == 200, answer.text
        mine = next(p for p in answer.json()["processes"] if p["pid"] == handle.pid)
        assert mine["config"].get("envs", {}) == {} and mine["config"]["cwd"] == "/tmp"
    finally:
        sbx.commands.kill(handle.pid)


def test_named_snapshot_is_a_template(sbx: Sandbox, real_cluster: RealCluster) -> None:  # noqa: F811
    """A full checkpoint with a name: a sandbox created from the name has the files and the processes."""
    name = f"gaps-{secrets.token_hex(4)}"
    sbx.files.write("/tmp/named.txt", "from the snapshot")
    sleeper = sbx.commands.run("sleep 600", background=True, timeout=0)
    snap = sbx.create_snapshot(name=name)
    assert snap.names == [name]
    child = Sandbox.create(name, **_opts(real_cluster))
    try:
        assert child.files.read("/tmp/named.txt") == "from the snapshot"
        assert sleeper.pid in [p.pid for p in child.commands.list()]  # memory and processes came too
        assert child.sandbox_id != sbx.sandbox_id
    finally:
        child.kill()
        sbx.commands.kill(sleeper.pid)
    assert Sandbox.delete_snapshot(name, **_opts(real_cluster)) is True
    assert Sandbox.list_snapshots(name=name, **_opts(real_cluster)).next_items() == []


def test_a_named_snapshot_outlives_its_killed_sandbox(real_cluster: RealCluster) -> None:  # noqa: F811
    """E2B's semantics (ADR 0060): snapshot with a name, kill the sandbox, create from the name: the new
    sandbox (restored from object storage, its source gone) has the file written before the snapshot."""
    name = f"outlives-{secrets.token_hex(4)}"
    source = Sandbox.create(**_opts(real_cluster))
    try:
        source.files.write("/tmp/outlives.txt", "written before the snapshot")
        source.create_snapshot(name=name)
    finally:
        source.kill()
    child = Sandbox.create(name, **_opts(real_cluster))  # waits for the kill, which keeps the snapshot
    try:
        assert child.files.read("/tmp/outlives.txt") == "written before the snapshot"
        with httpx.Client(
            base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
        ) as h:
            kept = h.get("/v1/snapshots", params={"name": name}).json()["snapshots"]
            assert [(s["sandbox_id"], s["locations"]) for s in kept] == [(source.sandbox_id, ["objectstore"])]
            made = h.get(f"/v1/sandboxes/{child.sandbox_id}").json()
            assert made["forked_from"] == source.sandbox_id and made["state"] == "running"
            assert h.get(f"/v1/sandboxes/{source.sandbox_id}").status_code == 404  # deleted
        assert [s.names for s in Sandbox.list_snapshots(name=name, **_opts(real_cluster)).next_items()] == [
            [name]
        ]
    finally:
        child.kill()
        assert Sandbox.delete_snapshot(name, **_opts(real_cluster)) is True
    assert Sandbox.list_snapshots(name=name, **_opts(real_cluster)).next_items() == []


def test_auto_resume_brings_a_paused_sandbox_back_on_use(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
    sbx.files.write("/tmp/kept.txt", "kept")
    assert sbx.pause() is True
    assert sbx.get_info().state.value == "paused"
    # The next use through the envd front resumes it: no connect() needed.
    assert sbx.commands.run("cat /tmp/kept.txt").stdout == "kept"
    assert sbx.get_info().state.value == "running"
