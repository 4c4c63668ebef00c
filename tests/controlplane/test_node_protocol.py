"""The node protocol's version range (ADR 0071), through a real control plane and real fake-driver agents:
a node announcing a range the control plane does not speak is refused at registration with 409
`incompatible_protocol` naming both ranges (and the agent exits with status 78 saying so); a node of the
next version (N+1, whose range still holds N) and one from before versioning (no range: 1..1) are taken;
malformed ranges are a 400."""

from __future__ import annotations

import pathlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.node.agent.launch import EXIT_INCOMPATIBLE
from space.node.agent.registration import IncompatiblePeer, _check_protocol
from space.protocol import node_protocol
from tests.support import cluster as c

OURS = node_protocol.own_range()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path_factory.mktemp("node-protocol")) as made:
        yield made


def _enrol(cluster: c.Cluster, **protocol: Any) -> httpx.Response:
    body = {
        "url": f"http://127.0.0.1:{c.free_port()}", "token": secrets.token_urlsafe(32),
        "capacity": {"cpus": 1, "memory_mb": 512, "disk_mb": 1024}, "templates": [], "driver": "fake",
        "isolating": False, **protocol,
    }  # fmt: skip
    bootstrap = cluster.token_file.read_text().strip()
    return httpx.post(
        f"{cluster.url}/v1/nodes/register", json=body, headers={"Authorization": f"Bearer {bootstrap}"}
    )


def test_a_node_of_no_common_version_is_refused_naming_both_ranges(cluster: c.Cluster) -> None:
    before = len(cluster.store.list_nodes(None))
    answer = _enrol(cluster, protocol_min=OURS[1] + 1, protocol_max=OURS[1] + 2)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "incompatible_protocol"
    assert f"node speaks {OURS[1] + 1}..{OURS[1] + 2}" in error["message"]
    assert f"control plane speaks {OURS[0]}..{OURS[1]}" in error["message"]
    assert error["details"] == {
        "node_protocol": [OURS[1] + 1, OURS[1] + 2],
        "control_plane_protocol": list(OURS),
    }
    assert len(cluster.store.list_nodes(None)) == before  # refused before anything was written
    assert "node registration refused" in cluster.cp.log_path.read_text()  # the control plane logs it too


def test_the_next_version_and_a_node_from_before_versioning_are_taken(cluster: c.Cluster) -> None:
    newer = _enrol(cluster, protocol_min=OURS[1], protocol_max=OURS[1] + 1)  # N+1 still speaks N
    assert newer.status_code == 200, newer.text
    assert newer.json()["protocol"] == OURS[1]
    assert (newer.json()["protocol_min"], newer.json()["protocol_max"]) == OURS
    older = _enrol(cluster)  # no range announced: 1..1
    assert older.status_code == 200 and older.json()["protocol"] == 1, older.text


def test_re_registration_checks_the_range_too(cluster: c.Cluster) -> None:
    enrolled = _enrol(cluster).json()
    answer = httpx.post(
        f"{cluster.url}/v1/nodes/{enrolled['node_id']}/register",
        json={"url": f"http://127.0.0.1:{c.free_port()}", "token": secrets.token_urlsafe(32),
              "protocol_min": 500, "protocol_max": 501},
        headers={"Authorization": f"Bearer {enrolled['identity']}"},
    )  # fmt: skip
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "incompatible_protocol", (
        answer.text
    )


def test_a_heartbeat_answer_names_the_control_plane_s_range(cluster: c.Cluster) -> None:
    enrolled = _enrol(cluster).json()
    beat = {"capacity": {"cpus": 1, "memory_mb": 512, "disk_mb": 1024}, "used": {}, "sandboxes": []}
    answer = httpx.post(
        f"{cluster.url}/v1/nodes/{enrolled['node_id']}/heartbeat", json=beat,
        headers={"Authorization": f"Bearer {enrolled['identity']}"},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert (answer.json()["protocol_min"], answer.json()["protocol_max"]) == OURS
    _check_protocol(answer)  # the node's check passes it


@pytest.mark.parametrize(
    "hostile",
    [{"protocol_min": "1", "protocol_max": 1}, {"protocol_min": 0, "protocol_max": 1},
     {"protocol_min": 1, "protocol_max": 10**30}, {"protocol_min": True, "protocol_max": True},
     {"protocol_min": 3, "protocol_max": 2}, {"protocol_min": 1.5, "protocol_max": 2},
     {"protocol_min": [1], "protocol_max": {}}],
)  # fmt: skip
def test_a_malformed_range_is_a_400(cluster: c.Cluster, hostile: dict[str, Any]) -> None:
    answer = _enrol(cluster, **hostile)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_argument", answer.text


def test_an_agent_refused_for_its_version_exits_naming_both(
    cluster: c.Cluster, tmp_path: pathlib.Path
) -> None:
    # A real agent process announcing N+1..N+2 (the constants patched before it starts).
    low, high = OURS[1] + 1, OURS[1] + 2
    program = (
        "import sys; from space.protocol import node_protocol as p; "
        f"p.MIN_NODE_PROTOCOL_VERSION, p.NODE_PROTOCOL_VERSION = {low}, {high}; "
        "from space.node.agent.launch import main; main(sys.argv[1:])"
    )
    argv = [sys.executable, "-c", program, "--driver", "fake", "--data-dir", str(tmp_path / "node"),
            "--listen", f"127.0.0.1:{c.free_port()}", "--bootstrap-token-file", str(cluster.token_file),
            "--control-plane", cluster.url, "--no-prepare"]  # fmt: skip
    done = subprocess.run(argv, check=False, env=c._child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_INCOMPATIBLE, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"node speaks {low}..{high}" in last and f"control plane speaks {OURS[0]}..{OURS[1]}" in last, last


def test_the_node_refuses_a_control_plane_answering_a_range_it_does_not_speak() -> None:
    answer = httpx.Response(
        200, json={"node_id": "x", "protocol_min": OURS[1] + 5, "protocol_max": OURS[1] + 6}
    )
    with pytest.raises(IncompatiblePeer, match=f"control plane speaks {OURS[1] + 5}"):
        _check_protocol(answer)
    _check_protocol(
        httpx.Response(200, json={"node_id": "x"})
    )  # a control plane from before versioning: 1..1
    refused = httpx.Response(409, json={"error": {"code": "incompatible_protocol", "message": "m"}})
    with pytest.raises(IncompatiblePeer):
        _check_protocol(refused)
