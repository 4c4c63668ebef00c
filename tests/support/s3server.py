"""A real S3 + KMS protocol server on loopback for tests: moto in server mode, as a subprocess.

`s3_server` (session scope) starts `python -m moto.server -H 127.0.0.1 -p <free port>` in its own process
group, waits until it answers an S3 ListBuckets, sets dummy AWS credentials in the environment (moto
accepts any; they keep boto3 from looking for real ones and keep every request on loopback), and yields an
`S3Server`. At the end the process group is killed and the test fails if the server is still alive.

moto is one HTTP server for every AWS service it emulates: the same endpoint serves S3 and KMS.
Several modules may bind the fixture (`s3_server = tests.support.s3server.s3_server`); they share one
server per test process (reference-counted, tests/support/shared_server.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import pytest

from tests.support.shared_server import SharedServer

if TYPE_CHECKING:
    from mypy_boto3_kms.client import KMSClient
    from mypy_boto3_s3.client import S3Client

REGION = "us-east-1"
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "space-test",
    "AWS_SECRET_ACCESS_KEY": "space-test-secret",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",  # never probe 169.254.169.254 for credentials
}


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log_path: Path
    buckets: set[str] = field(default_factory=set)

    @property
    def region(self) -> str:
        return REGION

    def client(self) -> S3Client:
        return boto3.session.Session(region_name=REGION).client("s3", endpoint_url=self.endpoint)

    def kms_client(self) -> KMSClient:
        return boto3.session.Session(region_name=REGION).client("kms", endpoint_url=self.endpoint)

    def create_bucket(self, name: str) -> None:
        if name not in self.buckets:
            client = self.client()
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=name)
            self.buckets.add(name)

    def bucket_url(self, name: str, prefix: str = "") -> str:
        """An `open_store` URL for bucket `name` (created if needed), optionally under `prefix`."""
        self.create_bucket(name)
        path = f"/{prefix.strip('/')}" if prefix.strip("/") else ""
        return f"s3://{name}{path}?endpoint={self.endpoint}&region={REGION}"

    @property
    def kms_url(self) -> str:
        """An `open_key_service` URL for the same server's KMS."""
        return f"kms://?endpoint={self.endpoint}&region={REGION}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(endpoint: str) -> bool:
    client = boto3.session.Session(region_name=REGION).client("s3", endpoint_url=endpoint)
    try:
        client.list_buckets()
    except Exception:
        return False
    finally:
        client.close()
    return True


def start_server(timeout: float = 60.0) -> S3Server:
    os.environ.update(DUMMY_CREDENTIALS)
    last_error = ""
    for _attempt in range(3):  # the free port may be taken between probing and binding
        port = _free_port()
        log_dir = Path(tempfile.mkdtemp(prefix="space-moto-", dir="/var/tmp"))
        log_path = log_dir / f"moto-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed whole at the end
                env={**os.environ, **DUMMY_CREDENTIALS},
            )
        server = S3Server(f"http://127.0.0.1:{port}", process, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            if _answers(server.endpoint):
                return server
            time.sleep(0.1)
        last_error = log_path.read_text(errors="replace")[-2000:]
        stop_server(server)
    pytest.fail(f"moto server did not start on loopback: {last_error}")


def stop_server(server: S3Server) -> None:
    process = server.process
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    # Children of the server (none expected) would still be in its process group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
        raise RuntimeError(f"moto server process group {process.pid} outlived its leader")
    shutil.rmtree(server.log_path.parent, ignore_errors=True)


_shared = SharedServer(start_server, stop_server)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with _shared.use() as server:
        yield server
