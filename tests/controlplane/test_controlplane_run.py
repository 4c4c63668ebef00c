"""`space controlplane run|token create|admin-key create` (ADR 0070) on a real PostgreSQL and the S3 server,
and the enrolment check `space node join` makes before it starts anything (real processes, no node)."""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from space.cli.node_join import probe_control_plane
from space.controlplane.store.migrate import head_revision
from space.core import errors
from tests.support import cluster as c
from tests.support import postgres
from tests.support.egress_net import UpstreamCA
from tests.support.s3server import DUMMY_CREDENTIALS, S3Server

postgres_url = postgres.postgres_url


def _space(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", *argv], capture_output=True, text=True, timeout=120,
        env=c._child_env(**(env or {})), cwd=c.REPO, check=False,
    )  # fmt: skip


class Replica(c.Service):
    """`space controlplane run` as an operator starts it."""

    def __init__(self, root: pathlib.Path, name: str, args: list[str], *, scheme: str = "http") -> None:
        self.port = c.free_port()
        self.scheme = scheme
        argv = [sys.executable, "-m", "space.cli.main", "controlplane", "run",
                "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(root / name), *args]  # fmt: skip
        super().__init__(name, argv, root / f"{name}.log")

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


@pytest.fixture
def database(postgres_url: str) -> str:
    return postgres.new_database(postgres_url)


@pytest.fixture
def fleet_root() -> Iterator[pathlib.Path]:
    root = pathlib.Path("/var/tmp") / f"space-test-fleet-{secrets.token_hex(4)}"
    root.mkdir(mode=0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _shared_config(root: pathlib.Path, s3: S3Server) -> pathlib.Path:
    """The [objects] endpoint and credentials, and a tunable, in one owner-only file."""
    token = root / "node.token"
    token.write_text(secrets.token_urlsafe(32) + "\n")
    token.chmod(0o600)
    config = root / "space.toml"
    config.write_text(
        f'[controlplane]\nnode_token_file = "{token}"\nkeys_dir = "{root / "keys"}"\napi_request_burst = 77\n'
        f'[objects]\nendpoint = "{s3.endpoint}"\nregion = "us-east-1"\n'
        f'access_key_id = "{DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]}"\n'
        f'secret_access_key = "{DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}"\n'
    )
    config.chmod(0o600)
    return config


def test_two_replicas_share_postgresql_and_s3_and_enrol_with_a_single_use_token(
    database: str, s3_server: S3Server, fleet_root: pathlib.Path
) -> None:
    s3_server.create_bucket("fleet")
    config = _shared_config(fleet_root, s3_server)
    common = ["--config", str(config), "--database", database, "--objects", "s3://fleet/cp"]
    replicas = [Replica(fleet_root, f"cp{i}", common) for i in (1, 2)]
    try:
        for replica in replicas:  # both at once: one migrates under the lock, the other waits
            replica.start()
        for replica in replicas:
            c.wait_for(
                lambda r=replica: _healthy(r), timeout=c.START_TIMEOUT_S, interval=0.1, what=replica.name
            )
        engine = sa.create_engine(database)
        try:
            with engine.connect() as conn:
                assert (
                    conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
                    == head_revision()
                )
        finally:
            engine.dispose()
        made = _space("controlplane", "admin-key", "create", "--database", database)
        assert made.returncode == 0, made.stderr
        admin_key = made.stdout.strip()
        answer = httpx.get(
            f"{replicas[1].url}/v1/cluster/nodes", headers={"Authorization": f"Bearer {admin_key}"}
        )
        assert answer.status_code == 200, answer.text
        made = _space("controlplane", "token", "create", "--config", str(config), "--database", database)
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip()
        assert len(token) >= 32
        probe_control_plane(replicas[0].url, token)  # accepted, and not used up by the check
        probe_control_plane(replicas[1].url, token)
        with pytest.raises(errors.Unauthenticated, match="--token is refused"):
            probe_control_plane(replicas[0].url, token + "x")
        enrol = httpx.post(
            f"{replicas[1].url}/v1/nodes/register", headers={"Authorization": f"Bearer {token}"},
            json={"url": "http://192.0.2.10:7070", "token": secrets.token_urlsafe(32)},
        )  # fmt: skip
        assert enrol.status_code == 200, enrol.text
        with pytest.raises(errors.Unauthenticated, match="used already, has expired"):
            probe_control_plane(replicas[0].url, token)  # a single-use token, spent on the other replica
    finally:
        for replica in replicas:
            replica.stop()
    for replica in replicas:
        assert "Traceback" not in replica.log_tail(20000), replica.log_tail()


def _healthy(replica: Replica, verify: bool | ssl.SSLContext = True) -> bool:
    replica.check_alive()
    try:
        return httpx.get(f"{replica.url}/healthz", timeout=2.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def test_tls_replica_is_verified_with_the_ca_file(fleet_root: pathlib.Path) -> None:
    ca = UpstreamCA(fleet_root)
    pem = ca.issue("cp.pem", ["localhost"], ["127.0.0.1"])
    replica = Replica(fleet_root, "tls", ["--tls-cert", str(pem), "--tls-key", str(pem)], scheme="https")
    try:
        replica.start()
        trusting = ssl.create_default_context(cafile=ca.ca_file)
        c.wait_for(
            lambda: _healthy(replica, verify=trusting), timeout=c.START_TIMEOUT_S, interval=0.1, what="TLS"
        )
        with pytest.raises(errors.Unavailable, match=r"not trusted .* --ca-file"):
            probe_control_plane(replica.url, None)
        probe_control_plane(replica.url, None, ca_file=str(ca.ca_file))
        with pytest.raises(errors.Unauthenticated):
            probe_control_plane(replica.url, "not-a-token", ca_file=str(ca.ca_file))
    finally:
        replica.stop()


def test_unreachable_control_plane_is_named() -> None:
    url = f"http://127.0.0.1:{c.free_port()}"
    with pytest.raises(errors.Unavailable, match=f"{url} is unreachable"):
        probe_control_plane(url, "token")


@pytest.mark.parametrize(
    ("argv", "expected", "code"),
    [
        (["controlplane", "run", "--listen", "0.0.0.0:80;reboot"], "--listen", 2),
        (["controlplane", "run", "--database", "mysql://db.test/x"], "--database", 2),
        (
            ["controlplane", "run", "--tls-cert", "/nonexistent.pem"],
            "needs both a certificate and its key",
            2,
        ),
        (["controlplane", "run", "--data-dir", "relative/dir"], "--data-dir", 2),
        (
            ["controlplane", "token", "create", "--database", "postgresql://x@/db?host=/nonexistent"],
            "error",
            None,
        ),
        (["controlplane", "token", "create", "--uses", "0"], "--uses", 2),
        (
            ["controlplane", "admin-key", "create", "--org", "x" * 5000, "--data-dir", "/nonexistent/x"],
            "error",
            None,
        ),
        (["node", "join", "file:///etc/passwd", "--token", "t"], "--control-plane", 2),
        (["node", "join", "http://127.0.0.1:1", "--token", "t\x1b[2J"], "unprintable", 2),
        (["node", "join", "--token", "t"], "give CONTROL_PLANE_URL", 2),
    ],
)
def test_hostile_options_are_refused(
    argv: list[str], expected: str, code: int | None, fleet_root: pathlib.Path
) -> None:
    done = _space(*argv, env={"SPACE_CONTROLPLANE_DATA_DIR": str(fleet_root / "cp")})
    assert done.returncode != 0
    assert code is None or done.returncode == code  # 2: a configuration error
    assert expected in done.stderr + done.stdout
    assert not (fleet_root / "cp").exists() or argv[1] != "run"  # nothing was started


def test_environment_overrides_the_file_for_the_server(fleet_root: pathlib.Path) -> None:
    """The file's tunables reach the server as its variables, unless the environment already sets them."""
    config = fleet_root / "space.toml"
    config.write_text("[controlplane]\nnode_lost_after_s = 2\nfence_grace_s = 1\n")
    replica = Replica(fleet_root, "env", ["--config", str(config)])
    replica.extra_env = {"SPACE_FENCE_GRACE_S": "3"}  # now above the file's node_lost_after_s: refused
    replica.start()
    assert replica.proc is not None
    replica.proc.wait(60)
    assert replica.proc.returncode != 0
    assert "SPACE_FENCE_GRACE_S" in replica.log_tail() or "fence" in replica.log_tail().lower()
    assert os.environ.get("SPACE_FENCE_GRACE_S") is None
