"""The credential store, egress policies and node credential hand-out through the real API processes (the
shared fake-driver cluster of tests/support/cluster.py): roles, project isolation, audit, expiry, rate
configuration, node authorization, and no plaintext value in any answer or in the database files."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.credential_manager import AuditForwarder, ControlPlaneCredentials
from space.node.agent.identity import IdentityAuth, NodeIdentity
from space.node.egress.credentials import Credential
from tests.support import cluster as c
from tests.support.node_identity import as_node

fake_cluster = c.fake_cluster
project = c.project

CANARIES: list[str] = []


def canary() -> str:
    value = "CANARY-" + secrets.token_hex(16)
    CANARIES.append(value)
    return value


def error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    body = answer.json()["error"]
    assert body["code"] == code, body
    return dict(body.get("details") or {})


def put(client: httpx.Client, name: str, **body: Any) -> httpx.Response:
    return client.put(f"/v1/credentials/{name}", json=body)


_ADMIN_KEYS: dict[str, str] = {}


def admin_key(project: c.Project) -> str:
    """A project admin key of `project` (made once): only admin keys create and change credentials."""
    if project.id not in _ADMIN_KEYS:
        _ADMIN_KEYS[project.id] = project.new_key("admin")[1]
    return _ADMIN_KEYS[project.id]


def admin(project: c.Project) -> httpx.Client:
    return project.http(admin_key(project))


admin_of = admin  # for tests that name a local `admin`


def node_client(cluster: c.Cluster, token: str) -> httpx.Client:
    """A client presenting `token` (a node's identity: see tests.support.node_identity.as_node)."""
    return cluster.http(headers={"Authorization": f"Bearer {token}"})


def node_id(cluster: c.Cluster) -> str:
    record = cluster.node_record()
    assert record is not None
    return record.id


def fetch(cluster: c.Cluster, sandbox_id: str, *, token: str, node: str | None = None) -> httpx.Response:
    return node_client(cluster, token).get(
        f"/v1/nodes/{node or node_id(cluster)}/sandboxes/{sandbox_id}/credentials"
    )


def actions(client: httpx.Client, name: str, **params: Any) -> list[str]:
    answer = client.get(f"/v1/credentials/{name}/audit", params=params)
    assert answer.status_code == 200, answer.text
    return [e["action"] for e in answer.json()["entries"]]


@pytest.fixture
def sandbox(project: c.Project) -> Iterator[dict[str, Any]]:
    """A running sandbox of `project` bound to credential "tok" (created here) with an allow list."""
    client = project.http()
    value = canary()
    assert (
        put(admin(project), "tok", value=value, hosts=["api.example.com"], rate_per_minute=42).status_code
        == 200
    )
    answer = client.post(
        "/v1/sandboxes",
        json={"limits": c.SMALL, "allow": ["API.example.com."], "credentials": ["tok"],
              "egress": {"deny": ["10.0.0.0/8"]}},
    )  # fmt: skip
    assert answer.status_code == 201, answer.text
    yield answer.json() | {"value": value}


# -- authentication ------------------------------------------------------------------------------------
TENANT_ROUTES: list[tuple[str, str, Any]] = [
    ("PUT", "/v1/credentials/x", {"value": "v", "hosts": ["a.example.com"]}),
    ("GET", "/v1/credentials", None),
    ("DELETE", "/v1/credentials/x", None),
    ("GET", "/v1/credentials/x/audit", None),
    ("GET", "/v1/sandboxes/{sb}/egress", None),
    ("PUT", "/v1/sandboxes/{sb}/egress", {"allow": []}),
    ("GET", "/v1/org/encryption-key", None),
    ("PUT", "/v1/org/encryption-key", {"service": "local"}),
    ("POST", "/v1/org/encryption-key/rotate", None),
    ("POST", "/v1/org/encryption-key/revoke", None),
]


@pytest.mark.parametrize(
    ("method", "path", "body"), TENANT_ROUTES, ids=[f"{m} {p}" for m, p, _b in TENANT_ROUTES]
)
def test_every_route_needs_an_api_key(fake_cluster: c.Cluster, method: str, path: str, body: Any) -> None:
    url = path.format(sb=new_sandbox_id())
    for headers in ({}, {"Authorization": f"Bearer space_{secrets.token_urlsafe(30)}"},
                    {"Authorization": f"Bearer {fake_cluster.node.token}"}):  # fmt: skip
        answer = fake_cluster.http(headers=headers).request(method, url, json=body)
        error(answer, 401, "unauthenticated")


# -- the value is write-only -----------------------------------------------------------------------------
def test_set_list_rotate_delete_never_return_the_value(project: c.Project) -> None:
    client = admin(project)
    first, second = canary(), canary()
    made = put(client, "openai", value=first, hosts=["llm.test"], header="Authorization: Bearer {value}")
    assert made.status_code == 200, made.text
    body = made.json()
    assert body["action"] == "create" and body["version"] == 1 and body["scope"] == "project"
    assert body["placeholder"].startswith("space-cred-openai-") and body["env_var"] == "OPENAI"
    rotated = put(client, "openai", value=second)
    assert rotated.json()["action"] == "rotate" and rotated.json()["version"] == 2
    assert rotated.json()["placeholder"] == body["placeholder"]
    listed = client.get("/v1/credentials")
    audit = client.get("/v1/credentials/openai/audit")
    for answer in (made, rotated, listed, audit):
        assert first not in answer.text and second not in answer.text
        assert "vault_ref" not in answer.text
    assert [c["name"] for c in listed.json()["credentials"]] == ["openai"]
    assert client.delete("/v1/credentials/openai").status_code == 200
    error(client.delete("/v1/credentials/openai"), 404, "not_found")
    assert actions(client, "openai") == ["create", "rotate", "delete"]
    assert client.get("/v1/credentials").json()["credentials"] == []


def test_validation_errors_name_their_field(project: c.Project) -> None:
    client = admin(project)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("ok", {"value": "v", "hosts": ["good.example.com", "bad host"]}, "hosts[1]"),
        ("ok", {"value": "v", "hosts": ["*"]}, "hosts[0]"),
        ("ok", {"value": "v"}, "hosts"),
        ("ok", {"hosts": ["a.example.com"]}, "value"),
        ("ok", {"value": "v", "hosts": ["a.example.com"], "header": "X-Key: static"}, "header"),
        ("ok", {"value": "v", "hosts": ["a.example.com"], "method": "query"}, "query_param"),
        ("ok", {"value": "nocolon", "hosts": ["a.example.com"], "method": "basic"}, "value"),
        ("ok", {"value": "v", "hosts": ["a.example.com"], "rate_per_minute": 0}, "rate_per_minute"),
        (
            "ok",
            {"value": "v", "hosts": ["a.example.com"], "expires_at": "2020-01-01T00:00:00Z"},
            "expires_at",
        ),
        ("ok", {"value": "v", "hosts": ["a.example.com"], "scope": "sandbox"}, "sandbox_id"),
        ("1bad", {"value": "v", "hosts": ["a.example.com"]}, "name"),
    ]
    for name, body, field in cases:
        assert error(put(client, name, **body), 400, "invalid_argument").get("field") == field, (body, field)
    answer = put(client, "ok", value="v", hosts=["a.example.com"], bogus=1)
    assert error(answer, 422, "validation_error")["fields"] == ["bogus"]
    assert client.get("/v1/credentials").json()["credentials"] == []


