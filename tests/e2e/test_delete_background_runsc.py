"""Delete answers at once and tears down in the background, on the real runsc node (`real_cluster`;
docs/adr/0073-delete-answers-at-once.md).

From the moment DELETE answers, the sandbox is `deleting` and every data and lifecycle route refuses it
(409 `deleting`; a second DELETE is an accepted no-op), the PTY does not open; later, polled with a
deadline, its resources on the node are gone: the runsc container, the holder process, its btrfs
subvolume, its network namespaces and host link; the record is `deleted` and GET answers 404. Attacks:
another tenant's DELETE of it is 404 (and it keeps running); an encoded id is refused before any lookup.
A sandbox whose named snapshot must be uploaded before its node copy goes is stopped before that upload
(ADR 0078): once the snapshot is in object storage, its runtime and every process in its network namespace
are gone, though its node copy is deleted only after, and the snapshot is restored from storage intact.
The crash safety of the background teardown is tests/crash/test_crash_injection.py's (delete kill points).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
import subprocess
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from space.node.helper.netaddr import SlotNames, node_tag
from tests.support import cluster as c
from tests.support.runsc_state import runsc_knows

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

LIMITS = {"cpus": 1.0, "memory_mb": 256}


def node_resources(data_dir: pathlib.Path, sandbox_id: str) -> dict[str, object]:
    """What the node holds of `sandbox_id` (empty values: nothing)."""
    run_dir = data_dir / "run" / sandbox_id
    found: dict[str, object] = {}
    with contextlib.suppress(OSError):
        found["container"] = (run_dir / "container").read_text().strip()
    try:
        pid = int(json.loads((run_dir / "holder.json").read_text())["holder_pid"])
        if pathlib.Path(f"/proc/{pid}").exists():
            found["holder"] = pid
    except (OSError, ValueError, KeyError):
        pass
    if (data_dir / "fs" / "sandboxes" / sandbox_id).exists():
        found["subvolume"] = str(data_dir / "fs" / "sandboxes" / sandbox_id)
    try:
        slot = int(json.loads((run_dir / "network.json").read_text())["slot"])
        found["slot"] = slot
    except (OSError, ValueError, KeyError):
        pass
    return found


def network_of(data_dir: pathlib.Path, slot: int) -> list[str]:
    """The slot's network namespaces and host link that still exist."""
    names = SlotNames(node_tag(data_dir))
    namespaces = set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split()
    )
    left = [ns for ns in (names.sandbox_ns(slot), names.edge_ns(slot)) if ns in namespaces]
    link = subprocess.run(
        ["ip", "link", "show", names.host_link(slot)], capture_output=True, text=True, check=False
    )
    return left + ([names.host_link(slot)] if link.returncode == 0 else [])


def netns_pids(data_dir: pathlib.Path, slot: int) -> list[str]:
    """The processes in the slot's sandbox network namespace (none once nothing of the sandbox runs)."""
    names = SlotNames(node_tag(data_dir))
    listed = subprocess.run(
        ["ip", "netns", "pids", names.sandbox_ns(slot)], capture_output=True, text=True, check=False
    )
    return listed.stdout.split()


def pty_status(url: str, sandbox_id: str, key: str) -> int:
    ws_url = url.replace("http://", "ws://") + f"/v1/sandboxes/{sandbox_id}/pty?cmd=/bin/sh"
    try:
        with connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=10) as ws:
            return int(ws.close_code or 0) or 101
    except InvalidStatus as exc:
        return int(exc.response.status_code)


def test_deleted_sandbox_is_refused_at_once_and_its_resources_go_later(real_cluster: c.RealCluster) -> None:
    data_dir = real_cluster.data_dir
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits=LIMITS)
        assert sb.exec("true").exit_code == 0
        held = node_resources(data_dir, sb.id)
        # The oracle is real: every resource the test later expects gone exists now.
        assert {"container", "holder", "subvolume", "slot"} <= set(held), held
        assert runsc_knows(data_dir, str(held["container"]))
        assert network_of(data_dir, int(str(held["slot"])))

        answered = sb.delete()
        assert (answered.state, answered.data["desired_state"]) == ("deleting", "deleted")

        api = httpx.Client(
            base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
        )
        with api:
            base = f"/v1/sandboxes/{sb.id}"
            refused = {
                "exec": api.post(f"{base}/exec", json={"cmd": "true"}),
                "file read": api.get(f"{base}/files", params={"path": "/etc/hostname"}),
                "file write": api.put(f"{base}/files", params={"path": "/tmp/x"}, content=b"x"),
                "pause": api.post(f"{base}/pause"),
                "snapshot": api.post(f"{base}/snapshots", json={"full": False}),
                "fork": api.post(f"{base}/fork", json={"count": 1}),
            }
            for what, answer in refused.items():
                assert answer.status_code in (404, 409), (what, answer.status_code, answer.text)
                if answer.status_code == 409:
                    assert answer.json()["error"]["details"].get("state") == "deleting", (what, answer.text)
            assert pty_status(real_cluster.url, sb.id, real_cluster.api_key) in (404, 409)
            again = api.delete(base)
            assert again.status_code in (202, 404), again.text  # a no-op while deleting, 404 once deleted

            def gone() -> bool:
                left = node_resources(data_dir, sb.id)
                return (
                    not left
                    and not runsc_knows(data_dir, str(held["container"]))
                    and not network_of(data_dir, int(str(held["slot"])))
                    and api.get(base).status_code == 404
                )

            c.wait_for(gone, timeout=60, interval=0.1, what=f"the resources of {sb.id} gone")


