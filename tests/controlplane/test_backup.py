"""`space backup create` of a running control plane and `space backup restore` into a fresh one, for real
processes: a control plane (SQLite, then PostgreSQL) and a fake-driver node agent sharing a local object
store, with data in every part of the state (projects and keys, a sealed credential, a running sandbox with a
named snapshot, a sandbox suspended into the object store under its org's key).

After the restore, a control plane started from the restored state (on SQLite: in the place of the old
one, so the same node reports to it) authenticates the same keys (and not a key made after the backup), lists
the sandboxes and snapshots, opens the credential with the restored master key, reaches the node with the
node tokens sealed in the database (exec), and brings the suspended sandbox back from the object store
(its data key unwrapped by the restored org key).

On PostgreSQL, a restore is refused while a control plane uses the target database and when it is not
empty, and `--force` replaces it. The other refusals (bad archives, busy SQLite targets, schemas) are
tests/controlplane/test_backup_refusals.py.
"""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from space.cli import main as cli_main
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.store import Store
from space.sdk import Space
from tests.support import cluster as c
from tests.support.postgres import new_database, postgres_url  # noqa: F401 - fixture

CANARY = "BACKUP-CANARY-" + secrets.token_hex(8)


def space(*args: str) -> None:
    result = CliRunner().invoke(cli_main.app, ["backup", *args])
    assert result.exit_code == 0, result.output


def state_args(cluster: c.Cluster, data_dir: pathlib.Path) -> list[str]:
    """Where the test cluster keeps what `space up` keeps in its data directory."""
    return ["--data-dir", str(data_dir), "--node-token-file", str(cluster.token_file),
            "--keys-dir", str(cluster.root / "keys")]  # fmt: skip


def restored_args(root: pathlib.Path) -> list[str]:
    return ["--data-dir", str(root / "cp"), "--node-token-file", str(root / "node.token"),
            "--keys-dir", str(root / "keys")]  # fmt: skip


def populate(cluster: c.Cluster) -> dict[str, str]:
    """A project, its member and admin keys, a credential, a running sandbox with a named full snapshot and a
    suspended one (in the object store, encrypted under the org's key)."""
    project = c.new_project(cluster)
    _id, admin = project.new_key("admin")
    answer = project.http(admin).put(
        "/v1/credentials/api", json={"value": CANARY, "hosts": ["api.example.com"]}
    )
    assert answer.status_code in (200, 201), answer.text
    with project.sdk() as sp:
        running = sp.sandboxes.create(limits=c.SMALL)
        running.files.write("f", b"before the backup")
        snapshot = running.snapshots.create(full=True, name="kept")
        suspended = sp.sandboxes.create(limits=c.SMALL)
        suspended.files.write("g", b"suspended")
        assert suspended.suspend().state == "suspended"
    return {"project": project.id, "key": project.key, "running": running.id, "suspended": suspended.id,
            "snapshot": snapshot.id}  # fmt: skip


def check_restored(url: str, data: dict[str, str], after_backup_key: str) -> None:
    headers = {"Authorization": f"Bearer {data['key']}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        listed = http.get("/v1/sandboxes").json()["sandboxes"]
        assert {sb["id"]: sb["state"] for sb in listed} == {
            data["running"]: "running",
            data["suspended"]: "suspended",
        }
        snapshots = http.get("/v1/snapshots", params={"name": "kept"}).json()["snapshots"]
        assert [s["id"] for s in snapshots] == [data["snapshot"]]
        assert http.get("/v1/credentials").json()["credentials"][0]["name"] == "api"
        later = http.get("/v1/sandboxes", headers={"Authorization": f"Bearer {after_backup_key}"})
        assert later.status_code == 401, later.text  # made after the backup: not in it


def decrypts(database_url: str, data_dir: pathlib.Path, data: dict[str, str]) -> bool:
    store = Store(database_url)
    try:
        service = CredentialService.open(store, data_dir)
        project = store.get_project(data["project"])
        assert project is not None
        (record,) = service.credentials.list_credentials(project.org_id, project.id)
        return service.backend(record.vault).get(record.vault_ref or "") == CANARY.encode()
    finally:
        store.close()


def restored_control_plane(
    cluster: c.Cluster, root: pathlib.Path, database_url: str | None
) -> c.ControlPlane:
    made = c.ControlPlane(
        root / "cp", root / "node.token", database_url=database_url, name="restored",
        store_url=cluster.store_url, keys_dir=root / "keys",
    )  # fmt: skip
    cluster.control_planes.append(made)  # stopped with the cluster
    return made


@pytest.fixture
def sqlite_cluster(tmp_path: pathlib.Path) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path / "cluster", object_store=True) as made:
        yield made