# -- roles and projects ----------------------------------------------------------------------------------
def test_read_only_keys_cannot_change_credentials(fake_cluster: c.Cluster, project: c.Project) -> None:
    assert put(admin_of(project), "gh", value=canary(), hosts=["code.test"]).status_code == 200
    _id, readonly = project.new_key("read-only")
    ro = fake_cluster.http(readonly)
    error(put(ro, "gh", value=canary()), 403, "permission_denied")
    error(put(ro, "new", value="v", hosts=["x.example.com"]), 403, "permission_denied")
    error(ro.delete("/v1/credentials/gh"), 403, "permission_denied")
    assert [c["name"] for c in ro.get("/v1/credentials").json()["credentials"]] == ["gh"]
    assert actions(ro, "gh") == ["create"]  # nothing happened
    # Org-wide credentials are for org admin keys only: a project admin is refused, the org admin is not.
    _id, project_admin = project.new_key("admin")
    error(put(fake_cluster.http(project_admin), "org-wide", value="v", hosts=["x.example.com"], scope="org"),
          403, "permission_denied")  # fmt: skip
    admin = fake_cluster.http(fake_cluster.admin_key, headers={"X-Space-Project": project.name})
    name = f"org-{secrets.token_hex(3)}"
    made = put(admin, name, value=canary(), hosts=["x.example.com"], scope="org")
    assert made.status_code == 200 and made.json()["scope"] == "org"
    assert name in [c["name"] for c in project.http().get("/v1/credentials").json()["credentials"]]
    assert admin.delete(f"/v1/credentials/{name}", params={"scope": "org"}).status_code == 200


