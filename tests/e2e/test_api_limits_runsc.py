"""The API limits against a whole local installation with the real runsc node (`real_cluster`, ADR 0025):
a read-only key holding its whole stream cap and a reader that stopped reading a download do not slow
another tenant's exec and download on the same node; every process of the installation runs with its
open-file limit raised.

The fake-driver version of these attacks, with small limits and the timeouts, is
tests/controlplane/test_api_limits.py.
"""

from __future__ import annotations

import pathlib
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from space.sdk import Space
from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

STREAMS_PER_KEY = 32  # limits.LimitSettings.streams_per_key
LIMITS = {"cpus": 0.5, "memory_mb": 256}
MIB = 1 << 20


def http(cluster: c.RealCluster, key: str, **kw: object) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.url, headers={"Authorization": f"Bearer {key}"}, timeout=60, verify=False, **kw
    )  # type: ignore[arg-type]


def tenant(cluster: c.RealCluster, admin: httpx.Client, role: str = "member") -> tuple[str, str]:
    """(project name, key) of a new project."""
    name = f"limits-{time.monotonic_ns() % 10**9}"
    assert admin.post("/v1/projects", json={"name": name}).status_code == 201
    answer = admin.post("/v1/keys", json={"project": name, "role": role})
    assert answer.status_code == 201, answer.text
    return name, str(answer.json()["key"])


@pytest.fixture
def two_tenants(real_cluster: c.RealCluster) -> Iterator[tuple[Space, str, Space]]:
    """(SDK of tenant A, a read-only key of A, SDK of tenant B); their sandboxes deleted at the end."""
    with http(real_cluster, real_cluster.api_key) as admin:
        project_a, key_a = tenant(real_cluster, admin)
        answer = admin.post("/v1/keys", json={"project": project_a, "role": "read-only"})
        assert answer.status_code == 201, answer.text
        reader = str(answer.json()["key"])
        _project_b, key_b = tenant(real_cluster, admin)
    transport = httpx.HTTPTransport(verify=False)
    a = Space(url=real_cluster.url, api_key=key_a, transport=transport)
    b = Space(url=real_cluster.url, api_key=key_b, transport=httpx.HTTPTransport(verify=False))
    try:
        yield a, reader, b
    finally:
        for sp in (a, b):
            for sb in sp.sandboxes.list():
                sb.delete()
            sp.close()


def test_a_tenant_at_its_stream_cap_and_a_stalled_reader_do_not_slow_another_tenant(
    real_cluster: c.RealCluster, two_tenants: tuple[Space, str, Space]
) -> None:
    a, reader, b = two_tenants
    sb_a = a.sandboxes.create(limits=LIMITS)
    process = sb_a.processes.start("sleep 3600")
    sb_a.exec(f"head -c {32 * MIB} /dev/urandom > /work/big.bin")
    sb_b = b.sandboxes.create(limits=LIMITS)
    sb_b.exec(f"head -c {32 * MIB} /dev/urandom > /work/big.bin")
    b_exec_before = _timed(lambda: sb_b.exec("echo hi").stdout)

    output = f"/v1/sandboxes/{sb_a.id}/processes/{process.id}/output"
    opened: list[httpx.Response] = []
    stalled: list[socket.socket] = []
    client = http(real_cluster, reader, limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
    try:
        for _ in range(STREAMS_PER_KEY - 1):
            answer = client.send(client.build_request("GET", output, params={"follow": "true"}), stream=True)
            assert answer.status_code == 200, answer.read()
            opened.append(answer)
        # The last slot: a download of 32 MiB that is never read.
        parts = urlsplit(real_cluster.url)
        sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=30)
        sock.sendall(
            f"GET /v1/sandboxes/{sb_a.id}/files?path=/work/big.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {reader}\r\n\r\n".encode()
        )
        stalled.append(sock)
        head = b""
        while b"\r\n\r\n" not in head:  # the answer's head only: the 32 MiB body stays unread
            chunk = sock.recv(1)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        _assert_refused(client, output)

        # Tenant B on the same node: exec and a whole download, while A holds its 32 streams.
        b_exec = _timed(lambda: sb_b.exec("echo hi").stdout)
        started = time.monotonic()
        got = sum(len(chunk) for chunk in sb_b.files.read_stream("/work/big.bin"))
        b_download = time.monotonic() - started
    finally:
        for answer in opened:
            answer.close()
        for sock in stalled:
            sock.close()
        client.close()
        process.signal("SIGKILL")
    alone_ms, beside_ms = b_exec_before * 1000, b_exec * 1000
    print(
        f"B beside A's streams: exec {beside_ms:.1f} ms (alone {alone_ms:.1f}), 32 MiB in {b_download:.2f} s"
    )
    assert got == 32 * MIB
    assert b_exec < max(2.0, 10 * b_exec_before), (
        f"B's exec took {b_exec:.2f}s (before: {b_exec_before:.2f}s)"
    )
    assert b_download < 20.0, f"B's 32 MiB download took {b_download:.1f}s"


def _timed(call: object) -> float:
    started = time.monotonic()
    call()  # type: ignore[operator]
    return time.monotonic() - started


def _assert_refused(client: httpx.Client, path: str) -> None:
    with client.stream("GET", path, params={"follow": "true"}) as answer:
        answer_status = answer.status_code
        if answer_status == 200:
            raise AssertionError("a stream beyond the key's cap was accepted")
        answer.read()
        assert answer_status == 429 and answer.json()["error"]["code"] == "resource_exhausted", answer.text
        assert int(answer.headers["retry-after"]) >= 1


def test_every_process_of_the_installation_runs_with_its_open_file_limit_raised(
    real_cluster: c.RealCluster,
) -> None:
    processes = real_cluster.local.processes
    assert {"helper", "controlplane", "agent"} <= set(processes), set(processes)
    for name in ("helper", "controlplane", "agent"):
        limits = pathlib.Path(f"/proc/{processes[name].pid}/limits").read_text()
        line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
        soft, hard = line.split()[3:5]
        assert soft == hard, f"{name}: soft {soft}, hard {hard}"