def test_sqlite_backup_while_running_restores_into_a_fresh_control_plane(sqlite_cluster: c.Cluster) -> None:
    cluster = sqlite_cluster
    data = populate(cluster)
    archive = cluster.root / "backup.tar.gz"
    space("create", *state_args(cluster, cluster.root / "cp"), "--output", str(archive))
    later_key = _new_key(cluster)
    fresh = cluster.root / "restored"
    space("restore", str(archive), *restored_args(fresh))
    assert decrypts(f"sqlite:///{fresh / 'cp' / 'controlplane.db'}", fresh / "cp", data)
    # The restored control plane takes the old one's place: the node reports to the same address.
    old = cluster.cp
    old.stop()
    restored = restored_control_plane(cluster, fresh, None)
    restored.port = old.port
    restored.argv[restored.argv.index("--port") + 1] = str(old.port)
    restored.start_and_wait()
    check_restored(restored.url, data, later_key)
    sdk = Space(url=restored.url, api_key=data["key"], transport=httpx.HTTPTransport(verify=False))
    with sdk as sp:
        running = sp.sandboxes.get(data["running"])
        assert running.exec("cat f").stdout == "before the backup"  # the node, through its sealed token
        back = sp.sandboxes.get(data["suspended"]).restore()  # the org key unwraps its data key
        assert back.state == "running"
        assert back.files.read("g") == b"suspended"


def _new_key(cluster: c.Cluster) -> str:
    answer = cluster.http(cluster.admin_key).post("/v1/keys", json={"project": "default", "role": "member"})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["key"])


def test_postgres_backup_restores_into_a_fresh_database(tmp_path: pathlib.Path, postgres_url: str) -> None:  # noqa: F811
    # A control plane without a node: the rows are what a PostgreSQL backup adds to the SQLite case above
    # (the node, the object store and the keys directory are the same files on either engine).
    source = new_database(postgres_url)
    store, org_id, _default, admin_key = c.bootstrap(source)
    try:
        project = store.create_project(org_id, "backed-up")
        _record, key = store.create_api_key(project.id, org_id, "admin")
        sandbox_id = store.create_sandbox(project.id, "python").id  # a row (no node here: it stays pending)
    finally:
        store.close()
    token = tmp_path / "node.token"
    token.write_text(secrets.token_urlsafe(32) + "\n")
    (tmp_path / "cp").mkdir()
    running = c.ControlPlane(tmp_path / "cp", token, database_url=source, name="source")
    target, fresh = new_database(postgres_url), tmp_path / "restored"
    restored = c.ControlPlane(fresh / "cp", fresh / "node.token", database_url=target, name="restored")
    try:
        running.start_and_wait()
        with httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
            body = {"value": CANARY, "hosts": ["api.example.com"]}
            stored = admin.put("/v1/credentials/api", json=body, headers={"Authorization": f"Bearer {key}"})
            assert stored.status_code in (200, 201), stored.text
            archive = tmp_path / "backup.tar.gz"
            space("create", "--data-dir", str(tmp_path / "cp"), "--node-token-file", str(token),
                  "--database", source, "--output", str(archive))  # fmt: skip
            later_key = admin.post("/v1/keys", json={"project": "backed-up", "role": "member"}).json()["key"]
        running.stop()
        space("restore", str(archive), *restored_args(fresh), "--database", target)
        data = {"project": project.id, "key": key}
        assert decrypts(target, fresh / "cp", data)
        restored.start_and_wait()
        with httpx.Client(base_url=restored.url, headers={"Authorization": f"Bearer {key}"}) as http:
            assert [sb["id"] for sb in http.get("/v1/sandboxes").json()["sandboxes"]] == [sandbox_id]
            assert [cred["name"] for cred in http.get("/v1/credentials").json()["credentials"]] == ["api"]
            later = http.get("/v1/sandboxes", headers={"Authorization": f"Bearer {later_key}"})
            assert later.status_code == 401, later.text
        again = [str(archive), *restored_args(fresh), "--database", target]
        refused([*again, "--force"], 4, "other session")  # the running control plane's
        restored.stop()
        refused(again, 4, "already_exists")
        space("restore", *again, "--force")  # pg_restore --clean
        assert decrypts(target, fresh / "cp", data)
    finally:
        running.stop()
        restored.stop()


def refused(args: list[str], code: int, what: str) -> None:
    result = CliRunner().invoke(cli_main.app, ["backup", "restore", *args])
    assert result.exit_code == code and what in result.output, result.output
