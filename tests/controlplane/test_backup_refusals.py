"""`space backup create|restore` refusals, through the CLI, on a real SQLite control-plane state made in
process (migrated database, an org with a key, a sealed credential, node token, key directory): every bad
archive or target is refused with its typed error and exit code before anything is installed.

- tampered (a member's bytes changed under the original manifest), truncated, a member the manifest does not
  list, a path-traversing member name (in the manifest or the tar), a link member, an oversized member, a
  newer schema revision;
- a running control plane on the target (a process holding its database open; a live `space up`
  supervisor), a target that already holds a control plane (and `--force`);
- an older schema is upgraded by the normal migrations after the restore; the archive is 0600 and never
  written over an existing file.

The whole path with running control planes (SQLite and PostgreSQL) is tests/controlplane/test_backup.py.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
from collections.abc import Callable

import pytest
from typer.testing import CliRunner, Result

from space.cli import main as cli_main
from space.controlplane.backup.archive import FILE_MAX_BYTES
from space.controlplane.backup.engines import sqlite_revision
from space.controlplane.credentials.service import CredentialService
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import head_revision, migrate
from space.controlplane.store.store import Store
from space.crypto.keys import LocalKeyService

#: A process that keeps the file argv[1] open (as a control plane keeps its database) until it is killed.
HOLD_OPEN = "import sys, time; f = open(sys.argv[1]); print(1, flush=True); time.sleep(99)"
Edit = Callable[[list[tuple[tarfile.TarInfo, bytes]]], list[tuple[tarfile.TarInfo, bytes]]]


def space(*args: str) -> Result:
    return CliRunner().invoke(cli_main.app, ["backup", *args])


def make_state(data_dir: pathlib.Path, revision: str = "head") -> str:
    """A control plane's state in `data_dir`: its database at `revision`, org admin key (returned), keys."""
    data_dir.mkdir(parents=True)
    url = sqlite_url(data_dir)
    migrate(url, revision)
    (data_dir / "node.token").write_text("cluster-token\n")
    (data_dir / "node.token").chmod(0o600)
    LocalKeyService((data_dir / "keys").resolve()).create_key("org-key")
    if revision != "head":
        (data_dir / "credentials.master.key").write_bytes(os.urandom(32))
        (data_dir / "credentials.master.key").chmod(0o600)
        return ""
    store = Store(url)
    try:
        org = store.create_org("default")
        _record, secret = store.create_api_key(None, org.id, "admin")
        CredentialService.open(store, data_dir).vault.put("org.token", b"secret-value")
    finally:
        store.close()
    return secret


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("backup-refusals")
    make_state(root / "source")
    result = space("create", "--data-dir", str(root / "source"), "--output", str(root / "backup.tar.gz"))
    assert result.exit_code == 0, result.output
    return root / "backup.tar.gz"


def entries(path: pathlib.Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path, "r:gz") as tar:
        return [(info, tar.extractfile(info).read() if info.isreg() else b"") for info in tar]  # type: ignore[union-attr]


def rewrite(source: pathlib.Path, target: pathlib.Path, edit: Edit) -> pathlib.Path:
    with tarfile.open(target, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, body in edit(entries(source)):
            info.size = len(body) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(body) if info.isreg() else None)
    return target


def with_manifest(members: list[tuple[tarfile.TarInfo, bytes]], change: Callable[[dict], None]) -> list:  # type: ignore[type-arg]
    manifest = json.loads(members[0][1])
    change(manifest)
    return [(members[0][0], json.dumps(manifest).encode()), *members[1:]]


def refused(archive: pathlib.Path, target: pathlib.Path, code: int, error: str) -> str:
    result = space("restore", str(archive), "--data-dir", str(target))
    assert result.exit_code == code, result.output
    assert f"error: {error}:" in result.output, result.output
    assert not (target / "controlplane.db").exists() and not (target / "credentials.master.key").exists()
    assert [p.name for p in target.iterdir()] == [] if target.exists() else True  # no staging left
    return result.output


