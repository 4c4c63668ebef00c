"""The database part of a backup: SQLite through its online backup API, PostgreSQL through pg_dump/pg_restore.

Invariants:
- A SQLite copy is one consistent snapshot taken while the control plane runs: `Connection.backup` in a
  single step holds a read transaction for the whole copy (WAL: writers go on, the copy sees the database
  as of its start); the copy is integrity-checked and its schema revision read from the copy itself.
- A PostgreSQL dump is pg_dump's custom format (one snapshot of the database, compressed); the schema
  revision is read before and after it, and a migration in between refuses the backup. The password of a
  URL goes to pg_dump/pg_restore in PGPASSWORD, never on a command line (ps shows those).
- A target is refused when something may be using it: a process holding the SQLite file (or its WAL)
  open, or another session on the PostgreSQL database (`errors.Conflict`, reason `control_plane_running`);
  and when it already holds a control plane's database, unless the caller says to replace it
  (`errors.AlreadyExists`, reason `target_not_empty`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sqlite3
import subprocess
from typing import Final

import sqlalchemy as sa
from sqlalchemy.engine import URL

from space.controlplane.store.engine import normalize_url
from space.core import errors

PG_TIMEOUT_S: Final = 3600.0
SQLITE_SIDE_FILES: Final = ("-wal", "-shm", "-journal")


def _revision_of(connection: sqlite3.Connection) -> str:
    try:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.DatabaseError as exc:
        raise errors.InvalidState(
            f"the database has no SPACE schema ({exc})", state="unmigrated", reason="no_schema"
        ) from None
    if row is None:
        raise errors.InvalidState("the database has no schema revision", state="unmigrated")
    return str(row[0])


def sqlite_snapshot(database: pathlib.Path, copy: pathlib.Path) -> str:
    """Copy the live SQLite database `database` into `copy` (a new file); its schema revision."""
    if not database.is_file() or database.stat().st_size == 0:
        raise errors.NotFound(f"no control-plane database at {database}")
    source = sqlite3.connect(database, timeout=30.0)  # a reader: never writes
    try:
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        target = sqlite3.connect(copy)
        try:
            source.backup(target)  # pages=-1: the whole database in one step, one read snapshot
            check = target.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise errors.ArtifactCorrupt(f"the copy of {database} fails SQLite's check: {check}")
            # The copy stands alone: no WAL beside it (a restored database starts in rollback mode and the
            # control plane switches it to WAL again at its first connection).
            target.execute("PRAGMA journal_mode = DELETE")
            return _revision_of(target)
        finally:
            target.close()
    except sqlite3.Error as exc:
        raise errors.Unavailable(f"cannot read {database}: {exc}") from None
    finally:
        source.close()


def sqlite_revision(path: pathlib.Path) -> str:
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _revision_of(connection)
    finally:
        connection.close()


def holders(paths: list[pathlib.Path]) -> list[int]:
    """Pids of the processes (other than this one) with any of `paths` open."""
    wanted = {str(path) for path in paths}
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
        except OSError:
            continue  # gone, or not ours to look at
        if links & wanted:
            found.append(int(proc.name))
    return found


def check_sqlite_target(database: pathlib.Path, *, replace: bool) -> None:
    files = [database, *(database.with_name(database.name + s) for s in SQLITE_SIDE_FILES)]
    busy = holders(files)
    if busy:
        raise errors.Conflict(
            f"a process has {database} open (pids {busy[:5]}): stop the control plane before restoring",
            reason="control_plane_running", pids=busy[:5],
        )  # fmt: skip
    if database.exists() and database.stat().st_size > 0 and not replace:
        raise errors.AlreadyExists(
            f"{database} already holds a control plane's database (--force replaces it)",
            reason="target_not_empty",
        )  # fmt: skip


def install_sqlite(copy: pathlib.Path, database: pathlib.Path) -> None:
    """Put the restored copy in place; the side files of the database it replaces go first (a WAL left
    beside another database would be replayed into it)."""
    for suffix in SQLITE_SIDE_FILES:
        database.with_name(database.name + suffix).unlink(missing_ok=True)
    os.chmod(copy, 0o600)
    os.replace(copy, database)


# -- PostgreSQL ---------------------------------------------------------------------------------------------
def _pg_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise errors.Unavailable(f"{name} is not installed (Debian: apt-get install postgresql-client)")
    return found


def _libpq(url: str | URL) -> tuple[str, dict[str, str]]:
    """A libpq connection URI for `url` without its password, and the environment that carries it."""
    parsed = normalize_url(url)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    if parsed.password:
        env["PGPASSWORD"] = str(parsed.password)
    plain = parsed.set(drivername="postgresql", password=None)
    return plain.render_as_string(hide_password=False), env


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=PG_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise errors.Timeout(f"{what} did not finish in {PG_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise errors.Unavailable(f"{what} failed: {done.stderr.strip()[-2000:]}")


def _engine(url: str | URL) -> sa.Engine:
    return sa.create_engine(normalize_url(url), poolclass=sa.pool.NullPool)


def pg_revision(url: str | URL) -> str | None:
    engine = _engine(url)
    try:
        with engine.connect() as connection:
            if not sa.inspect(connection).has_table("alembic_version"):
                return None
            return connection.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    except sa.exc.OperationalError as exc:
        raise errors.Unavailable(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()


def pg_dump(url: str | URL, dump: pathlib.Path) -> str:
    """Dump the database at `url` into `dump` (custom format); its schema revision."""
    before = pg_revision(url)
    if before is None:
        raise errors.InvalidState("the database has no SPACE schema", state="unmigrated", reason="no_schema")
    uri, env = _libpq(url)
    _run([_pg_tool("pg_dump"), "--format=custom", "--no-owner", "--no-privileges", f"--file={dump}",
          f"--dbname={uri}"], env, "pg_dump")  # fmt: skip
    if pg_revision(url) != before:
        raise errors.Conflict("the database was migrated during the backup: run it again", reason="migrated")
    os.chmod(dump, 0o600)
    return before


def check_pg_target(url: str | URL, *, replace: bool) -> None:
    engine = _engine(url)
    try:
        with engine.connect() as connection:
            others = connection.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid()")
            ).scalar()  # fmt: skip
            tables = sa.inspect(connection).get_table_names()
    except sa.exc.OperationalError as exc:
        raise errors.Unavailable(f"cannot reach the target database: {exc.orig}") from None
    finally:
        engine.dispose()
    if others:
        raise errors.Conflict(
            f"{others} other session(s) use the target database: stop the control plane before restoring",
            reason="control_plane_running",
        )  # fmt: skip
    if tables and not replace:
        raise errors.AlreadyExists(
            "the target database is not empty (--force replaces its tables)", reason="target_not_empty"
        )


def pg_restore(dump: pathlib.Path, url: str | URL, *, replace: bool) -> None:
    uri, env = _libpq(url)
    clean = ["--clean", "--if-exists"] if replace else []
    _run([_pg_tool("pg_restore"), "--no-owner", "--no-privileges", "--exit-on-error", "--single-transaction",
          *clean, f"--dbname={uri}", str(dump)], env, "pg_restore")  # fmt: skip
