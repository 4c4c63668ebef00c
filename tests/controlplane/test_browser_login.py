"""The browser's page fill (POST /v1/sandboxes/{id}/browser/login, ADR 0066) through the real API processes
(the shared fake-driver cluster, which has no browser): who may ask, which credential, what input is
refused before anything reaches the node, and that every attempt is audited. The fill itself (a real
Chromium, the gateway, the site) is tests/e2e/test_browser_login_e2e.py; the page script against pages
that try to trip it is tests/controlplane/test_browser_login_script.py."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from space.core.errors import InvalidState, NotFound
from space.core.ids import new_sandbox_id
from tests.support import cluster as c
from tests.support.mcp_clients import over_http

fake_cluster = c.fake_cluster
project = c.project

FORM = {"origin": "https://login.example.com", "username_field": "email", "password_field": "pw"}


def error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    body = answer.json()["error"]
    assert body["code"] == code, body
    return dict(body.get("details") or {})


def fill_url(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{sandbox_id}/browser/login"


@pytest.fixture
def bound(project: c.Project) -> tuple[str, str]:
    """(sandbox id, bound login credential) plus an unbound login `unbound` and a bearer `token`, bound."""
    admin = project.http(project.new_key("admin")[1])
    for name, body in (
        ("site", {"method": "login", "login": FORM, "username": "u", "password": "p" + secrets.token_hex(6)}),
        (
            "unbound",
            {"method": "login", "login": FORM, "username": "u", "password": "p" + secrets.token_hex(6)},
        ),
        ("token", {"value": "v" + secrets.token_hex(8), "hosts": ["api.example.com"]}),
    ):
        assert admin.put(f"/v1/credentials/{name}", json=body).status_code == 200
    made = project.http().post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["site", "token"]})
    assert made.status_code == 201, made.text
    return made.json()["id"], "site"


def test_what_is_refused_before_the_browser_is_asked(
    fake_cluster: c.Cluster, project: c.Project, bound: tuple[str, str]
) -> None:
    sid, name = bound
    member = project.http()
    ok = {"credential": name}
    error(member.post(fill_url(sid), json={"credential": "unbound"}), 404, "not_found")  # not bound here
    error(member.post(fill_url(sid), json={"credential": "token"}), 404, "not_found")  # bound, not a login
    error(member.post(fill_url(sid), json={"credential": "missing"}), 404, "not_found")
    error(member.post(fill_url(new_sandbox_id()), json=ok), 404, "not_found")
    for bad in (
        {"credential": "bad name!"},
        {"credential": "x" * 65},
        {"credential": "../site"},
        ok | {"target_id": "../../json/close"},
        ok | {"target_id": "A" * 129},
        ok | {"target_id": "id\r\nX-Injected: 1"},
        ok | {"timeout_s": 0},
        ok | {"timeout_s": 301},
    ):
        error(member.post(fill_url(sid), json=bad), 400, "invalid_argument")
    for bad_shape in ({}, ok | {"script": "alert(1)"}, {"credential": ["site"]}):
        error(member.post(fill_url(sid), json=bad_shape), 422, "validation_error")
    huge = member.post(fill_url(sid), json={"credential": "x" * (9 << 20)})
    assert huge.status_code == 413, huge.status_code
    error(member.post("/v1/sandboxes/not-an-id/browser/login", json=ok), 400, "invalid_argument")
    read_only = project.http(project.new_key("read-only")[1])
    error(read_only.post(fill_url(sid), json=ok), 403, "permission_denied")
    other = c.new_project(fake_cluster)  # another project's key: the sandbox does not exist for it
    try:
        error(other.http().post(fill_url(sid), json=ok), 404, "not_found")
        # Its own sandbox with this project's credential name: no such credential is bound there.
        own = other.http().post("/v1/sandboxes", json={"limits": c.SMALL}).json()["id"]
        error(other.http().post(fill_url(own), json=ok), 404, "not_found")
    finally:
        c.delete_all(fake_cluster, other)


def test_a_sandbox_without_a_browser_is_a_typed_conflict_and_audited(
    project: c.Project, bound: tuple[str, str]
) -> None:
    sid, name = bound
    refused = project.http().post(fill_url(sid), json={"credential": name, "timeout_s": 5})
    details = error(refused, 409, "invalid_state")
    assert details.get("feature") == "browser", details
    with project.sdk() as sp, pytest.raises(InvalidState):
        sp.sandboxes.ref(sid).browser.login(name, timeout=5)
    admin = project.http(project.new_key("admin")[1])
    entries = admin.get(f"/v1/credentials/{name}/audit").json()["entries"]
    refusals = [e for e in entries if e["action"] == "login_fill_refused" and e["sandbox_id"] == sid]
    assert len(refusals) == 2 and refusals[0]["detail"]["error"] == "invalid_state", refusals


def test_the_mcp_tool_names_the_refusal(
    fake_cluster: c.Cluster, project: c.Project, bound: tuple[str, str]
) -> None:
    sid, name = bound

    async def scenario() -> tuple[str, str]:
        async with over_http(fake_cluster.url, project.key) as mcp:
            unbound = await mcp.refused("browser_login", {"id": sid, "credential": "unbound"})
            no_browser = await mcp.refused("browser_login", {"id": sid, "credential": name})
            return unbound, no_browser

    unbound, no_browser = asyncio.run(scenario())
    assert "not_found" in unbound and "invalid_state" in no_browser, (unbound, no_browser)
    with project.sdk() as sp, pytest.raises(NotFound):
        sp.sandboxes.ref(sid).browser.login("unbound")
