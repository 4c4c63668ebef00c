"""`space backup create` of the real `space up` installation the suite shares, while it runs, restored into a
fresh data directory laid out as `space up` expects it (ADR 0062).

The restored directory is checked in process, not started: a second control plane over a copy of the shared
installation's rows would drive the shared node's sandboxes (tests/controlplane/test_backup.py starts one in
the old one's place, on its own cluster). Checked: the installation's admin key authenticates against the
restored database, a credential made before the backup opens with the restored master key, the org keys
directory came along, `admin.key` is the installation's, and the node token is the agent user's, 0600, as
`space up` leaves it; the running installation still answers.
"""

from __future__ import annotations

import pathlib
import secrets

import httpx
import pytest
from typer.testing import CliRunner

from space.cli import main as cli_main
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from tests.support import cluster as c

pytestmark = pytest.mark.root
real_cluster = c.real_cluster


def key_files(data_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.relative_to(data_dir) for path in (data_dir / "keys").rglob("*.key"))


def test_backup_of_a_running_space_up_restores_into_a_fresh_data_dir(
    real_cluster: c.RealCluster, tmp_path: pathlib.Path
) -> None:
    canary = "BACKUP-UP-" + secrets.token_hex(8)
    name = f"backup{secrets.token_hex(3)}"
    headers = {"Authorization": f"Bearer {real_cluster.api_key}"}
    admin = httpx.Client(base_url=real_cluster.url, headers=headers)
    try:
        body = {"value": canary, "hosts": ["api.example.com"]}
        answer = admin.put(f"/v1/credentials/{name}", params={"scope": "org"}, json=body)
        assert answer.status_code in (200, 201), answer.text
        archive = tmp_path / "space.tar.gz"
        made = CliRunner().invoke(
            cli_main.app, ["backup", "create", "--data-dir", str(real_cluster.data_dir), "-o", str(archive)]
        )
        assert made.exit_code == 0, made.output
        fresh = tmp_path / "restored"
        restored = CliRunner().invoke(
            cli_main.app, ["backup", "restore", str(archive), "--data-dir", str(fresh)]
        )
        assert restored.exit_code == 0, restored.output
        assert admin.get("/healthz").status_code == 200
    finally:
        admin.delete(f"/v1/credentials/{name}", params={"scope": "org"})
        admin.close()
    assert (fresh / "admin.key").read_text().strip() == real_cluster.api_key
    token = fresh / "node.token"
    assert token.read_text() == (real_cluster.data_dir / "node.token").read_text()
    assert token.stat().st_mode & 0o777 == 0o600
    assert token.stat().st_uid == (real_cluster.data_dir / "node.token").stat().st_uid  # the agent's
    assert key_files(fresh) == key_files(real_cluster.data_dir)
    store = Store(sqlite_url(fresh))
    try:
        key = store.authenticate(real_cluster.api_key)
        assert key is not None
        service = CredentialService.open(store, fresh)
        (record,) = [r for r in service.credentials.list_credentials(key.org_id, None) if r.name == name]
        assert service.backend(record.vault).get(record.vault_ref or "") == canary.encode()
    finally:
        store.close()
