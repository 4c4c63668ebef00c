"""Request ids through real processes (ADR 0071): a control plane and a fake-driver node agent, both
writing JSON log lines. One id, taken from the caller or made by the API, is answered, and names the API's
and the node's log lines of that request, so one grep follows it from the gateway to the node; a hostile
`X-Request-Id` (newlines, 10 KB, JSON) is replaced and never reaches a log."""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import cluster as c

JSON_LOGS = {"SPACE_LOG_FORMAT": "json"}
INFO = ("--log-level", "info")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(
        tmp_path_factory.mktemp("request-ids"), control_plane_args=INFO, control_plane_env=JSON_LOGS,
        node_args=INFO, node_env=JSON_LOGS,
    ) as made:  # fmt: skip
        yield made


@pytest.fixture(scope="module")
def project(cluster: c.Cluster) -> Iterator[c.Project]:
    made = c.new_project(cluster)
    try:
        yield made
    finally:
        c.delete_all(cluster, made)


@pytest.fixture(scope="module")
def sandbox_id(project: c.Project) -> str:
    created = project.http().post("/v1/sandboxes", json={"template": "python", "limits": c.SMALL})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _lines(service: c.Service) -> list[dict[str, Any]]:
    """Every line of a service's log, each of which must be one JSON object (but the harness's own
    `--- start ...` lines)."""
    rows = []
    for line in service.log_path.read_text(errors="replace").splitlines():
        if line.strip() and not line.startswith("--- "):
            rows.append(json.loads(line))  # not JSON: the format is broken (this fails the test)
    return rows


def _with(service: c.Service, request_id: str) -> list[dict[str, Any]]:
    return [row for row in _lines(service) if row.get("request_id") == request_id]


def _once(service: c.Service, request_id: str, text: str) -> list[dict[str, Any]]:
    """The lines of `request_id`, once one of them holds `text` (else none)."""
    rows = _with(service, request_id)
    return rows if any(text in row["msg"] for row in rows) else []


