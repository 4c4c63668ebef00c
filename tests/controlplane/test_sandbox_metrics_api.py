"""A sandbox's metrics history through the API (GET /v1/sandboxes/{id}/metrics), the SDK's `metrics()` and
`space sandbox metrics`, against a real control plane and node agent (fake driver, the node's own sampler
at its default interval): samples appear and read back by window and limit, a read-only key suffices,
reading never resumes a paused sandbox; and attacked: another tenant's sandbox answers like a missing one,
no key is 401, windows that are not windows are refused, huge windows are bounded answers."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from space.cli.main import app
from space.core.ids import new_sandbox_id
from space.node.agent.metrics_models import MAX_TIMESTAMP
from tests.support import cluster as c

fake_cluster = c.fake_cluster

MiB = 1 << 20


@pytest.fixture(scope="module")
def two(fake_cluster: c.Cluster) -> Iterator[tuple[c.Project, str, c.Project, str]]:
    with c.two_tenants(fake_cluster) as tenants:
        yield tenants


def _samples(http: httpx.Client, sandbox_id: str, **params: Any) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/metrics", params=params)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["samples"])


def _wait_for_samples(http: httpx.Client, sandbox_id: str, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def enough() -> bool:
        found[:] = _samples(http, sandbox_id)
        return len(found) >= count

    c.wait_for(enough, timeout=60, interval=0.5, what=f"{count} samples of {sandbox_id}")
    return found


def test_samples_read_back_by_window_limit_sdk_and_cli(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, _attacker, _other = two
    _key_id, reader = victim.new_key("read-only")
    http = victim.http(reader)
    samples = _wait_for_samples(http, sandbox_id, 2)
    answer = http.get(f"/v1/sandboxes/{sandbox_id}/metrics").json()
    assert (
        answer["sandbox_id"] == sandbox_id
        and answer["interval_s"] == float(c.METRICS_INTERVAL_S)
        and answer["truncated"] is False
    )
    first = samples[0]
    assert first["cpu_count"] == c.SMALL["cpus"] and first["mem_total_bytes"] == c.SMALL["memory_mb"] * MiB
    assert first["mem_used_bytes"] > 0 and first["cpu_used_pct"] >= 0.0
    assert first["disk_used_bytes"] is not None and first["disk_total_bytes"] > 0
    assert abs(first["timestamp"] - time.time()) < 600
    stamps = [s["timestamp"] for s in samples]
    assert stamps == sorted(stamps)
    # windows: inclusive bounds, nothing before the sandbox existed, the newest when limited
    assert [s["timestamp"] for s in _samples(http, sandbox_id, start=stamps[1], end=stamps[1])] == [stamps[1]]
    assert _samples(http, sandbox_id, start=0, end=stamps[0] - 3600) == []
    newest = http.get(f"/v1/sandboxes/{sandbox_id}/metrics", params={"limit": 1}).json()
    assert len(newest["samples"]) == 1 and newest["truncated"] is True
    assert newest["samples"][0]["timestamp"] >= stamps[-1]

    with victim.sdk() as sp:
        found = sp.sandboxes.get(sandbox_id).metrics(start=stamps[0])
    assert found[0]["timestamp"] == stamps[0] and found[0].mem_used_bytes == first["mem_used_bytes"]
    assert found[0].at.timestamp() == pytest.approx(stamps[0])

    base = ["--url", fake_cluster.url, "--api-key", reader, "sandbox", "metrics", sandbox_id]
    result = CliRunner().invoke(app, [*base, "--json", "--limit", "2"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 2
    table = CliRunner().invoke(app, [*base, "--since", "3600"])
    assert table.exit_code == 0 and "MEMORY MiB" in table.stdout and f"of {c.SMALL['cpus']}" in table.stdout


def test_another_tenants_sandbox_is_a_missing_one_and_no_key_is_401(fake_cluster: c.Cluster, two) -> None:  # type: ignore[no-untyped-def]
    _victim, sandbox_id, attacker, _own = two
    missing = new_sandbox_id()
    http = attacker.http()
    foreign = http.get(f"/v1/sandboxes/{sandbox_id}/metrics", params={"start": 0})
    absent = http.get(f"/v1/sandboxes/{missing}/metrics", params={"start": 0})
    assert foreign.status_code == absent.status_code == 404
    assert foreign.json()["error"]["message"].replace(sandbox_id, "X") == absent.json()["error"][
        "message"
    ].replace(missing, "X")
    anonymous = httpx.get(f"{fake_cluster.url}/v1/sandboxes/{sandbox_id}/metrics")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthenticated"


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"start": -1}, 400, "start"),
        ({"end": MAX_TIMESTAMP * 2}, 400, "end"),
        ({"start": 1e300}, 400, "start"),
        ({"start": 20, "end": 10}, 400, "start"),
        ({"start": "nan"}, 422, "start"),
        ({"end": "inf"}, 422, "end"),
        ({"start": "yesterday"}, 422, "start"),
        ({"limit": 0}, 422, "limit"),
        ({"limit": 1001}, 422, "limit"),
        ({"limit": 10**30}, 422, "limit"),
    ],
)
def test_windows_that_are_not_windows_are_refused(
    two, params: dict[str, object], status: int, field: str
) -> None:  # type: ignore[no-untyped-def]
    _victim, _sb, attacker, own = two
    answer = attacker.http().get(f"/v1/sandboxes/{own}/metrics", params=params)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert field in (error["details"].get("fields") or {error["details"].get("field"): None}), answer.text


def test_a_huge_window_is_a_bounded_answer(two) -> None:  # type: ignore[no-untyped-def]
    _victim, _sb, attacker, own = two
    http = attacker.http()
    samples = _wait_for_samples(http, own, 1)
    widest = http.get(f"/v1/sandboxes/{own}/metrics", params={"start": 0, "end": MAX_TIMESTAMP}).json()
    assert (
        1 <= len(widest["samples"]) <= 1000 and widest["samples"][0]["timestamp"] == samples[0]["timestamp"]
    )
    assert all(math.isfinite(s["timestamp"]) for s in widest["samples"])


@pytest.mark.parametrize("raw", ["sb-..%2F..", "%2e%2e", "sb-x%00", "..%5C", "sb-" + "a" * 5000])
def test_encoded_ids_never_reach_a_node(two, raw: str) -> None:  # type: ignore[no-untyped-def]
    _victim, _sb, attacker, _own = two
    answer = attacker.http().get(f"/v1/sandboxes/{raw}/metrics")
    assert answer.status_code in {400, 404, 414, 422}, answer.text
    assert "error" in answer.json() and "samples" not in answer.json()


def test_a_paused_sandbox_answers_what_was_kept_and_stays_paused(two) -> None:  # type: ignore[no-untyped-def]
    victim, sandbox_id, _attacker, _other = two  # last in the module: the victim's sandbox is paused here
    kept = _wait_for_samples(victim.http(), sandbox_id, 1)
    with victim.sdk() as sp:
        sb = sp.sandboxes.get(sandbox_id)
        sb.pause()
        after = sb.metrics()
        assert [s["timestamp"] for s in after][: len(kept)] == [s["timestamp"] for s in kept]
        time.sleep(2 * float(c.METRICS_INTERVAL_S))
        assert [s.data for s in sb.metrics()] == [s.data for s in after], "a paused sandbox is not sampled"
        assert sb.refresh().state == "paused", "reading metrics must not resume the sandbox"
