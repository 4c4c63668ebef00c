"""Tenant keys (BYOK) through the API on a cluster of its own (real control plane + fake-driver node + local
object store): register, rotate and revoke the org's key; old snapshots stay restorable after a rotation
and after the org registers another key; a revoked key makes the snapshots it wrapped unrestorable with
403 key_revoked and refuses new uploads; no plaintext canary is ever in the object store.

Its own cluster, because revoking the org key of the shared cluster would break every other test there."""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core import errors
from tests.support import cluster as c
from tests.support.s3server import S3Server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path_factory.mktemp("byok"), object_store=True) as made:
        yield made


def error(answer: httpx.Response, status: int, code: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code, answer.text


def objects_bytes(cluster: c.Cluster) -> bytes:
    root = cluster.root / "objects"
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def suspended_with(cluster: c.Cluster, content: bytes) -> Any:
    """A sandbox holding `content` in a file, suspended to the object store."""
    with cluster.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("canary.txt", content)
        assert sb.suspend().state == "suspended"
        return sb.id


def restore(cluster: c.Cluster, sandbox_id: str) -> httpx.Response:
    return cluster.http(cluster.admin_key).post(f"/v1/sandboxes/{sandbox_id}/restore")


def test_org_key_lifecycle(cluster: c.Cluster, tmp_path: pathlib.Path) -> None:
    admin = cluster.http(cluster.admin_key)
    project = c.new_project(cluster)
    _id, project_admin = project.new_key("admin")
    for key in (project.key, project_admin):  # only org admin keys manage the org key
        error(cluster.http(key).get("/v1/org/encryption-key"), 403, "permission_denied")
        error(cluster.http(key).post("/v1/org/encryption-key/revoke"), 403, "permission_denied")
    error(admin.get("/v1/org/encryption-key"), 404, "not_found")  # none until first use

    first_canary = b"CANARY-" + secrets.token_hex(16).encode()
    first = suspended_with(cluster, first_canary)
    auto = admin.get("/v1/org/encryption-key").json()  # created on first use
    assert auto["service"] == "local" and auto["state"] == "active"

    # Register another (new local) key: new data goes under it, the first sandbox stays restorable.
    registered = admin.put("/v1/org/encryption-key", json={"service": "local"})
    assert registered.status_code == 200, registered.text
    assert registered.json()["key_id"] != auto["key_id"]
    error(admin.put("/v1/org/encryption-key", json={"service": "local", "key_id": "lk-" + "0" * 32}),
          404, "not_found")  # fmt: skip
    error(admin.put("/v1/org/encryption-key", json={"service": "kms"}), 400, "invalid_argument")
    second_canary = b"CANARY-" + secrets.token_hex(16).encode()
    second = suspended_with(cluster, second_canary)

    rotated = admin.post("/v1/org/encryption-key/rotate")
    assert rotated.status_code == 200 and rotated.json()["rotated_at"] is not None
    stored = objects_bytes(cluster)
    assert stored and first_canary not in stored and second_canary not in stored

    # After a rotation, both old snapshots (old key, and the current key's old version) restore.
    for sandbox_id, content in ((first, first_canary), (second, second_canary)):
        answer = restore(cluster, sandbox_id)
        assert answer.status_code == 200 and answer.json()["state"] == "running", answer.text
        with cluster.sdk() as sp:
            assert sp.sandboxes.get(sandbox_id).files.read("canary.txt") == content
    with cluster.sdk() as sp:
        assert sp.sandboxes.get(second).suspend().state == "suspended"  # wrapped by the rotated key

    revoked = admin.post("/v1/org/encryption-key/revoke")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    # The snapshot wrapped by the revoked key can no longer be restored, with a clear error ...
    error(restore(cluster, second), 403, "key_revoked")
    # ... and nothing new is written under it.
    with cluster.sdk() as sp, pytest.raises(errors.KeyRevoked):
        sp.sandboxes.get(first).suspend()
    error(admin.post("/v1/org/encryption-key/rotate"), 403, "key_revoked")
    with cluster.store.engine.connect() as db:
        rows = db.exec_driver_sql(
            "SELECT action FROM credential_audit WHERE action LIKE 'org_key_%' ORDER BY id"
        )
        audit = [row.action for row in rows]
    assert audit == ["org_key_set", "org_key_rotate", "org_key_revoke"]
    # Registering a fresh key makes the org usable again for new data.
    fresh = admin.put("/v1/org/encryption-key", json={"service": "local"})
    assert fresh.status_code == 200 and fresh.json()["state"] == "active", fresh.text
    with cluster.sdk() as sp:
        assert sp.sandboxes.get(first).suspend().state == "suspended"


def test_kms_keys_are_registered_rotated_and_revoked(
    s3_server: S3Server, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BYOK with the AWS-KMS-compatible service (moto's KMS on loopback), through the routes of an in-process
    control plane (no reconciler: the DataKeys provider is called directly, as suspend/restore do)."""
    from fastapi.testclient import TestClient

    from space.controlplane.api.app import create_app
    from space.controlplane.store import Store, migrate, sqlite_url
    from space.crypto.keys import open_key_service

    monkeypatch.setenv("SPACE_KMS_URL", s3_server.kms_url)
    url = sqlite_url(tmp_path)
    migrate(url)
    store = Store(url)
    org = store.create_org("kms-org")
    project = store.create_project(org.id, "default")
    _record, admin_key = store.create_api_key(None, org.id, "admin")
    kms = open_key_service(s3_server.kms_url)
    tenant_key = kms.create_key("the tenant's own key")
    app = create_app(store, node_token="unused", run_reconciler=False, data_dir=tmp_path)
    provider = app.state.services.reconciler.data_keys
    sandbox = store.create_sandbox(project.id, "python")
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {admin_key}"}) as client:
            error(client.put("/v1/org/encryption-key", json={"service": "kms"}), 400, "invalid_argument")
            error(
                client.put("/v1/org/encryption-key", json={"service": "kms", "key_id": "nope"}),
                404,
                "not_found",
            )
            made = client.put("/v1/org/encryption-key", json={"service": "kms", "key_id": tenant_key})
            assert made.status_code == 200 and made.json()["service"] == "kms", made.text
            old = provider.for_sandbox(sandbox)
            assert old.key_id == f"kms:{tenant_key}"
            assert client.post("/v1/org/encryption-key/rotate").status_code == 200
            new = provider.for_sandbox(sandbox)
            for key in (old, new):  # both versions still open after the rotation
                assert provider.unwrap(sandbox, key.key_id, key.wrapped) == key.plaintext
            assert client.post("/v1/org/encryption-key/revoke").json()["state"] == "revoked"
            with pytest.raises(errors.KeyRevoked):
                provider.unwrap(sandbox, old.key_id, old.wrapped)
            with pytest.raises(errors.KeyRevoked):
                provider.for_sandbox(sandbox)
    finally:
        kms.close()
        store.close()
