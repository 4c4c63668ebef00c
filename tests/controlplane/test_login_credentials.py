"""`login` credentials through the real API processes (the shared fake-driver cluster): create, rotate and
list never return the username or password; validation; the login route hands the placeholders of a bound
credential only, to member keys of the sandbox's project; the node's bundle splits username and password
and the node's credential manager builds a gateway credential from it (ADR 0063). The gateway's form
substitution over real TLS is tests/network/test_egress_login.py."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.credential_manager import ControlPlaneCredentials
from space.node.agent.identity import IdentityAuth, NodeIdentity
from tests.support import cluster as c
from tests.support.mcp_clients import over_http
from tests.support.node_identity import as_node

fake_cluster = c.fake_cluster
project = c.project

FORM = {"origin": "https://Login.Example.com:443/", "username_field": "email", "password_field": "pw",
        "form_action": "/session"}  # fmt: skip


def error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    body = answer.json()["error"]
    assert body["code"] == code, body
    return dict(body.get("details") or {})


def put(client: httpx.Client, name: str, **body: Any) -> httpx.Response:
    return client.put(f"/v1/credentials/{name}", json=body)


def admin(project: c.Project) -> httpx.Client:
    return project.http(project.new_key("admin")[1])


def fetch(cluster: c.Cluster, sandbox_id: str, *, token: str) -> httpx.Response:
    record = cluster.node_record()
    assert record is not None
    http = cluster.http(headers={"Authorization": f"Bearer {token}"})
    return http.get(f"/v1/nodes/{record.id}/sandboxes/{sandbox_id}/credentials")


def login_url(sandbox_id: str, name: str) -> str:
    return f"/v1/sandboxes/{sandbox_id}/credentials/{name}/login"


def test_login_credentials_end_to_end_through_the_api(fake_cluster: c.Cluster, project: c.Project) -> None:
    username, password = "user-" + secrets.token_hex(8), "pw&=+ " + secrets.token_hex(8)
    client = admin(project)
    made = put(client, "site", method="login", login=FORM, username=username, password=password)
    assert made.status_code == 200, made.text
    body = made.json()
    assert body["method"] == "login" and body["hosts"] == ["login.example.com"]
    assert body["login"] == {"origin": "https://login.example.com", "username_field": "email",
                             "password_field": "pw", "form_action": "/session"}  # fmt: skip
    assert body["username_placeholder"].startswith("space-user-site-")
    assert body["username_placeholder"][len("space-user-") :] == body["placeholder"][len("space-cred-") :]
    second = "pw2-" + secrets.token_hex(8)
    rotated = put(client, "site", username=username, password=second)
    assert rotated.json()["action"] == "rotate" and rotated.json()["placeholder"] == body["placeholder"]
    listed = client.get("/v1/credentials")
    for answer in (made, rotated, listed, client.get("/v1/credentials/site/audit")):
        for secret in (username, password, second):
            assert secret not in answer.text

    sandbox = project.http().post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["site"]})
    assert sandbox.status_code == 201, sandbox.text
    sid = sandbox.json()["id"]
    member = project.http()
    answer = member.post(login_url(sid, "site"))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "credential": "site", "origin": "https://login.example.com", "form_action": "/session",
        "fields": {"email": body["username_placeholder"], "pw": body["placeholder"]},
    }  # fmt: skip
    assert "login_requested" in [
        e["action"] for e in client.get("/v1/credentials/site/audit").json()["entries"]
    ]
    # The same through the SDK and the MCP tool (the caller's member key).
    with project.sdk() as sp:
        assert sp.sandboxes.ref(sid).login_placeholders("site") == answer.json()

    async def over_mcp() -> str:
        async with over_http(fake_cluster.url, project.key) as mcp:
            return await mcp.ok("login_placeholders", {"id": sid, "credential": "site"})

    text = asyncio.run(over_mcp())
    assert "https://login.example.com" in text and f"pw={body['placeholder']}" in text

    # The node's bundle: the password as the value, the username beside it, the form; the node's manager
    # makes a gateway credential of it that matches exactly the form's origin and action.
    with as_node(fake_cluster) as (node, identity):
        bundle = fetch(fake_cluster, sid, token=identity).json()
        (wire,) = bundle["credentials"]
        assert (wire["value"], wire["username"], wire["origin"]) == (
            second,
            username,
            "https://login.example.com",
        )

        async def from_manager() -> Any:
            auth = IdentityAuth(NodeIdentity(node, identity))
            async with httpx.AsyncClient(base_url=fake_cluster.url, auth=auth) as http:
                return await ControlPlaneCredentials(http, lambda: node).credentials(sid)

        (credential,) = asyncio.run(from_manager())
    assert credential.method == "login" and credential.value == second and credential.username == username
    assert credential.login_matches("https", "login.example.com", 443, "/session")
    assert not credential.login_matches("https", "login.example.com", 443, "/other")
    assert credential.username_placeholder == body["username_placeholder"]


def test_login_route_refuses_what_the_caller_may_not_have(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = admin(project)
    put(client, "bound", method="login", login=FORM, username="u", password="p" + secrets.token_hex(4))
    put(client, "unbound", method="login", login=FORM, username="u", password="p" + secrets.token_hex(4))
    put(client, "bearer", value="v" + secrets.token_hex(8), hosts=["api.example.com"])
    made = project.http().post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["bound", "bearer"]})
    sid = made.json()["id"]
    member = project.http()
    error(member.post(login_url(sid, "unbound")), 404, "not_found")  # exists, not bound to this sandbox
    error(member.post(login_url(sid, "bearer")), 404, "not_found")  # bound, not a login
    error(member.post(login_url(sid, "missing")), 404, "not_found")
    error(member.post(login_url(new_sandbox_id(), "bound")), 404, "not_found")
    error(member.post(login_url("not-an-id", "bound")), 400, "invalid_argument")
    error(member.post(login_url(sid, "bad name!")), 400, "invalid_argument")
    error(
        project.http(project.new_key("read-only")[1]).post(login_url(sid, "bound")), 403, "permission_denied"
    )
    other = c.new_project(fake_cluster)  # another project's key: the sandbox does not exist for it
    try:
        error(other.http().post(login_url(sid, "bound")), 404, "not_found")
    finally:
        c.delete_all(fake_cluster, other)


LOGIN = {"method": "login", "login": FORM, "username": "u", "password": "p"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (LOGIN | {"login": FORM | {"origin": "http://login.example.com"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://login.example.com/path"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://user@login.example.com"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://*.example.com"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://10.1.2.3"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://com"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"origin": "https://login.example.com:99999"}}, "login.origin"),
        (LOGIN | {"login": FORM | {"password_field": "email"}}, "login"),
        (LOGIN | {"login": FORM | {"username_field": "a&b"}}, "login.username_field"),
        (LOGIN | {"login": FORM | {"form_action": "session"}}, "login.form_action"),
        (LOGIN | {"value": "x"}, "value"),
        (LOGIN | {"hosts": ["evil.example.net"]}, "hosts"),
        ({k: v for k, v in LOGIN.items() if k != "password"}, "password"),
        ({"method": "login", "username": "u", "password": "p"}, "login"),
        (LOGIN | {"method": "bearer"}, "login"),
        ({"value": "v", "hosts": ["api.example.com"], "username": "u"}, "username"),
    ],
)
def test_login_validation_names_the_field(project: c.Project, body: dict[str, Any], field: str) -> None:
    details = error(put(admin(project), "bad", **body), 400, "invalid_argument")
    assert details.get("field") == field, details


def test_a_login_credential_cannot_be_repointed_by_hosts_or_turned_into_another_kind(
    project: c.Project,
) -> None:
    client = admin(project)
    assert (
        put(client, "fixed", login=FORM, username="u", password="p-" + secrets.token_hex(4)).status_code
        == 200
    )
    error(put(client, "fixed", hosts=["evil.example.net"]), 400, "invalid_argument")
    error(put(client, "fixed", method="bearer", value="v"), 400, "invalid_argument")
    put(client, "plain", value="v-" + secrets.token_hex(8), hosts=["api.example.com"])
    error(put(client, "plain", login=FORM, username="u", password="p"), 400, "invalid_argument")
    moved = put(client, "fixed", login=FORM | {"origin": "https://auth.example.com"})
    assert moved.status_code == 200 and moved.json()["hosts"] == ["auth.example.com"]


def test_sdk_and_cli_create_login_credentials_without_echoing_them(project: c.Project) -> None:
    from typer.testing import CliRunner

    from space.cli.main import app

    key = project.new_key("admin")[1]
    password = "cli-pw-" + secrets.token_hex(8)
    with project.cluster.sdk(key) as sp:
        made = sp.credentials.set("sdk-login", login=FORM, username="sdk-user", password=password)
        assert made["method"] == "login" and made["hosts"] == ["login.example.com"]
    result = CliRunner().invoke(
        app,
        ["--url", project.cluster.url, "--api-key", key, "credential", "set", "cli-login",
         "--login-origin", "https://login.example.com", "--username-field", "email",
         "--password-field", "pw", "--username", "cli-user", "--password", "-", "--json"],
        input=password + "\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert password not in result.output and "cli-user" not in result.output
    shown = admin(project).get("/v1/credentials").json()["credentials"]
    logins = {x["name"]: x["login"] for x in shown if x["method"] == "login"}
    assert logins["cli-login"] == {"origin": "https://login.example.com", "username_field": "email",
                                   "password_field": "pw", "form_action": None}  # fmt: skip
    assert set(logins) == {"sdk-login", "cli-login"}
