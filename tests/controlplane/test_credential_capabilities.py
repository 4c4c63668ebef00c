"""Credentials by capability and egress scope rules, attacked through the real API processes (the shared
fake-driver cluster of tests/support/cluster.py; ADR 0026):

- a member key binds existing credentials to its sandboxes and can do nothing else with them: it cannot
  create, rotate, re-point (hosts), re-template (method, header, query parameter, env var), re-scope,
  re-time (expiry, rate) or delete one; every refused attempt leaves the credential and its audit log
  exactly as they were;
- host patterns and allow-list wildcards on public suffixes are refused (`*.com`, `*.co.uk`, `com`,
  `*.github.io`), whoever asks;
- private, shared, loopback, link-local ranges in an allow list are refused (in every spelling) unless an
  org admin opened them for the project; narrowing that approval reaches the node at the next hand-out.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from space.controlplane.credentials.service import CredentialService
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project


def error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    body = answer.json()["error"]
    assert body["code"] == code, body
    return dict(body.get("details") or {})


def put(client: httpx.Client, name: str, **body: Any) -> httpx.Response:
    return client.put(f"/v1/credentials/{name}", json=body)


def org_admin(cluster: c.Cluster, project: c.Project) -> httpx.Client:
    return cluster.http(cluster.admin_key, headers={"X-Space-Project": project.name})


def handed_to_node(cluster: c.Cluster, project: c.Project, sandbox_id: str) -> dict[str, Any]:
    """What the node-facing credential route hands the sandbox's node (the service function that route
    answers with, on the cluster's own database and vault key)."""
    service = CredentialService.open(cluster.store, cluster.root / "cp")
    sandbox = cluster.store.get_sandbox(project.id, sandbox_id)
    org = cluster.store.get_project(project.id)
    assert sandbox is not None and sandbox.node_id is not None and org is not None
    return service.bundle_for_node(sandbox.node_id, sandbox, org.org_id).to_wire()


def test_members_bind_credentials_and_nothing_more(fake_cluster: c.Cluster, project: c.Project) -> None:
    admin = project.http(project.new_key("admin")[1])
    member = project.http()
    value = "CANARY-" + secrets.token_hex(16)
    made = put(admin, "gh", value=value, hosts=["api.example.com"], rate_per_minute=10)
    assert made.status_code == 200, made.text
    sandbox = member.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["api.example.com"]})
    assert sandbox.status_code == 201, sandbox.text
    sid = sandbox.json()["id"]
    before = member.get("/v1/credentials").json()["credentials"]
    log_before = member.get("/v1/credentials/gh/audit").json()["entries"]
    attacks: list[dict[str, Any]] = [
        {"hosts": ["attacker.example.net"]},  # send the real value to a host the member controls
        {"hosts": ["api.example.com", "*.attacker.example.net"]},
        {"method": "query", "query_param": "leak"},  # put it where the upstream logs it
        {"header": "X-Leak: {value}"},
        {"method": "basic"},
        {"env_var": "PATH"},
        {"rate_per_minute": 1_000_000},
        {"expires_at": None},
        {"value": "member-chosen-value"},  # rotation
        {"value": "x", "hosts": ["api.example.com"], "scope": "sandbox", "sandbox_id": sid},  # a shadow
        {"value": "x", "hosts": ["attacker.example.net"], "scope": "org"},
    ]
    for body in attacks:
        error(put(member, "gh", **body), 403, "permission_denied")
    error(put(member, "new-one", value="v", hosts=["x.example.com"]), 403, "permission_denied")
    error(member.delete("/v1/credentials/gh"), 403, "permission_denied")
    sandbox_scoped = {"scope": "sandbox", "sandbox_id": sid}
    error(member.delete("/v1/credentials/gh", params=sandbox_scoped), 403, "permission_denied")
    assert member.get("/v1/credentials").json()["credentials"] == before  # nothing changed
    assert member.get("/v1/credentials/gh/audit").json()["entries"] == log_before
    # What a member may do: bind the existing credential, at create and at run time, and unbind it.
    bound = member.put(f"/v1/sandboxes/{sid}/egress", json={"credentials": ["gh"]})
    assert bound.status_code == 200 and bound.json()["credentials"] == ["gh"], bound.text
    created = member.post("/v1/sandboxes", json={"limits": c.SMALL, "credentials": ["gh"]})
    assert created.status_code == 201 and created.json()["env"]["GH"].startswith("space-cred-gh-")
    assert member.put(f"/v1/sandboxes/{sid}/egress", json={"credentials": []}).json()["credentials"] == []
    # The node still gets the value for the hosts the admin chose, and nothing else.
    (handed,) = handed_to_node(fake_cluster, project, created.json()["id"])["credentials"]
    assert handed["hosts"] == ["api.example.com"] and handed["value"] == value
    # The project admin (and the org admin) may change it.
    assert put(admin, "gh", hosts=["api.example.com", "uploads.example.com"]).status_code == 200
    assert put(org_admin(fake_cluster, project), "gh", rate_per_minute=5).json()["rate_per_minute"] == 5


@pytest.mark.parametrize(
    "host", ["*.com", "*.co.uk", "com", "co.uk", "*.github.io", "*.s3.amazonaws.com", "localhost", "*.ck"]
)
def test_credential_hosts_on_public_suffixes_are_refused(project: c.Project, host: str) -> None:
    admin = project.http(project.new_key("admin")[1])
    answer = put(admin, "wide", value="v", hosts=["api.example.com", host])
    assert error(answer, 400, "invalid_argument")["field"] == "hosts[1]"
    assert admin.get("/v1/credentials").json()["credentials"] == []


