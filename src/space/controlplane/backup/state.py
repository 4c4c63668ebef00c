"""What a control plane's backup holds, and making and restoring one (`space backup create|restore`).

The control-plane state a restore needs (ADR 0062):
- the database (every record: orgs, projects, API key hashes, sandboxes, snapshots and the object-store
  keys they point at, nodes with their sealed RPC tokens, enrolment token hashes, credentials' metadata and
  their values sealed under the master key);
- `credentials.master.key`: without it no stored credential value opens;
- the cluster's `node.token`: it seals the nodes' RPC tokens in the database and enrols nodes;
- the embedded key service's directory (`keys/`): the org keys that wrap the data keys of every suspended
  sandbox and snapshot in object storage (absent when no artifact was ever encrypted);
- `admin.key` when there is one (`space up`'s bootstrap admin key, so the restored `space up` prints it).
Object storage is not in the archive: it already holds the snapshots and suspended sandboxes, and the
rows restored here point at them.

Invariants:
- The archive holds every secret above: it is written 0600 whatever the umask, never over an existing
  file (created under a temporary name and linked into place, so a failed backup leaves no archive).
- A restore verifies the whole archive (space.controlplane.backup.archive) into a private staging
  directory before it touches the target, refuses a target in use or already holding a control plane
  (space.controlplane.backup.engines; `replace` allows the latter), refuses a schema revision this SPACE
  does not know (newer: `errors.Conflict`, reason `schema_too_new`) and a different engine than the
  target's; it installs the database first and the files after, each file 0600, then runs the normal
  migrations, so an older schema is upgraded like at any start.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from alembic.script import ScriptDirectory
from sqlalchemy import make_url

from space.controlplane.backup import engines
from space.controlplane.backup.archive import (
    ENGINES,
    FILES,
    Manifest,
    Member,
    now_utc,
    read_archive,
    sha256_of,
    staged_path,
    valid_name,
    write_archive,
)
from space.controlplane.credentials.service import MASTER_KEY_FILENAME
from space.controlplane.store.engine import SQLITE_FILENAME, is_sqlite
from space.controlplane.store.migrate import alembic_config, migrate
from space.core import errors
from space.core.versions import space_version

#: files/credentials.master.key (MASTER_KEY_FILENAME), files/node.token, files/admin.key.
MASTER_KEY_MEMBER, NODE_TOKEN_MEMBER, ADMIN_KEY_MEMBER = FILES
#: The user `space up` runs its node agent as, who reads node.token (as in space.controlplane.local).
AGENT_USER = "space"


@dataclass(frozen=True)
class Installation:
    """Where one control plane keeps its state: the data directory (master key, admin key, and the SQLite
    database unless `database_url` names another), the node token file and the key service's directory
    (defaults: in the data directory, as `space up` and the server's flags have them)."""

    data_dir: pathlib.Path
    database_url: str | None = None
    node_token_file: pathlib.Path | None = None
    keys_dir: pathlib.Path | None = None

    @property
    def engine(self) -> str:
        return "sqlite" if self.database_url is None or is_sqlite(self.database_url) else "postgresql"

    @property
    def sqlite_path(self) -> pathlib.Path:
        if self.database_url is not None:
            database = make_url(self.database_url).database
            if not database or database == ":memory:":
                raise errors.InvalidArgument("a SQLite database to back up must be a file", field="database")
            return pathlib.Path(database).resolve()
        return self.data_dir.resolve() / SQLITE_FILENAME

    @property
    def url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"

    @property
    def token_path(self) -> pathlib.Path:
        return self.node_token_file or self.data_dir / "node.token"

    @property
    def keys_path(self) -> pathlib.Path:
        return self.keys_dir or self.data_dir / "keys"

    def files(self) -> dict[str, pathlib.Path]:
        """Member name → path of every file of this installation that a backup holds (module docs)."""
        found = {
            MASTER_KEY_MEMBER: self.data_dir / MASTER_KEY_FILENAME,
            NODE_TOKEN_MEMBER: self.token_path,
            ADMIN_KEY_MEMBER: self.data_dir / "admin.key",
        }
        keys = self.keys_path
        if keys.is_dir():
            for path in sorted(keys.rglob("*")):
                name = f"keys/{path.relative_to(keys).as_posix()}"
                if path.is_file() and not path.is_symlink() and valid_name(name):  # not the .lock files
                    found[name] = path
        return found


def known_revisions() -> set[str]:
    return {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def default_output(directory: pathlib.Path) -> pathlib.Path:
    stamp = now_utc().replace(":", "").replace("-", "")
    return directory / f"space-backup-{stamp}.tar.gz"


@contextlib.contextmanager
def _staging(directory: pathlib.Path, prefix: str) -> Iterator[pathlib.Path]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=directory))  # 0700
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _copy_private(source: pathlib.Path, target: pathlib.Path) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out, open(source, "rb") as handle:
        shutil.copyfileobj(handle, out)