def test_the_archive_is_private_and_never_overwrites(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert archive.stat().st_mode & 0o777 == 0o600
    names = [info.name for info, _body in entries(archive)]
    assert names[0] == "manifest.json"
    assert {"database/controlplane.db", "files/credentials.master.key", "files/node.token"} <= set(names)
    assert any(name.startswith("keys/lk-") for name in names)
    assert not any(name.endswith(".lock") for name in names)
    before = archive.read_bytes()
    result = space("create", "--data-dir", str(archive.parent / "source"), "--output", str(archive))
    assert result.exit_code == 4 and "already_exists" in result.output, result.output
    assert archive.read_bytes() == before
    missing = space("create", "--data-dir", str(tmp_path / "nothing"), "--output", str(tmp_path / "x.tgz"))
    assert missing.exit_code == 3 and not (tmp_path / "x.tgz").exists(), missing.output


def test_a_tampered_member_is_refused(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    def flip(members: list[tuple[tarfile.TarInfo, bytes]]) -> list[tuple[tarfile.TarInfo, bytes]]:
        return [(i, b[:-1] + bytes([b[-1] ^ 1]) if i.name == "files/node.token" else b) for i, b in members]

    output = refused(rewrite(archive, tmp_path / "t.tgz", flip), tmp_path / "target", 7, "artifact_corrupt")
    assert "sha256" in output


def test_a_truncated_archive_is_refused(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    refused(cut, tmp_path / "target", 7, "artifact_corrupt")
    # Whole gzip and tar, but the last member left out: the manifest names it.
    short = tmp_path / "short.tgz"
    refused(
        rewrite(archive, short, lambda members: members[:-1]), tmp_path / "target2", 7, "artifact_corrupt"
    )
    assert gzip.decompress(short.read_bytes())  # a well-formed archive: only the manifest says it is short


def test_unlisted_traversing_and_link_members_are_refused(
    archive: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    outside = tmp_path / "evil"
    for name, kind in (
        ("files/extra", tarfile.REGTYPE), ("../../evil", tarfile.REGTYPE), ("/etc/evil", tarfile.REGTYPE),
        ("keys/link", tarfile.SYMTYPE), ("keys/hard", tarfile.LNKTYPE),
    ):  # fmt: skip
        extra = tarfile.TarInfo(name)
        extra.type, extra.linkname = kind, str(outside)

        def add(members: list, info: tarfile.TarInfo = extra) -> list:  # type: ignore[type-arg]
            return [*members[:2], (info, b"payload"), *members[2:]]

        bad = rewrite(archive, tmp_path / f"bad-{kind!r}-{len(name)}.tgz", add)
        refused(bad, tmp_path / f"target-{len(name)}{kind!r}", 7, "artifact_corrupt")
    assert not outside.exists()

    def listed(members: list) -> list:  # type: ignore[type-arg]
        return with_manifest(members, lambda m: m["members"][1].update(name="files/../../evil"))

    output = refused(
        rewrite(archive, tmp_path / "listed.tgz", listed), tmp_path / "t-listed", 7, "artifact_corrupt"
    )
    assert "unsafe" in output and not outside.exists()


def test_an_oversized_member_is_refused(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    big = os.urandom(16) * ((FILE_MAX_BYTES // 16) + 1)

    def grow(members: list) -> list:  # type: ignore[type-arg]
        digest = hashlib.sha256(big).hexdigest()
        members = with_manifest(
            members, lambda m: m["members"].append({"name": "keys/big", "size": len(big), "sha256": digest})
        )
        return [*members, (tarfile.TarInfo("keys/big"), big)]

    output = refused(rewrite(archive, tmp_path / "big.tgz", grow), tmp_path / "target", 7, "too_large")
    assert "keys/big" in output


def test_a_newer_schema_is_refused(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    def newer(members: list) -> list:  # type: ignore[type-arg]
        return with_manifest(members, lambda m: m.update(schema_revision="9999"))

    output = refused(rewrite(archive, tmp_path / "new.tgz", newer), tmp_path / "target", 8, "conflict")
    assert "9999" in output and "newer" in output


def test_a_target_in_use_or_not_empty_is_refused(archive: pathlib.Path, tmp_path: pathlib.Path) -> None:
    target = tmp_path / "target"
    assert space("restore", str(archive), "--data-dir", str(target)).exit_code == 0
    again = space("restore", str(archive), "--data-dir", str(target))
    assert again.exit_code == 4 and "already_exists" in again.output, again.output
    # A process with the database open (a control plane that is not `space up`'s) ...
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN,
         str(target / "controlplane.db")], stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"1\n"
        busy = space("restore", str(archive), "--data-dir", str(target), "--force")
        assert busy.exit_code == 4 and "control plane" in busy.output, busy.output
        # ... and a live `space up` supervisor of the target.
        (target / "up.json").write_text(json.dumps({"pid": holder.pid}))
        running = space("restore", str(archive), "--data-dir", str(tmp_path / "other"), "--force")
        assert running.exit_code == 0, running.output  # another directory: not running
        supervised = space("restore", str(archive), "--data-dir", str(target), "--force")
        assert supervised.exit_code == 4 and "SPACE is running" in supervised.output, supervised.output
    finally:
        holder.kill()
        holder.wait()
    (target / "up.json").unlink()
    assert space("restore", str(archive), "--data-dir", str(target), "--force").exit_code == 0


def test_an_older_schema_is_upgraded_after_the_restore(tmp_path: pathlib.Path) -> None:
    make_state(tmp_path / "old", revision="0010")
    backup = tmp_path / "old.tar.gz"
    assert space("create", "--data-dir", str(tmp_path / "old"), "-o", str(backup)).exit_code == 0
    assert json.loads(entries(backup)[0][1])["schema_revision"] == "0010"
    result = space("restore", str(backup), "--data-dir", str(tmp_path / "new"))
    assert result.exit_code == 0, result.output
    assert sqlite_revision(tmp_path / "new" / "controlplane.db") == head_revision() != "0010"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "new").iterdir() if p.is_file()}
    assert modes["credentials.master.key"] == modes["node.token"] == modes["controlplane.db"] == 0o600