def test_allow_wildcards_on_public_suffixes_are_refused(project: c.Project) -> None:
    member = project.http()
    for pattern in ["*.com", "*.CO.UK.", "*.github.io", "*.xn--p1ai", "*.рф"]:
        answer = member.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["ok.example.com", pattern]})
        assert error(answer, 400, "invalid_argument")["field"] == "egress.allow[1]", pattern
    made = member.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["*.example.co.uk"]})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    error(member.put(f"/v1/sandboxes/{sid}/egress", json={"allow": ["*.co.uk"]}), 400, "invalid_argument")
    # Deny lists may name anything (denying more is never a risk).
    denied = member.put(f"/v1/sandboxes/{sid}/egress", json={"deny": ["*.com"]})
    assert denied.status_code == 200 and denied.json()["allow"] == ["*.example.co.uk"], denied.text


PRIVATE_SPELLINGS = [
    "10.0.0.0/8", "10.1.2.3", "0x0a.1.2.3", "012.1.2.3", "167837955", "172.16.0.0/12", "192.168.1.0/24",
    "100.64.0.0/10", "fc00::/7", "[fd00::1]", "fd00::/8", "::ffff:10.0.0.0/104", "::ffff:10.1.2.3",
    "64:ff9b::a01:203",
]  # fmt: skip
NEVER = ["127.0.0.1", "127.0.0.0/8", "::1", "169.254.169.254", "fe80::/10", "[fe80::1]", "0.0.0.0/8"]


def test_private_ranges_need_an_org_admin(fake_cluster: c.Cluster, project: c.Project) -> None:
    member = project.http()
    project_admin = project.http(project.new_key("admin")[1])
    for entry in PRIVATE_SPELLINGS + NEVER:
        answer = member.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["api.example.com", entry]})
        assert error(answer, 400, "invalid_argument")["field"] == "egress.allow[1]", entry
    made = member.post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["0.0.0.0/0", "8.8.8.8"],
                                              "egress": {"deny": ["10.0.0.0/8"]}})  # fmt: skip
    assert made.status_code == 201, made.text  # public ranges (0/0 does not open 10/8 at the gateway)
    sid = made.json()["id"]
    path = f"/v1/projects/{project.name}/private-networks"
    wanted = {"allowed_private_networks": ["10.1.0.0/16"]}
    # Only an org admin opens private ranges: not the project's own keys, not another project.
    error(member.put(path, json=wanted), 403, "permission_denied")
    error(project_admin.put(path, json=wanted), 403, "permission_denied")
    other = c.new_project(fake_cluster)
    error(other.http().get(path), 404, "not_found")
    error(other.http().get(f"/v1/projects/{project.id}/private-networks"), 404, "not_found")
    assert member.get(path).json()["allowed_private_networks"] == []
    org = org_admin(fake_cluster, project)
    for bad in (["127.0.0.0/8"], ["169.254.0.0/16"], ["8.8.8.0/24"], ["0.0.0.0/0"], ["nope"], "10.0.0.0/8"):
        assert org.put(path, json={"allowed_private_networks": bad}).status_code in (400, 422), bad
    opened = org.put(path, json=wanted)
    assert opened.status_code == 200 and opened.json()["allowed_private_networks"] == ["10.1.0.0/16"]
    assert member.get(path).json()["allowed_private_networks"] == ["10.1.0.0/16"]
    # Inside the approval: accepted in any spelling; outside it (or a supernet of it): refused.
    ok = member.put(f"/v1/sandboxes/{sid}/egress", json={"allow": ["10.1.2.0/24", "0x0a.1.9.9"]})
    assert ok.status_code == 200 and ok.json()["allow"] == ["10.1.2.0/24", "10.1.9.9/32"], ok.text
    for entry in ("10.2.0.0/16", "10.0.0.0/8", "192.168.1.1", "fd00::1", "127.0.0.1"):
        error(member.put(f"/v1/sandboxes/{sid}/egress", json={"allow": [entry]}), 400, "invalid_argument")
    # The other project got nothing from this approval.
    theirs = other.http().post("/v1/sandboxes", json={"limits": c.SMALL, "allow": ["10.1.2.0/24"]})
    error(theirs, 400, "invalid_argument")
    handed = handed_to_node(fake_cluster, project, sid)["policy"]
    assert handed["allow"] == ["10.1.2.0/24", "10.1.9.9/32"]
    assert handed["private_networks"] == ["10.1.0.0/16"]  # the node's gateway checks it again
    # Narrowing the approval: the stored policy keeps its entries, the node no longer gets them.
    assert org.put(path, json={"allowed_private_networks": []}).status_code == 200
    handed = handed_to_node(fake_cluster, project, sid)["policy"]
    assert handed["allow"] == [] and handed["private_networks"] == []
    assert member.get(f"/v1/sandboxes/{sid}/egress").json()["allow"] == ["10.1.2.0/24", "10.1.9.9/32"]
    audit = fake_cluster.store.engine
    with audit.connect() as db:
        rows = db.exec_driver_sql(
            "SELECT actor FROM credential_audit WHERE project_id = ? AND action = 'private_networks_set'",
            (project.id,),
        ).all()
    assert len(rows) == 2 and all(r.actor.startswith("key:") for r in rows)