def create_backup(installation: Installation, output: pathlib.Path) -> Manifest:
    """Write the backup of `installation` to `output` (which must not exist); its manifest."""
    files = installation.files()
    for required in (MASTER_KEY_MEMBER, NODE_TOKEN_MEMBER):
        if not files[required].is_file():
            raise errors.NotFound(f"no {files[required]}: not a control plane's state (or pass where it is)")
    if output.exists() or output.is_symlink():
        raise errors.AlreadyExists(f"{output} exists: a backup never overwrites a file")
    engine = installation.engine
    with _staging(output.parent, ".space-backup-") as staging:
        database = staging / "database"
        if engine == "sqlite":
            revision = engines.sqlite_snapshot(installation.sqlite_path, database)
        else:
            revision = engines.pg_dump(installation.url, database)
        sources = {ENGINES[engine]: database}
        for index, (name, path) in enumerate(files.items()):
            if path.is_file():
                sources[name] = staging / f"file-{index:05d}"
                _copy_private(path, sources[name])  # hashed and archived from one private copy
        members = tuple(Member(name, *sha256_of(path)) for name, path in sources.items())
        manifest = Manifest(engine, revision, now_utc(), space_version(), members)
        partial = staging / "archive"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask: the archive holds secrets
        with os.fdopen(fd, "wb") as handle:
            write_archive(handle, manifest, sources)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(partial, output)
        except FileExistsError:
            raise errors.AlreadyExists(f"{output} exists: a backup never overwrites a file") from None
    return manifest


def _accept(manifest: Manifest, installation: Installation) -> None:
    if manifest.engine != installation.engine:
        raise errors.InvalidArgument(
            f"this backup is of a {manifest.engine} database; the target is {installation.engine} "
            "(a backup is restored into the engine it was made from)", field="database",
        )  # fmt: skip
    if manifest.schema_revision not in known_revisions():
        raise errors.Conflict(
            f"the backup's schema revision {manifest.schema_revision!r} is newer than this SPACE "
            f"({space_version()}) knows: restore it with the SPACE version that made it "
            f"({manifest.space_version}) or a later one",
            reason="schema_too_new", revision=manifest.schema_revision,
        )  # fmt: skip


def check_target(installation: Installation, *, replace: bool) -> None:
    """Refuse a target in use or (unless `replace`) already holding a control plane's state."""
    if installation.engine == "sqlite":
        engines.check_sqlite_target(installation.sqlite_path, replace=replace)
    else:
        engines.check_pg_target(installation.url, replace=replace)
    master_key = installation.data_dir / MASTER_KEY_FILENAME
    if master_key.exists() and not replace:
        raise errors.AlreadyExists(
            f"{master_key} exists: the target already has a control plane's keys (--force replaces them)",
            reason="target_not_empty",
        )  # fmt: skip


def restore_backup(archive: pathlib.Path, installation: Installation, *, replace: bool = False) -> Manifest:
    """Restore `archive` into `installation` (module invariants); its manifest."""
    check_target(installation, replace=replace)
    with _staging(installation.data_dir, ".space-restore-") as staging:
        manifest = read_archive(archive, staging, accept=lambda found: _accept(found, installation))
        staged = {member.name: staged_path(staging, i) for i, member in enumerate(manifest.members)}
        database = staged[manifest.database_member]
        if manifest.engine == "sqlite":
            if engines.sqlite_revision(database) != manifest.schema_revision:
                raise errors.ArtifactCorrupt("the backup's database is not at its manifest's revision")
            engines.install_sqlite(database, installation.sqlite_path)
        else:
            engines.pg_restore(database, installation.url, replace=replace)
        targets = installation.files()
        for name, path in staged.items():
            if name.startswith("database/"):
                continue
            target = targets.get(name) or installation.keys_path / name.removeprefix("keys/")
            _install_file(path, target)
        _node_token_readable_by_agent(installation)
    migrate(installation.url)  # an older schema is upgraded here, as at any start
    return manifest


def _install_file(staged: pathlib.Path, target: pathlib.Path) -> None:
    for parent in reversed(target.parents):
        if not parent.exists():
            parent.mkdir(mode=0o700)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    shutil.copyfile(staged, temporary)  # the staging directory may be on another file system
    os.chmod(temporary, 0o600)
    os.replace(temporary, target)


def _node_token_readable_by_agent(installation: Installation) -> None:
    """`space up` runs its node agent as the `space` user, which reads DATA_DIR/node.token to enrol: give
    the restored token to that user as `space up` does (the token is the cluster's, not a root secret)."""
    if installation.node_token_file is not None or os.geteuid() != 0:
        return
    try:
        uid = pwd.getpwnam(AGENT_USER).pw_uid
    except KeyError:
        return
    os.chown(installation.token_path, uid, -1)
