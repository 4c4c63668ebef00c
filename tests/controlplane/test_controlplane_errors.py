"""Error answers of the control plane: one shape (`{"error": {"code", "message", "details"}}`) with the
status docs/api.md gives each code, lifecycle refusals naming the current state, validation errors naming
the offending fields, and typed answers for malformed ids."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from space.core import versions
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.sdk import InvalidState
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project

# docs/api.md, "Errors": code -> status(es).
STATUS_OF = {
    "invalid_argument": {400},
    "validation_error": {422},
    "unauthenticated": {401},
    "permission_denied": {403},
    "not_found": {404},
    "invalid_state": {409},
    "conflict": {409},
    "already_exists": {409},
    "too_large": {413},
    "resource_exhausted": {429, 507},
    "unavailable": {503},
    "timeout": {504},
    "internal": {500},
    "method_not_allowed": {405},
}


def error_of(answer: httpx.Response) -> dict[str, Any]:
    """The error of an answer, after checking its shape and that its status is the one of its code."""
    assert answer.status_code >= 400, answer.text
    assert answer.headers["content-type"].startswith("application/json"), answer.headers
    body = answer.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "message", "details"}, error
    assert isinstance(error["code"], str) and error["code"], error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["details"], dict), error
    assert answer.status_code in STATUS_OF.get(error["code"], set()), (answer.status_code, error)
    return dict(error)


@dataclass
class Setup:
    project: c.Project
    running: str  # a running sandbox
    stopped: str  # a stopped sandbox
    deleted: str  # a deleted sandbox
    readonly_key: str


@pytest.fixture(scope="module")
def setup(fake_cluster: c.Cluster) -> Iterator[Setup]:
    made = c.new_project(fake_cluster)
    with made.sdk() as sp:
        running = sp.sandboxes.create(limits=c.SMALL)
        stopped = sp.sandboxes.create(limits=c.SMALL)
        stopped.stop()
        deleted = sp.sandboxes.create(limits=c.SMALL)
        deleted.delete()
    _id, readonly = made.new_key("read-only")
    yield Setup(made, running.id, stopped.id, deleted.id, readonly)
    c.delete_all(fake_cluster, made)


# (name, method, path, kwargs, expected status, expected code); {running} etc. come from Setup.
CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    ("unknown route", "GET", "/v1/nope", {}, 404, "not_found"),
    ("method not allowed", "PATCH", "/v1/sandboxes", {"json": {}}, 405, "method_not_allowed"),
    ("malformed sandbox id", "GET", "/v1/sandboxes/not-an-id", {}, 400, "invalid_argument"),
    ("malformed id, action", "POST", "/v1/sandboxes/sb-../pause", {}, 400, "invalid_argument"),
    ("malformed id, data plane", "POST", "/v1/sandboxes/xyz/exec", {"json": {"cmd": "true"}}, 400,
     "invalid_argument"),
    ("missing sandbox", "GET", "/v1/sandboxes/{missing}", {}, 404, "not_found"),
    ("missing sandbox, action", "POST", "/v1/sandboxes/{missing}/pause", {}, 404, "not_found"),
    ("missing sandbox, exec", "POST", "/v1/sandboxes/{missing}/exec", {"json": {"cmd": "true"}}, 404,
     "not_found"),
    ("deleted sandbox", "GET", "/v1/sandboxes/{deleted}", {}, 404, "not_found"),
    ("deleted sandbox, resume", "POST", "/v1/sandboxes/{deleted}/resume", {}, 404, "not_found"),
    ("unknown action", "POST", "/v1/sandboxes/{running}/frobnicate", {}, 404, "not_found"),
    ("body is not JSON", "POST", "/v1/sandboxes", {"content": b"{nope"}, 422, "validation_error"),
    ("extra field", "POST", "/v1/sandboxes", {"json": {"bogus": 1}}, 422, "validation_error"),
    ("bad template name", "POST", "/v1/sandboxes", {"json": {"template": "Not/A/Template"}}, 400,
     "invalid_argument"),
    ("negative idle timeout", "POST", "/v1/sandboxes", {"json": {"idle_timeout_s": -1}}, 422,
     "validation_error"),
    ("fork count 0", "POST", "/v1/sandboxes/{running}/fork", {"json": {"count": 0}}, 422,
     "validation_error"),
    ("malformed snapshot id", "POST", "/v1/sandboxes/{running}/rollback", {"json": {"snapshot_id": "x"}},
     400, "invalid_argument"),
    ("missing snapshot", "POST", "/v1/sandboxes/{running}/rollback",
     {"json": {"snapshot_id": "{missing_snap}"}}, 404, "not_found"),
    ("idempotency key too long", "POST", "/v1/sandboxes/{running}/resume",
     {"headers": {"Idempotency-Key": "k" * 129}}, 422, "validation_error"),
    ("project exists", "POST", "/v1/projects", {"json": {"name": "default"}, "admin": True}, 409,
     "already_exists"),
    ("bad project name", "POST", "/v1/projects", {"json": {"name": "no spaces"}, "admin": True}, 422,
     "validation_error"),
    ("key for unknown project", "POST", "/v1/keys", {"json": {"project": "nope"}, "admin": True}, 404,
     "not_found"),
    ("bad role", "POST", "/v1/keys", {"json": {"project": "default", "role": "god"}, "admin": True}, 422,
     "validation_error"),
    ("read-only mutates", "POST", "/v1/sandboxes/{running}/pause", {"readonly": True}, 403,
     "permission_denied"),
    ("no key", "GET", "/v1/sandboxes", {"nokey": True}, 401, "unauthenticated"),
    ("pause a stopped sandbox", "POST", "/v1/sandboxes/{stopped}/pause", {}, 409, "invalid_state"),
    ("exec in a stopped sandbox", "POST", "/v1/sandboxes/{stopped}/exec", {"json": {"cmd": "true"}}, 409,
     "invalid_state"),
    ("snapshot of a stopped sandbox", "POST", "/v1/sandboxes/{stopped}/snapshots", {"json": {}}, 409,
     "invalid_state"),
    ("fork a stopped sandbox", "POST", "/v1/sandboxes/{stopped}/fork", {"json": {}}, 409, "invalid_state"),
    ("file not found (relayed)", "GET", "/v1/sandboxes/{running}/files?path=no/such/file", {}, 404,
     "not_found"),
    ("bad exec body (relayed)", "POST", "/v1/sandboxes/{running}/exec", {"json": {"cmd": 5}}, 422,
     "validation_error"),
    ("unknown process (relayed)", "POST", "/v1/sandboxes/{running}/processes/0123456789abcdef/signal",
     {"json": {"signal": "SIGTERM"}}, 404, "not_found"),
    ("malformed key id", "DELETE", "/v1/keys/key-..", {"admin": True}, 400, "invalid_argument"),
    ("malformed process id", "POST", "/v1/sandboxes/{running}/processes/nope/signal",
     {"json": {"signal": "SIGTERM"}}, 400, "invalid_argument"),
    ("bad query type (typed route)", "GET", "/v1/sandboxes/{running}/files?path=a&offset=-1", {}, 422,
     "validation_error"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "method", "path", "kwargs", "status", "code"), CASES, ids=[x[0] for x in CASES]
)
def test_every_error_has_one_shape_and_the_documented_status(
    fake_cluster: c.Cluster,
    setup: Setup,
    name: str,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
    code: str,
) -> None:
    values = {
        "running": setup.running,
        "stopped": setup.stopped,
        "deleted": setup.deleted,
        "missing": new_sandbox_id(),
        "missing_snap": new_snapshot_id(),
    }
    kwargs = dict(kwargs)
    key = setup.project.key
    if kwargs.pop("admin", False):
        key = fake_cluster.admin_key
    if kwargs.pop("readonly", False):
        key = setup.readonly_key
    client = fake_cluster.http(None if kwargs.pop("nokey", False) else key)
    if isinstance(kwargs.get("json"), dict):
        kwargs["json"] = {
            k: v.format(**values) if isinstance(v, str) else v for k, v in kwargs["json"].items()
        }
    answer = client.request(method, path.format(**values), **kwargs)
    assert answer.status_code == status, f"{name}: {answer.status_code} {answer.text}"
    error = error_of(answer)
    assert error["code"] == code, error


def test_a_refused_transition_names_the_current_state(fake_cluster: c.Cluster, setup: Setup) -> None:
    client = setup.project.http()
    error = error_of(client.post(f"/v1/sandboxes/{setup.stopped}/pause"))
    assert error["code"] == "invalid_state"
    assert error["details"]["state"] == "stopped", error
    assert "stopped" in error["message"]
    # Nothing was recorded: the sandbox neither wants nor reaches another state.
    record = fake_cluster.store.load_sandbox(setup.stopped)
    assert record is not None and (record.state, record.desired_state) == ("stopped", "stopped")
    # Also through the data plane and for the SDK's typed error.
    error = error_of(client.post(f"/v1/sandboxes/{setup.stopped}/exec", json={"cmd": "true"}))
    assert error["details"]["state"] == "stopped", error
    with setup.project.sdk() as sp, pytest.raises(InvalidState) as raised:
        sp.sandboxes.get(setup.stopped).pause()
    assert raised.value.state == "stopped"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"env": 5}, "env"),
        ({"env": {"K": 5}}, "env.K"),
        ({"limits": {"cpus": 1000.0}}, "limits.cpus"),
        ({"limits": {"memory_mb": "lots"}}, "limits.memory_mb"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"wait": "perhaps"}, "wait"),
        ({"template": ["python"]}, "template"),
    ],
)
def test_a_malformed_body_is_422_naming_the_field(
    fake_cluster: c.Cluster, setup: Setup, body: dict[str, Any], field: str
) -> None:
    before = len(fake_cluster.store.list_sandboxes(setup.project.id))
    error = error_of(setup.project.http().post("/v1/sandboxes", json=body))
    assert error["code"] == "validation_error"
    assert field in error["details"]["fields"], error
    assert field in error["message"], error
    assert len(fake_cluster.store.list_sandboxes(setup.project.id)) == before, "a sandbox was created"


def test_unauthenticated_endpoints(fake_cluster: c.Cluster) -> None:
    client = fake_cluster.http()
    assert client.get("/healthz").json() == {"status": "ok", "version": versions.space_version()}
    # /metrics shows every tenant's traffic: an org admin key only (ADR 0020).
    assert error_of(client.get("/metrics"))["code"] == "unauthenticated"
    member = c.new_project(fake_cluster)
    assert error_of(member.http().get("/metrics"))["code"] == "permission_denied"
    assert "space_api_requests" in fake_cluster.http(fake_cluster.admin_key).get("/metrics").text
    schema = client.get("/openapi.json").json()
    for path in ("/v1/sandboxes", "/v1/sandboxes/{sandbox_id}", "/v1/projects", "/v1/keys"):
        assert path in schema["paths"], sorted(schema["paths"])
    # The node routes are not part of the public document.
    assert not [p for p in schema["paths"] if p.startswith("/v1/nodes")]


def test_node_routes_need_the_node_token(fake_cluster: c.Cluster) -> None:
    client = fake_cluster.http(fake_cluster.admin_key)  # an API key is not a node token
    answer = client.post("/v1/nodes/register", json={"url": "http://127.0.0.1:1", "token": "x"})
    assert error_of(answer)["code"] == "unauthenticated"
    record = fake_cluster.node_record()
    assert record is not None
    answer = client.post(f"/v1/nodes/{record.id}/heartbeat", json={})
    assert error_of(answer)["code"] == "unauthenticated"
    # The refused registration made no node (other modules may register nodes of their own in this cluster).
    assert "http://127.0.0.1:1" not in [n.url for n in fake_cluster.store.list_nodes(None)]