def test_another_tenants_delete_is_404_and_changes_nothing(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits=LIMITS)
        try:
            admin = httpx.Client(
                base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
            )
            name = f"floors-attacker-{secrets.token_hex(4)}"
            with admin:
                assert admin.post("/v1/projects", json={"name": name}).status_code == 201
                attacker_key = admin.post("/v1/keys", json={"project": name, "role": "admin"}).json()["key"]
            attacker = httpx.Client(
                base_url=real_cluster.url, headers={"Authorization": f"Bearer {attacker_key}"}
            )
            with attacker:
                assert attacker.delete(f"/v1/sandboxes/{sb.id}").status_code == 404
                encoded = attacker.delete(f"/v1/sandboxes/{sb.id}%2f..%2f{sb.id}")
                assert encoded.status_code in (400, 404, 422), encoded.text
                huge = attacker.delete("/v1/sandboxes/sb-" + "a" * 5000)
                assert huge.status_code in (400, 404, 414, 422), huge.text
            time.sleep(0.2)
            assert sp.sandboxes.get(sb.id).state == "running"
            assert sb.exec("true").exit_code == 0
        finally:
            sb.delete()


def test_a_deleting_sandbox_is_stopped_before_its_named_snapshot_uploads(real_cluster: c.RealCluster) -> None:
    """ADR 0078: the upload of a named snapshot takes a while (here ~64 MB of guest memory); meanwhile the
    sandbox must not run. Each poll reads the snapshot's state FIRST and the node AFTER: the stop precedes
    the upload, so once the snapshot is in object storage nothing of the sandbox may be found running,
    however the polls fall. (Before: the runtime and its netns processes lived until after the upload.)"""
    data_dir = real_cluster.data_dir
    name = f"floors-kept-{secrets.token_hex(4)}"
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits={"cpus": 1.0, "memory_mb": 512})
        sb.files.write("/work/kept.txt", b"written before the snapshot")
        # A busy sandbox: a writer that never stops, and guest memory that makes the upload take its time.
        assert sb.exec(["sh", "-c", "head -c 64M /dev/urandom > /tmp/ballast"]).exit_code == 0
        sb.exec(["sh", "-c", "nohup sh -c 'while :; do date >> /work/beat; done' >/dev/null 2>&1 &"])
        sb.snapshots.create(full=True, name=name)
        held = node_resources(data_dir, sb.id)
        slot = int(str(held["slot"]))
        assert {"holder", "container"} <= set(held) and netns_pids(data_dir, slot), held  # the oracle is live

        answered = sb.delete()
        assert answered.state == "deleting"
        api = httpx.Client(
            base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
        )
        with api:
            deadline = time.monotonic() + 120
            while True:
                snaps = api.get("/v1/snapshots", params={"name": name}).json()["snapshots"]
                uploaded = bool(snaps) and snaps[0]["restorable"]
                running = {
                    "holder": node_resources(data_dir, sb.id).get("holder"),
                    "netns processes": netns_pids(data_dir, slot),
                }
                if uploaded:
                    break
                assert time.monotonic() < deadline, f"{name} not uploaded in 120 s: {snaps}"
                time.sleep(0.01)
            assert not any(running.values()), f"still running once its snapshot was uploaded: {running}"
            c.wait_for(
                lambda: api.get(f"/v1/sandboxes/{sb.id}").status_code == 404,
                timeout=60, interval=0.1, what=f"{sb.id} deleted",
            )  # fmt: skip
        try:
            child = sp.sandboxes.create(from_snapshot=name)  # restored from object storage: intact
            try:
                assert child.files.read("/work/kept.txt") == b"written before the snapshot"
                assert child.exec(["sh", "-c", "test -s /tmp/ballast"]).exit_code == 0
            finally:
                child.delete()
        finally:
            with httpx.Client(
                base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
            ) as admin:
                admin.delete(f"/v1/snapshots/{name}")
