"""A throwaway PostgreSQL server for tests, from Debian's postgresql-15 binaries.

`postgres_url` (session scope) runs initdb + pg_ctl in a fresh directory under /var/tmp (as the `postgres`
system user when the tests run as root, since PostgreSQL refuses to run as root), listening only on a
unix socket in that directory (no TCP port to collide with), with trust authentication and durability
switched off (fsync, synchronous_commit: a test server never needs to survive a power cut). It creates a
database and yields a `postgresql+psycopg://` URL to it; at the end it stops the server (immediate mode),
checks that no server process is left and removes the directory.

The Debian package's own cluster (15/main) is never used. A test module uses the fixture by binding it at
module level: `postgres_url = tests.support.postgres.postgres_url`. Several modules share one server per
test process (reference-counted, tests/support/shared_server.py), so binding it in more than one module
does not start more servers.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from space.controlplane.store.models import Base
from tests.support.host import processes_mentioning
from tests.support.shared_server import SharedServer

PG_BIN = pathlib.Path(os.environ.get("SPACE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_PORT = 5432  # only names the socket file (.s.PGSQL.5432) inside our private directory
# Every table of the control plane store, dependents first (the order TRUNCATE accepts).
STORE_TABLES = [t.name for t in reversed(Base.metadata.sorted_tables)]
DATABASE = "space_test"


@dataclass
class PostgresServer:
    root: pathlib.Path
    data_dir: pathlib.Path
    socket_dir: pathlib.Path
    user: str | None  # the system user the server runs as (None: the current user)

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}&port={PG_PORT}"

    def _run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            user=self.user,
            cwd=self.root,  # the postgres user may not be able to read the caller's cwd
            env={"PATH": f"{PG_BIN}:/usr/bin:/bin", "LC_ALL": "C", "LANG": "C"},
        )

    def pid(self) -> int | None:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            return int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None


def _pg_ctl(server: PostgresServer, *args: str) -> None:
    server._run(str(PG_BIN / "pg_ctl"), "-D", str(server.data_dir), *args)


def start_server() -> PostgresServer:
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL binaries not found in {PG_BIN}: apt-get install -y postgresql")
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-pg-", dir="/var/tmp"))
    user: str | None = None
    if os.geteuid() == 0:
        user = "postgres"
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(root=root, data_dir=root / "data", socket_dir=root, user=user)
    try:
        server._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(server.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        options = (
            f"-k {server.socket_dir} -p {PG_PORT} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        _pg_ctl(server, "-l", str(root / "server.log"), "-o", options, "-w", "-t", "60", "start")
        server._run(
            str(PG_BIN / "createdb"),
            "-h",
            str(server.socket_dir),
            "-p",
            str(PG_PORT),
            "-U",
            "postgres",
            DATABASE,
        )
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: PostgresServer) -> None:
    pid = server.pid()
    if pid is not None:
        # Failing here means "not running" (start failed early); the pid check below is the real test.
        with contextlib.suppress(subprocess.CalledProcessError):
            _pg_ctl(server, "-m", "immediate", "-w", "-t", "30", "stop")
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            raise RuntimeError(f"PostgreSQL test server (pid {pid}) did not stop")
    left = processes_mentioning(str(server.root))
    shutil.rmtree(server.root, ignore_errors=True)
    if left:
        raise RuntimeError(f"processes left behind by the PostgreSQL test server: {left}")


def fresh_database(base_url: str, name: str) -> str:
    """A URL to an empty database `name` on the server of `base_url` (dropped and created again)."""
    admin = sa.create_engine(sa.make_url(base_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return sa.make_url(base_url).set(database=name).render_as_string(hide_password=False)


def new_database(server_url: str) -> str:
    """A new, empty database with a random name on the server of `server_url` (for a module that must not
    share the default database with others)."""
    name = f"space_cp_{secrets.token_hex(4)}"
    engine = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)


def _alive(pid: int) -> bool:
    """True while `pid` runs. A zombie counts as gone: it has exited, and only waits for its parent (the
    init of a container may reap late)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself contain spaces or parentheses.
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


_shared = SharedServer(start_server, stop_server)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with _shared.use() as server:
        yield server.url()
