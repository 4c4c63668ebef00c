"""The metrics history on a real runsc node (`real_cluster`: control plane, node agent, root helper): a
sandbox that allocates memory and burns CPU shows it in its samples, read through the REST API and the SDK
(the node reads the sandbox's host cgroup through the helper's `sandbox.metrics` verb; ADR 0053). The
fake-driver tests of the same API, with its attacks, are tests/controlplane/test_sandbox_metrics_api.py."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

LIMITS = {"cpus": 1.0, "memory_mb": 512}
MIB = 1 << 20
#: 200 MiB touched (bytes multiplied out, not a lazily zeroed buffer), then a spinning loop.
BURN = "x = b'x' * (200 << 20)\nwhile True: pass"


def _samples(http: httpx.Client, sandbox_id: str, **params: Any) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/metrics", params=params)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["samples"])


def _first_sample(http: httpx.Client, sandbox_id: str, *, after: float) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def sampled() -> bool:
        found[:] = _samples(http, sandbox_id, start=after)
        return bool(found)

    c.wait_for(sampled, timeout=120, interval=1.0, what=f"a sample of {sandbox_id} after {after}")
    return found[0]


def test_cpu_and_memory_a_sandbox_uses_show_in_its_metrics(real_cluster: c.RealCluster) -> None:
    http = httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=60
    )
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits=LIMITS)
        try:
            idle = _first_sample(http, sb.id, after=0)
            assert idle["cpu_count"] == 1.0 and idle["mem_total_bytes"] == 512 * MIB
            assert 0 < idle["mem_used_bytes"] < 512 * MIB
            assert idle["disk_total_bytes"] == sb.data["limits"]["storage_mb"] * MIB
            sb.processes.start(["python3", "-c", BURN], timeout=300)
            sb.exec("sleep 2")  # the allocation is made before the window the next samples measure
            began = time.time()
            busy = _first_sample(http, sb.id, after=began + 1)
            # The spinning loop against the idle sandbox's own sample (the share of the CPU it gets depends
            # on the load of this shared machine, so it is not compared with 100 %).
            assert busy["cpu_used_pct"] > max(10.0, 5 * idle["cpu_used_pct"]), (idle, busy)
            assert busy["mem_used_bytes"] > idle["mem_used_bytes"] + 150 * MIB, (idle, busy)
            through_sdk = sb.metrics(start=busy["timestamp"], end=busy["timestamp"])
            assert [s.data for s in through_sdk] == [busy]
        finally:
            sb.delete()
            http.close()
