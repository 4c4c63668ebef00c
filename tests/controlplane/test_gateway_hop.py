"""The gateway's side of the data-plane hop (ADR 0044), on the shared fake cluster (a real control plane
process): the caches of the hot path never outlive a revoked key's documented bound, a big file goes
through without the gateway holding it, and every request is still counted by route."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator

import httpx

from space.controlplane.settings import ControlPlaneSettings
from tests.support import cluster as c
from tests.support.hop import PeakRss

fake_cluster = c.fake_cluster
project = c.project

MiB = 1 << 20
#: The bound docs/security.md states: a key revoked by another replica works at most this long here.
AUTH_CACHE_S = ControlPlaneSettings().auth_cache_s


def _sandbox(client: httpx.Client) -> str:
    created = client.post("/v1/sandboxes", json={"template": "python", "limits": c.SMALL})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _exec_status(client: httpx.Client, sandbox_id: str) -> int:
    return client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true"}, timeout=60).status_code


def test_a_key_revoked_elsewhere_stops_within_the_cache_bound_and_here_at_once(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    sandbox_id = _sandbox(project.http())
    key_id, secret = project.new_key("member")
    client = fake_cluster.http(secret)
    assert _exec_status(client, sandbox_id) == 200  # the key, the project and the sandbox are cached now

    fake_cluster.store.revoke_key(key_id)  # as another replica does: only the database knows
    revoked_at = time.monotonic()
    c.wait_for(
        lambda: _exec_status(client, sandbox_id) == 401, timeout=AUTH_CACHE_S + 30, what="revoked key refused"
    )
    # The first refusal came within the bound (plus one request's time on a loaded machine).
    assert time.monotonic() - revoked_at <= AUTH_CACHE_S + 5.0
    assert client.get(f"/v1/sandboxes/{sandbox_id}").status_code == 401

    key_id, secret = project.new_key("member")
    client = fake_cluster.http(secret)
    assert _exec_status(client, sandbox_id) == 200
    admin = fake_cluster.http(fake_cluster.admin_key)
    assert admin.delete(f"/v1/keys/{key_id}").status_code == 204  # revoked through this replica
    assert _exec_status(client, sandbox_id) == 401  # at once
    assert _exec_status(project.http(), sandbox_id) == 200  # control: other keys go on


def test_64_mib_go_through_the_gateway_without_it_holding_them(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    files = f"/v1/sandboxes/{_sandbox(client)}/files"
    chunk = os.urandom(MiB)
    # Warm the code paths, so that their one-time allocations are not counted.
    assert client.put(files, params={"path": "warm.bin"}, content=chunk, timeout=60).status_code == 200
    assert client.get(files, params={"path": "warm.bin"}, timeout=60).content == chunk
    size = 64 * MiB

    def body() -> Iterator[bytes]:
        for i in range(size // MiB):
            yield chunk[i:] + chunk[:i]  # 64 distinct MiB, made as they are sent

    expected = hashlib.sha256(b"".join(body())).hexdigest()
    gateway = fake_cluster.cp.pid
    with PeakRss(gateway) as upload:
        answer = client.put(files, params={"path": "big.bin"}, content=body(), timeout=300)
    assert answer.status_code == 200 and answer.json() == {"size": size}, answer.text

    got, received = hashlib.sha256(), 0
    with (
        PeakRss(gateway) as download,
        client.stream("GET", files, params={"path": "big.bin"}, timeout=300) as response,
    ):
        assert response.status_code == 200
        for piece in response.iter_raw(256 * 1024):
            got.update(piece)
            received += len(piece)
    assert (received, got.hexdigest()) == (size, expected)
    # Streamed both ways: the gateway's peak grew by a small fraction of the file.
    assert upload.growth_kib < 16 * 1024, f"upload: the gateway grew by {upload.growth_kib} KiB"
    assert download.growth_kib < 16 * 1024, f"download: the gateway grew by {download.growth_kib} KiB"


def test_every_request_is_counted_by_its_route(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    sandbox_id = _sandbox(client)
    admin = fake_cluster.http(fake_cluster.admin_key)

    def counted(status: int) -> float:
        # The label is the route's path in its router (without the /v1 prefix).
        line = f'space_api_requests_total{{route="/sandboxes/{{sandbox_id}}/exec",status="{status}"}}'
        for row in admin.get("/metrics").text.splitlines():
            if row.startswith(line):
                return float(row.split()[-1])
        return 0.0

    before_ok, before_refused = counted(200), counted(401)
    assert _exec_status(client, sandbox_id) == 200
    assert _exec_status(fake_cluster.http("sk-not-a-key"), sandbox_id) == 401
    assert counted(200) == before_ok + 1
    # A request the limits refuse never reaches a route: it is not counted under the exec route.
    assert counted(401) == before_refused
