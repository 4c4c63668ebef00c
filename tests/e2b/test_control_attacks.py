"""Attacks on E2B's control API (the fake-driver cluster): every route is classified below and a new one
fails `test_every_route_is_classified`; another tenant's ids are 404s in E2B's body on every route that
takes one (and never listed, used or deleted); no, bad and revoked keys are 401s on every route; a
read-only key reads but changes nothing and is never shown an envd token; malformed, oversized and
unsupported bodies are 400/413 in E2B's shape; forged page tokens are 400s; encoded paths find nothing."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from e2b.api.client.models import Error

from space.controlplane.e2b.control import create_control_app
from space.controlplane.settings import ControlPlaneSettings
from tests.support import cluster as c
from tests.support.e2b_cluster import E2bCluster

SB = "{sandbox_id}"
#: Every route of the control app: (method, path) -> (a body that is valid, the role it needs: None for none).
ROUTES: dict[tuple[str, str], tuple[dict[str, Any] | None, str | None]] = {
    ("POST", "/sandboxes"): ({"templateID": "base"}, "member"),
    ("POST", "/v2/sandboxes"): ({"templateID": "base"}, "member"),
    ("GET", "/sandboxes"): (None, "read-only"),
    ("GET", "/v2/sandboxes"): (None, "read-only"),
    ("GET", f"/sandboxes/{SB}"): (None, "read-only"),
    ("DELETE", f"/sandboxes/{SB}"): (None, "member"),
    ("POST", f"/sandboxes/{SB}/timeout"): ({"timeout": 300}, "member"),
    ("POST", f"/sandboxes/{SB}/pause"): ({"memory": True}, "member"),
    ("POST", f"/sandboxes/{SB}/connect"): ({"timeout": 300}, "member"),
    ("POST", f"/v2/sandboxes/{SB}/connect"): ({"timeout": 300}, "member"),
    ("POST", f"/sandboxes/{SB}/fork"): ({"count": 1}, "member"),
    ("POST", f"/sandboxes/{SB}/snapshots"): ({}, "member"),
    ("GET", "/snapshots"): (None, "read-only"),
    ("DELETE", "/templates/{template_id}"): (None, "member"),
    ("PUT", f"/sandboxes/{SB}/network"): ({"allowOut": ["example.com"]}, "member"),
    ("GET", f"/sandboxes/{SB}/metrics"): (None, "read-only"),
    ("GET", "/templates/aliases/{alias}"): (None, "read-only"),
    ("GET", "/health"): (None, None),
}


def _e2b_error(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, (answer.request.method, answer.request.url, answer.text)
    body = answer.json()
    assert Error.from_dict(body).code == status and isinstance(body["message"], str), body
    return dict(body)


@pytest.fixture(scope="module")
def tenants(e2b_fake: E2bCluster) -> Iterator[tuple[c.Project, c.Project]]:
    mine, theirs = c.new_project(e2b_fake.cluster), c.new_project(e2b_fake.cluster)
    try:
        yield mine, theirs
    finally:
        for project in (mine, theirs):
            c.delete_all(e2b_fake.cluster, project)


def _client(e2b_fake: E2bCluster, key: str | None) -> httpx.Client:
    headers = {"X-API-Key": key} if key is not None else {}
    return httpx.Client(base_url=e2b_fake.api_url, headers=headers, timeout=60)


def _created(client: httpx.Client) -> str:
    answer = client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"owner": "them"}})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["sandboxID"])


def test_every_route_is_classified() -> None:
    services = SimpleNamespace(settings=ControlPlaneSettings())  # routes only: nothing is served
    app = create_control_app(services)  # type: ignore[arg-type]
    # The schema the app would publish (it publishes none): every route with its methods.
    paths = app.openapi()["paths"]
    served = {
        (method.upper(), path.replace("{template_id:path}", "{template_id}"))
        for path, operations in paths.items()
        for method in operations
    }
    assert served == set(ROUTES), f"unclassified: {served - set(ROUTES)}; gone: {set(ROUTES) - served}"


def test_another_tenants_sandboxes_and_snapshots_are_not_found(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]
) -> None:
    mine, theirs = tenants
    them = _client(e2b_fake, theirs.key)
    foreign = _created(them)
    snapshot = them.post(f"/sandboxes/{foreign}/snapshots", json={}).json()["snapshotID"]
    me = _client(e2b_fake, mine.key)
    for (method, path), (body, _role) in ROUTES.items():
        if SB not in path:
            continue
        answer = me.request(method, path.format(sandbox_id=foreign), json=body)
        _e2b_error(answer, 404)
        assert foreign not in answer.text or "not found" in answer.json()["message"]
    assert me.get("/v2/sandboxes").json() == [] and me.get("/sandboxes").json() == []
    assert me.get("/v2/sandboxes", params={"metadata": "owner=them"}).json() == []
    assert me.get("/snapshots").json() == []
    assert me.get("/snapshots", params={"sandboxID": foreign}).json() == []
    assert me.get("/snapshots", params={"name": snapshot}).json() == []
    their_mark = base64.urlsafe_b64encode(json.dumps({"after": snapshot}).encode()).decode().rstrip("=")
    assert me.get("/snapshots", params={"nextToken": their_mark}).json() == []  # a cursor, never a grant
    _e2b_error(me.post("/v2/sandboxes", json={"templateID": snapshot}), 404)  # not usable as a template
    _e2b_error(me.delete(f"/templates/{snapshot}"), 404)
    # Their sandbox and snapshot are untouched: still running, still there.
    assert them.get(f"/sandboxes/{foreign}").json()["state"] == "running"
    assert [s["snapshotID"] for s in them.get("/snapshots").json()] == [snapshot]


def test_keys_missing_bad_revoked_and_read_only(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]
) -> None:
    mine, _theirs = tenants
    sandbox_id = _created(_client(e2b_fake, mine.key))
    _key_id, reader = mine.new_key("read-only")
    revoked_id, revoked = mine.new_key("member")
    admin = e2b_fake.cluster.http(e2b_fake.cluster.admin_key)
    assert admin.delete(f"/v1/keys/{revoked_id}").status_code == 204
    clients = {key: _client(e2b_fake, key) for key in (None, revoked, reader)}
    for (method, path), (body, role) in ROUTES.items():
        url = path.format(sandbox_id=sandbox_id, template_id="snap-x", alias="base")
        for key in (None, revoked):
            answer = clients[key].request(method, url, json=body)
            if role is None:
                assert answer.status_code == 200
            else:
                _e2b_error(answer, 401)
        if role == "member":
            _e2b_error(clients[reader].request(method, url, json=body), 403)
    for key in ("", "space_" + "x" * 40, "e2b_" + "0" * 60, "x" * 10_000, "Bearer space_x"):
        _e2b_error(_client(e2b_fake, key).get("/v2/sandboxes"), 401)
        _e2b_error(_client(e2b_fake, key).post("/v2/sandboxes", json={"templateID": "base"}), 401)
    # Bearer works too; a read-only key reads, without the envd access token (it would grant exec).
    bearer = httpx.get(
        f"{e2b_fake.api_url}/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {reader}"}
    )
    assert bearer.status_code == 200 and "envdAccessToken" not in bearer.json()
    assert "envdAccessToken" in _client(e2b_fake, mine.key).get(f"/sandboxes/{sandbox_id}").json()


def test_e2b_shaped_key_minted_by_the_api(e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]) -> None:
    mine, _theirs = tenants
    admin = e2b_fake.cluster.http(e2b_fake.cluster.admin_key)
    made = admin.post("/v1/keys", json={"project": mine.name, "role": "member", "shape": "e2b"})
    assert made.status_code == 201, made.text
    secret = made.json()["key"]
    assert secret.startswith("e2b_") and all(ch in "0123456789abcdef" for ch in secret[4:])
    assert _client(e2b_fake, secret).get("/v2/sandboxes").status_code == 200
    assert e2b_fake.cluster.http(secret).get("/v1/sandboxes").status_code == 200  # a SPACE key like any
    assert admin.delete(f"/v1/keys/{made.json()['id']}").status_code == 204
    _e2b_error(_client(e2b_fake, secret).get("/v2/sandboxes"), 401)
    assert admin.post("/v1/keys", json={"project": mine.name, "shape": "aws"}).status_code == 422


def test_malformed_oversized_and_unsupported_bodies(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]
) -> None:
    mine, _theirs = tenants
    me = _client(e2b_fake, mine.key)
    sandbox_id = _created(me)
    bad_bodies: list[tuple[str, str, Any]] = [
        ("POST", "/v2/sandboxes", b"{not json"),
        ("POST", "/v2/sandboxes", {}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 0}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 10**9}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "envVars": {"A": 1}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {f"k{i}": "v" for i in range(65)}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {"k": "v" * 2000}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {"bad key'": "v"}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "autoResume": {"enabled": False}}),  # always on
        ("POST", "/v2/sandboxes", {"templateID": "base", "autoResume": {}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"denyOut": "0.0.0.0/0"}}),
        ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"allowOut": ["*.com"]}}),
        ("POST", f"/sandboxes/{sandbox_id}/timeout", {"timeout": -1}),
        ("POST", f"/sandboxes/{sandbox_id}/fork", {"count": 101}),
        ("PUT", f"/sandboxes/{sandbox_id}/network", {"dnsServers": ["8.8.8.8"]}),
        ("PUT", f"/sandboxes/{sandbox_id}/network", {"allowOut": ["x"] * 300}),
    ]
    for method, path, body in bad_bodies:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = me.request(method, path, content=content, headers={"content-type": "application/json"})
        _e2b_error(answer, 400)
    huge = json.dumps({"templateID": "base", "metadata": {"k": "v" * (2 << 20)}}).encode()
    _e2b_error(me.post("/v2/sandboxes", content=huge, headers={"content-type": "application/json"}), 413)

    def endless() -> Iterator[bytes]:
        yield b'{"templateID": "base", "metadata": {"k": "'
        for _ in range(3000):
            yield b"v" * 1024

    _e2b_error(me.post("/v2/sandboxes", content=endless(), headers={"content-type": "application/json"}), 413)
    _e2b_error(me.get("/v2/sandboxes", params={"metadata": "&".join(f"k{i}=v" for i in range(100))}), 400)
    _e2b_error(me.get("/v2/sandboxes", params={"metadata": "no-equals-sign"}), 400)
    _e2b_error(me.get("/nowhere"), 404)


def test_forged_page_tokens_and_encoded_paths(
    e2b_fake: E2bCluster, tenants: tuple[c.Project, c.Project]
) -> None:
    mine, theirs = tenants
    me = _client(e2b_fake, mine.key)
    theirs_id = _created(_client(e2b_fake, theirs.key))

    def token(payload: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")

    forged = [
        "!!!", "A" * 600, token([]), token({"v": 1, "t": "yesterday", "id": theirs_id}),
        token({"t": "2026-01-01T00:00:00+00:00", "id": "../../etc", "o": "desc"}),
    ]  # fmt: skip
    for bad in forged:
        _e2b_error(me.get("/v2/sandboxes", params={"nextToken": bad}), 400)
        _e2b_error(me.get("/snapshots", params={"nextToken": bad}), 400)
    # Their own real page token is refused under my key (it is bound to their project), and mine under
    # other filters or the other order.
    them = _client(e2b_fake, theirs.key)
    _created(them)
    their_token = them.get("/v2/sandboxes", params={"limit": 1}).headers["X-Next-Token"]
    _e2b_error(me.get("/v2/sandboxes", params={"limit": 1, "nextToken": their_token}), 400)
    _created(me)
    _created(me)
    mine_token = me.get("/v2/sandboxes", params={"limit": 1}).headers["X-Next-Token"]
    _e2b_error(me.get("/v2/sandboxes", params={"limit": 1, "order": "asc", "nextToken": mine_token}), 400)
    _e2b_error(me.get("/v2/sandboxes", params={"state": "paused", "nextToken": mine_token}), 400)
    assert me.get("/v2/sandboxes", params={"limit": 1, "nextToken": mine_token}).status_code == 200
    for path in (f"/sandboxes/..%2F{theirs_id}", "/sandboxes/%2e%2e", f"/sandboxes/{theirs_id}%00"):
        _e2b_error(me.get(path), 404)
        _e2b_error(me.delete(path), 404)
    for template in ("..%2F..%2Fetc", f"..%2F{theirs_id}", "snap-%2e%2e", "%00"):
        _e2b_error(me.delete(f"/templates/{template}"), 404)