def test_one_id_follows_an_exec_from_the_api_to_the_node(
    cluster: c.Cluster, project: c.Project, sandbox_id: str
) -> None:
    answer = project.http().post(
        f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true"}, headers={"X-Request-Id": "follow-me.1"},
        timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "follow-me.1"
    # The access line is written after the answer, so other lines of the request may be in the file first.
    api = c.wait_for(lambda: _once(cluster.cp, "follow-me.1", f"POST /v1/sandboxes/{sandbox_id}/exec 200"),
                     timeout=30, what="the API's access line")  # fmt: skip
    node = c.wait_for(lambda: _once(cluster.node, "follow-me.1", f"/node/v1/sandboxes/{sandbox_id}/"),
                      timeout=30, what="the node's access line")  # fmt: skip
    assert all(row["component"] == "controlplane" and row["sandbox_id"] == sandbox_id for row in api), api
    assert all(row["component"] == "agent" and row["sandbox_id"] == sandbox_id for row in node), node


def test_the_api_makes_an_id_when_the_caller_sends_none(project: c.Project, cluster: c.Cluster) -> None:
    answer = project.http().get("/v1/sandboxes")
    made = answer.headers["x-request-id"]
    assert made.startswith("req_") and len(made) == 20
    assert c.wait_for(lambda: _with(cluster.cp, made), timeout=30, what="the access line")
    assert project.http().get("/v1/sandboxes").headers["x-request-id"] != made  # one per request


@pytest.mark.parametrize(
    "hostile",
    [
        'x","level":"error","msg":"forged',
        '{"request_id":"forged"}',
        "forged-" * 1500,
        "forged\\nline",
        "../forged",
    ],
)
def test_a_hostile_request_id_is_replaced_and_logged_nowhere(
    cluster: c.Cluster, project: c.Project, sandbox_id: str, hostile: str
) -> None:
    answer = project.http().post(
        f"/v1/sandboxes/{sandbox_id}/exec",
        json={"cmd": "true"},
        headers={"X-Request-Id": hostile},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    replaced = answer.headers["x-request-id"]
    assert replaced.startswith("req_") and "forged" not in replaced
    assert c.wait_for(
        lambda: _with(cluster.node, replaced), timeout=30, what="the node's line under the new id"
    )
    for service in (cluster.cp, cluster.node):
        text = service.log_path.read_text(errors="replace")
        assert "forged" not in text
        _lines(service)  # and every line is still one JSON object


def test_a_raw_header_with_a_newline_or_control_bytes_never_reaches_a_log(
    cluster: c.Cluster, project: c.Project
) -> None:
    # (A bare LF ends the header line for the HTTP parser: the id is then `forged!`, still refused.)
    for value in (b"forged!\nX-Injected: 1", b"forged\x0bvalue", b"forged\x00nul"):
        request = (
            b"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + project.key.encode()
            + b"\r\nX-Request-Id: " + value + b"\r\nConnection: close\r\n\r\n"
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", cluster.cp.port), timeout=10) as conn:
            conn.sendall(request)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0]
        assert b"forged" not in head and b"X-Injected" not in head  # refused (400) or answered with a new id
        assert head.startswith(b"HTTP/1.1 400") or b"\r\nx-request-id: req_" in head, head
    assert "forged" not in cluster.cp.log_path.read_text(errors="replace")
    _lines(cluster.cp)


def test_a_reconciler_step_names_its_request_or_a_step_id_of_its_own(
    cluster: c.Cluster, project: c.Project
) -> None:
    created = project.http().post("/v1/sandboxes", json={"template": "python", "limits": c.SMALL})
    assert created.status_code == 201, created.text
    doomed = created.json()["id"]
    answer = project.http().delete(f"/v1/sandboxes/{doomed}", params={"wait": "false"})
    assert answer.status_code < 300, answer.text

    def node_delete() -> list[dict[str, Any]]:
        return [row for row in _lines(cluster.node)
                if row["msg"].startswith(f"DELETE /node/v1/sandboxes/{doomed}")]  # fmt: skip

    rows = c.wait_for(node_delete, timeout=30, what="the node's delete")
    for row in rows:  # the request's id on the direct path, else the step's own
        assert row["request_id"] == answer.headers["x-request-id"] or row["request_id"].startswith("step_")
        assert row["sandbox_id"] == doomed


def test_a_caller_s_trace_id_names_the_api_s_and_the_node_s_lines(
    cluster: c.Cluster, project: c.Project, sandbox_id: str
) -> None:
    """Issue 17 (ADR 0079): a request in the caller's trace (W3C traceparent) is logged under that trace id,
    on the API and on the node it reached, with the span of each hop (not the caller's)."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    answer = project.http().post(
        f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true"},
        headers={"X-Request-Id": "traced-1", "traceparent": f"00-{trace_id}-{parent}-01"}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    access_line = f"POST /v1/sandboxes/{sandbox_id}/exec 200"
    api = c.wait_for(
        lambda: _once(cluster.cp, "traced-1", access_line), timeout=30, what="the API's access line"
    )
    node = c.wait_for(lambda: _once(cluster.node, "traced-1", f"/node/v1/sandboxes/{sandbox_id}/"),
                      timeout=30, what="the node's access line")  # fmt: skip
    access = [row for row in api if row["msg"].startswith(access_line)]
    assert access and all(row["trace_id"] == trace_id for row in access), api
    assert all(len(row["span_id"]) == 16 and row["span_id"] != parent for row in access), access
    assert any(row["trace_id"] == trace_id for row in node), node
    assert {row["span_id"] for row in node}.isdisjoint({parent}), node


HOSTILE_TRACEPARENTS = {
    "malformed": "00-zz-yy-01",
    "all-zero trace": "00-" + "0" * 32 + "-" + "b" * 16 + "-01",
    "oversized": "00-" + "c" * 32 + "-" + "d" * 16 + "-01" + "-x" * 100,
}


@pytest.mark.parametrize("hostile", list(HOSTILE_TRACEPARENTS.values()), ids=list(HOSTILE_TRACEPARENTS))
def test_a_hostile_traceparent_starts_a_trace_of_its_own_in_the_lines(
    cluster: c.Cluster, project: c.Project, hostile: str
) -> None:
    request_id = f"hostile-tp-{secrets.token_hex(4)}"
    answer = project.http().get("/v1/sandboxes", headers={"X-Request-Id": request_id, "traceparent": hostile})
    assert answer.status_code == 200, answer.text
    rows = c.wait_for(lambda: _with(cluster.cp, request_id), timeout=30, what="the access line")
    for row in rows:  # a fresh, well-formed trace: nothing of the header
        assert len(row["trace_id"]) == 32 and set(row["trace_id"]) <= set("0123456789abcdef"), row
        assert row["trace_id"] not in {"0" * 32, "c" * 32}, row