def test_another_projects_credentials_are_invisible(fake_cluster: c.Cluster, project: c.Project) -> None:
    other = c.new_project(fake_cluster)
    theirs = admin(other)
    assert put(theirs, "their-secret", value=canary(), hosts=["x.example.com"]).status_code == 200
    mine = project.http()
    assert "their-secret" not in mine.get("/v1/credentials").text
    error(admin(project).delete("/v1/credentials/their-secret"), 404, "not_found")
    assert actions(mine, "their-secret") == []
    # Naming the other project explicitly is refused like a project that does not exist.
    error(put(admin(project), "their-secret", value="x", project=other.name), 404, "not_found")
    error(mine.get("/v1/credentials", params={"project": other.id}), 404, "not_found")
    # Binding it to a sandbox of this project: no such credential here.
    answer = mine.post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["their-secret"]})
    assert error(answer, 404, "not_found")["field"] == "credentials[0]"
    assert actions(theirs, "their-secret") == ["create"]


# -- sandboxes: policy at create and at run time ---------------------------------------------------------
def test_create_binds_credentials_and_records_the_policy(project: c.Project, sandbox: dict[str, Any]) -> None:
    client = project.http()
    placeholder = client.get("/v1/credentials").json()["credentials"][0]["placeholder"]
    assert sandbox["env"]["TOK"] == placeholder and sandbox["value"] not in str(sandbox["env"])
    policy = client.get(f"/v1/sandboxes/{sandbox['id']}/egress").json()
    assert (policy["allow"], policy["deny"], policy["credentials"]) == (
        ["api.example.com"],
        ["10.0.0.0/8"],
        ["tok"],
    )
    with project.sdk() as sp:
        sb = sp.sandboxes.get(sandbox["id"])
        seen = sb.exec("echo $TOK").stdout.strip()
    assert seen == placeholder  # the sandbox sees the placeholder, not the value
    assert "bind" in actions(client, "tok")
    bad = client.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["ok.example.com", "bad host"]})
    assert error(bad, 400, "invalid_argument")["field"] == "egress.allow[1]"


def test_policy_changes_at_run_time(
    fake_cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    client = project.http()
    path = f"/v1/sandboxes/{sandbox['id']}/egress"
    changed = client.put(path, json={"allow": ["pkg.test", "*.Pkg.Test"]})
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert body["allow"] == ["pkg.test", "*.pkg.test"] and body["deny"] == ["10.0.0.0/8"]  # deny kept
    assert body["credentials"] == ["tok"] and body["version"] == 2
    # The node got the push; it has no egress gateway wired yet, and says so (see ADR 0017, gaps).
    assert body["applied"] is False and "gateway" in (body["node_error"] or "")
    unbound = client.put(path, json={"credentials": []}).json()
    assert unbound["credentials"] == [] and unbound["version"] == 3
    assert actions(client, "tok")[-1] == "unbind"
    _id, readonly = project.new_key("read-only")
    error(fake_cluster.http(readonly).put(path, json={"allow": []}), 403, "permission_denied")
    error(c.new_project(fake_cluster).http().put(path, json={"allow": []}), 404, "not_found")
    with project.sdk() as sp:
        again = sp.sandboxes.get(sandbox["id"]).set_egress(deny=["192.168.0.0/16"])
    assert again["deny"] == ["192.168.0.0/16"] and again["allow"] == ["pkg.test", "*.pkg.test"]


def test_a_fork_inherits_its_parents_policy_and_bindings(
    fake_cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    client = project.http()
    forked = client.post(f"/v1/sandboxes/{sandbox['id']}/fork", json={"count": 1})
    assert forked.status_code == 201, forked.text
    child = forked.json()["sandboxes"][0]
    assert child["env"]["TOK"] == sandbox["env"]["TOK"]
    policy = client.get(f"/v1/sandboxes/{child['id']}/egress").json()
    assert (policy["allow"], policy["credentials"]) == (["api.example.com"], ["tok"])
    with as_node(fake_cluster) as (_node, identity):
        bundle = fetch(fake_cluster, child["id"], token=identity).json()
    assert [x["value"] for x in bundle["credentials"]] == [sandbox["value"]]
    # Changing the child's policy leaves the parent's alone, and starts from the inherited lists.
    changed = client.put(f"/v1/sandboxes/{child['id']}/egress", json={"deny": ["192.168.0.0/16"]}).json()
    assert changed["allow"] == ["api.example.com"] and changed["credentials"] == ["tok"]
    assert client.get(f"/v1/sandboxes/{sandbox['id']}/egress").json()["deny"] == ["10.0.0.0/8"]


# -- the node side ---------------------------------------------------------------------------------------
def test_a_node_gets_values_only_for_its_own_sandboxes(
    fake_cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    with as_node(fake_cluster) as (_node, identity):
        answer = fetch(fake_cluster, sandbox["id"], token=identity)
        assert answer.status_code == 200, answer.text
        # A sandbox that does not exist looks like one elsewhere: 403, nothing learned.
        error(fetch(fake_cluster, new_sandbox_id(), token=identity), 403, "permission_denied")
    bundle = answer.json()
    (cred,) = bundle["credentials"]
    assert cred["name"] == "tok" and cred["value"] == sandbox["value"] and cred["rate_per_minute"] == 42
    assert cred["hosts"] == ["api.example.com"] and cred["header_name"] == "Authorization"
    assert bundle["policy"]["allow"] == ["api.example.com"]
    # Another registered node (its own identity) asking for this sandbox: 403, whatever it claims.
    other_token = secrets.token_urlsafe(32)
    other = fake_cluster.store.register_node(
        f"http://127.0.0.1:1/{secrets.token_hex(4)}", other_token, identity=other_token
    )
    fake_cluster.store.set_node_status(other.id, "draining")  # never scheduled onto
    error(fetch(fake_cluster, sandbox["id"], node=other.id, token=other_token), 403, "permission_denied")
    # ... and it cannot pose as the right node with its own identity, nor use a made-up token, nor the
    # cluster's bootstrap token (which only registers; ADR 0019).
    error(fetch(fake_cluster, sandbox["id"], token=other_token), 401, "unauthenticated")
    error(fetch(fake_cluster, sandbox["id"], token="nope"), 401, "unauthenticated")
    error(fetch(fake_cluster, sandbox["id"], token=fake_cluster.node.token), 401, "unauthenticated")
    error(fake_cluster.http().get(f"/v1/nodes/{node_id(fake_cluster)}/sandboxes/{sandbox['id']}/credentials"),
          401, "unauthenticated")  # fmt: skip
    # API keys are not node tokens.
    error(fetch(fake_cluster, sandbox["id"], token=project.key), 401, "unauthenticated")
    entries = project.http().get("/v1/credentials/tok/audit").json()["entries"]
    fetched = [e for e in entries if e["action"] == "fetched_by_node"]
    assert len(fetched) == 1 and fetched[0]["actor"] == f"node:{node_id(fake_cluster)}"
    assert fetched[0]["sandbox_id"] == sandbox["id"]


def test_node_reports_uses_into_the_audit_log(
    fake_cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    sid, host = sandbox["id"], "api.example.com"
    events = [
        {"sandbox_id": sid, "action": "injected", "credential": "tok", "host": host, "at": time.time()},
        {"sandbox_id": sid, "action": "rate_limited", "credential": "tok", "host": host},
        {"sandbox_id": sid, "action": "egress_denied", "host": "evil.example.net"},
        {"sandbox_id": new_sandbox_id(), "action": "injected", "credential": "tok"},  # not on this node
    ]
    with as_node(fake_cluster) as (node, identity):
        answer = node_client(fake_cluster, identity).post(f"/v1/nodes/{node}/audit", json={"events": events})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"accepted": 3, "rejected": 1}
    log = project.http().get("/v1/credentials/tok/audit").json()["entries"]
    assert [e["action"] for e in log][-2:] == ["injected", "rate_limited"]
    assert log[-1]["host"] == "api.example.com" and log[-1]["actor"].startswith("node:")
    refused = node_client(fake_cluster, "nope").post(
        f"/v1/nodes/{node_id(fake_cluster)}/audit", json={"events": []}
    )
    error(refused, 401, "unauthenticated")


def test_node_credential_manager_fetches_caches_and_reports(
    fake_cluster: c.Cluster, project: c.Project, sandbox: dict[str, Any]
) -> None:
    """The node's credential manager (space.node.agent.credential_manager, what the gateway uses) against the
    real control plane: values for its sandbox, one fetch for many asks, audit records forwarded."""
    sid, node = sandbox["id"], node_id(fake_cluster)

    async def scenario() -> tuple[list[Credential], dict[str, Any], list[Credential]]:
        # As the node builds it (space.node.agent.egress_wiring.install): its identity, read per request.
        auth = IdentityAuth(NodeIdentity(node, identity))
        async with httpx.AsyncClient(base_url=fake_cluster.url, auth=auth) as http:
            source = ControlPlaneCredentials(http, lambda: node)
            first = await source.credentials(sid)
            await asyncio.gather(*(source.credentials(sid) for _ in range(5)))  # served from the cache
            policy = await source.policy(sid)
            forwarder = AuditForwarder(http, lambda: node)
            forwarder({"event": "credential", "sandbox_id": sid, "credential": "tok",
                       "host": "api.example.com", "ts": time.time(), "decision": "injected"})  # fmt: skip
            forwarder({"event": "egress", "sandbox_id": sid, "host": "x" * 300, "decision": "denied"})
            forwarder({"event": "egress", "sandbox_id": sid, "host": "ok.example", "decision": "allowed"})
            await forwarder.flush()
            foreign = await source.credentials(new_sandbox_id())  # 403 from the control plane: nothing
        return first, policy, foreign

    with as_node(fake_cluster) as (_node, identity):
        credentials, policy, foreign = asyncio.run(scenario())
    (cred,) = credentials
    assert cred.value == sandbox["value"] and cred.rate_per_minute == 42 and foreign == []
    assert cred.binds("api.example.com") and not cred.binds("evil.example.com")
    assert policy["allow"] == ["api.example.com"] and policy["deny"] == ["10.0.0.0/8"]
    log = project.http().get("/v1/credentials/tok/audit").json()["entries"]
    assert [e["action"] for e in log].count("fetched_by_node") == 1
    assert log[-1]["action"] == "injected" and log[-1]["actor"] == f"node:{node}"
    denied = fake_cluster.store.engine  # the egress denial has no credential: look in the table
    with denied.connect() as db:
        rows = db.exec_driver_sql(
            "SELECT action, host FROM credential_audit WHERE sandbox_id = ? AND action = 'egress_denied'",
            (sid,),
        ).all()
    assert [(r.action, len(r.host)) for r in rows] == [("egress_denied", 255)]  # kept, host cut


def test_expired_credentials_are_not_handed_out(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = project.http()
    expires = datetime.now(UTC) + timedelta(seconds=3)
    made = put(
        admin(project), "short", value=canary(), hosts=["api.example.com"], expires_at=expires.isoformat()
    )
    assert made.status_code == 200 and made.json()["expired"] is False
    sb = client.post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["short"]})
    assert sb.status_code == 201, sb.text
    with as_node(fake_cluster) as (_node, identity):
        first = fetch(fake_cluster, sb.json()["id"], token=identity).json()
        c.wait_for(lambda: datetime.now(UTC) > expires + timedelta(seconds=0.5), timeout=10, what="expiry")
        later = fetch(fake_cluster, sb.json()["id"], token=identity).json()
    assert [x["name"] for x in first["credentials"]] == ["short"] and first["expired"] == []
    assert later["credentials"] == [] and later["expired"] == ["short"]
    assert client.get("/v1/credentials").json()["credentials"][0]["expired"] is True
    assert actions(client, "short")[-1] == "expired"
    # Clearing the expiry (explicit null) makes it usable again.
    assert put(admin(project), "short", expires_at=None).json()["expires_at"] is None
    with as_node(fake_cluster) as (_node, identity):
        again = fetch(fake_cluster, sb.json()["id"], token=identity).json()
    assert [x["name"] for x in again["credentials"]] == ["short"]


def test_rate_limit_configuration_is_persisted(fake_cluster: c.Cluster, project: c.Project) -> None:
    client = admin(project)
    assert put(client, "rl", value=canary(), hosts=["api.example.com"], rate_per_minute=42).status_code == 200
    assert client.get("/v1/credentials").json()["credentials"][0]["rate_per_minute"] == 42
    assert put(client, "rl", rate_per_minute=7).json()["rate_per_minute"] == 7
    record = fake_cluster.store  # the database itself, read by another process than the API's
    from space.controlplane.store.credentials import CredentialStore

    stored = CredentialStore(record).get_credential(project.id, "rl")
    assert stored is not None and stored.rate_per_minute == 7
    assert put(client, "rl", rate_per_minute=None).json()["rate_per_minute"] is None


def test_sdk_surface(project: c.Project) -> None:
    with project.cluster.sdk(admin_key(project)) as sp:
        cred = sp.credentials.set(
            "sdk-cred", value=f"user:{canary()}", hosts=["api.example.com"], method="basic"
        )
        assert cred["method"] == "basic" and cred["header"] == "Authorization: Basic {value}"
        assert [c.name for c in sp.credentials.list()] == ["sdk-cred"]
        sb = sp.sandboxes.create(
            limits=c.SMALL, allow=["pkg.test"], credentials=["sdk-cred"], deny=["10.0.0.0/8"]
        )
        assert sb.egress()["credentials"] == ["sdk-cred"] and sb.egress()["deny"] == ["10.0.0.0/8"]
        sp.credentials.delete("sdk-cred")
        assert [e["action"] for e in sp.credentials.audit("sdk-cred")] == ["create", "bind", "delete"]


def test_cli_against_the_real_api(project: c.Project) -> None:
    """`space credential set/list/audit/delete`, `space sandbox create --allow --credential` and `space
    sandbox egress` as a user types them (typer's runner in this process, real control plane)."""
    from typer.testing import CliRunner

    from space.cli.main import app

    runner = CliRunner()
    base = ["--url", project.cluster.url, "--api-key", admin_key(project)]

    def space(*args: str, input: str | None = None) -> str:
        result = runner.invoke(app, [*base, *args], input=input)
        assert result.exit_code == 0, result.output
        return result.stdout

    secret = canary()
    out = space("credential", "set", "cli-cred", "--value", "-", "--host", "api.example.com",
                "--header", "X-Api-Key: {value}", "--rate-per-minute", "9", input=secret + "\n")  # fmt: skip
    name, placeholder = out.split()
    assert name == "cli-cred" and placeholder.startswith("space-cred-cli-cred-") and secret not in out
    listed = json.loads(space("credential", "list", "--json"))
    assert [(x["name"], x["header"], x["rate_per_minute"]) for x in listed] == [
        ("cli-cred", "X-Api-Key: {value}", 9)
    ]
    sandbox_id = space("sandbox", "create", "--allow", "pkg.test", "--credential", "cli-cred",
                       "--deny", "10.0.0.0/8", "--memory-mb", "64", "--cpus", "0.1").strip()  # fmt: skip
    shown = json.loads(space("sandbox", "egress", sandbox_id, "--json"))
    assert shown["allow"] == ["pkg.test"] and shown["credentials"] == ["cli-cred"]
    assert shown["deny"] == ["10.0.0.0/8"]
    changed = json.loads(space("sandbox", "egress", sandbox_id, "--allow", "*.pkg.test", "--json"))
    assert changed["allow"] == ["*.pkg.test"] and changed["version"] == 2
    space("credential", "delete", "cli-cred")
    audit = json.loads(space("credential", "audit", "cli-cred", "--json"))
    assert [e["action"] for e in audit] == ["create", "bind", "delete"]
    assert all(secret not in json.dumps(e) for e in audit)


def test_no_value_ever_reached_the_database_files(fake_cluster: c.Cluster) -> None:
    """Runs last in this module: every canary set above, searched for in the control plane's SQLite files."""
    assert CANARIES, "the tests above set credentials"
    fake_cluster.store.engine.dispose()
    directory = fake_cluster.root / "cp"
    blobs = b"".join(p.read_bytes() for p in directory.iterdir() if p.name.startswith("controlplane.db"))
    assert blobs
    found = [value for value in CANARIES if value.encode() in blobs]
    assert found == []
    key = directory / "credentials.master.key"
    assert key.exists() and oct(key.stat().st_mode & 0o777) == oct(0o600)
