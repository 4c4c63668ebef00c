"""Authentication and authorization on every route of docs/api.md, against a real control plane process.

- no key, a malformed header, an unknown key, a revoked key: 401 `unauthenticated`, on every route;
- a key of project A naming a sandbox of project B: exactly the answer for a sandbox that does not exist
  (404, same body once the ids are swapped), and B's sandbox is untouched;
- a read-only key may GET everything of its project and gets 403 `permission_denied` on every mutation,
  without side effects; only an org admin key creates projects; a project admin manages only its keys.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from space.core.ids import new_api_key_id, new_sandbox_id, new_snapshot_id
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project

ACTIONS = ("pause", "resume", "stop", "start", "suspend", "restore")


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # placeholders: {sb} sandbox id, {snap} snapshot id, {pid} process id, {key} API key id
    body: Any = None  # a dict is sent as JSON, bytes as the raw body
    stream: bool = False  # an endless NDJSON answer: only its status is read

    @property
    def mutating(self) -> bool:
        return self.method != "GET"

    @property
    def per_sandbox(self) -> bool:
        return "{sb}" in self.path

    def __str__(self) -> str:
        return f"{self.method} {self.path}"

    def send(self, client: httpx.Client, **values: str) -> httpx.Response:
        path = self.path.format(**values)
        body = self.body
        if isinstance(body, dict):
            body = {k: v.format(**values) if isinstance(v, str) else v for k, v in body.items()}
        kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
        if self.stream:
            with client.stream(self.method, path, **kwargs) as answer:
                if answer.status_code >= 400:
                    answer.read()  # an error is small; a success streams for ever: only its status counts
                return answer
        return client.request(self.method, path, **kwargs)


# Every HTTP route of docs/api.md (the PTY WebSocket is tested on its own below).
ROUTES = [
    Route("POST", "/v1/sandboxes", {"template": "python", "limits": c.SMALL}),
    Route("GET", "/v1/sandboxes"),
    Route("GET", "/v1/sandboxes/{sb}"),
    Route("DELETE", "/v1/sandboxes/{sb}"),
    *(Route("POST", f"/v1/sandboxes/{{sb}}/{action}") for action in ACTIONS),
    Route("POST", "/v1/sandboxes/{sb}/fork", {"count": 1}),
    Route("POST", "/v1/sandboxes/{sb}/rollback", {"snapshot_id": "{snap}"}),
    Route("POST", "/v1/sandboxes/{sb}/snapshots", {"full": False}),
    Route("GET", "/v1/sandboxes/{sb}/snapshots"),
    Route("POST", "/v1/sandboxes/{sb}/exec", {"cmd": "echo hi > exec-was-here"}),
    Route("POST", "/v1/sandboxes/{sb}/processes", {"cmd": "echo hi > process-was-here"}),
    Route("GET", "/v1/sandboxes/{sb}/processes"),
    Route("GET", "/v1/sandboxes/{sb}/processes/{pid}/output?offset=0&follow=false"),
    Route("POST", "/v1/sandboxes/{sb}/processes/{pid}/stdin?eof=false", b"input"),
    Route("POST", "/v1/sandboxes/{sb}/processes/{pid}/signal", {"signal": "SIGTERM"}),
    Route("PUT", "/v1/sandboxes/{sb}/files?path=put-was-here", b"data"),
    Route("GET", "/v1/sandboxes/{sb}/files?path=a.txt"),
    Route("GET", "/v1/sandboxes/{sb}/files/list?path=."),
    Route("GET", "/v1/sandboxes/{sb}/files/stat?path=a.txt"),
    Route("POST", "/v1/sandboxes/{sb}/files/mkdir", {"path": "mkdir-was-here", "parents": True}),
    Route("DELETE", "/v1/sandboxes/{sb}/files?path=a.txt&recursive=false"),
    Route("POST", "/v1/sandboxes/{sb}/files/rename", {"src": "a.txt", "dst": "renamed.txt"}),
    Route("GET", "/v1/sandboxes/{sb}/files/watch?path=.&recursive=false", stream=True),
    Route("POST", "/v1/projects", {"name": "never-made"}),
    Route("GET", "/v1/projects"),
    Route("POST", "/v1/keys", {"project": "default", "role": "admin"}),
    Route("DELETE", "/v1/keys/{key}"),
]
ROUTE_IDS = [str(r) for r in ROUTES]
SANDBOX_ROUTES = [r for r in ROUTES if r.per_sandbox]


def assert_error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, f"{answer.request.method} {answer.request.url}: {answer.text}"
    body = answer.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert isinstance(body["error"].get("details", {}), dict), body
    return body


def fake_ids() -> dict[str, str]:
    return {"sb": new_sandbox_id(), "snap": new_snapshot_id(), "pid": "p-1", "key": new_api_key_id()}


@dataclass
class Tenant:
    """A project with a running sandbox holding a file, a snapshot and a background process."""

    project: c.Project
    sandbox_id: str
    snapshot_id: str
    process_id: str

    @property
    def ids(self) -> dict[str, str]:
        return {"sb": self.sandbox_id, "snap": self.snapshot_id, "pid": self.process_id, "key": ""}


def drop_tenant(cluster: c.Cluster, tenant: Tenant) -> None:
    # The fake driver does not kill a sandbox's background processes on delete (see test_controlplane_
    # lifecycle.py::test_deleting_a_sandbox_leaves_no_process_on_the_node): end ours first.
    with tenant.project.sdk() as sp:
        sp.sandboxes.get(tenant.sandbox_id).processes.signal(tenant.process_id, "SIGKILL")
    c.delete_all(cluster, tenant.project)


def make_tenant(cluster: c.Cluster) -> Tenant:
    made = c.new_project(cluster)
    with made.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("a.txt", b"original")
        snap = sb.snapshots.create()
        process = sb.processes.start("sleep 600")
    return Tenant(made, sb.id, snap.id, process.id)


def untouched(cluster: c.Cluster, tenant: Tenant) -> None:
    """The tenant's sandbox is as make_tenant left it."""
    with tenant.project.sdk() as sp:
        sb = sp.sandboxes.get(tenant.sandbox_id)
        assert (sb.state, sb.data["desired_state"]) == ("running", "running"), sb.data
        assert [s.id for s in sb.snapshots.list()] == [tenant.snapshot_id]
        assert sb.files.read("a.txt") == b"original"
        names = {entry["name"] for entry in sb.files.list(".")}
        assert not {n for n in names if "was-here" in n or n == "renamed.txt"}, names
        assert [p.id for p in sb.processes.list() if p.running] == [tenant.process_id]
    assert [sb.id for sb in cluster.store.list_sandboxes(tenant.project.id)] == [tenant.sandbox_id]


@pytest.fixture(scope="module")
def victim(fake_cluster: c.Cluster) -> Iterator[Tenant]:
    tenant = make_tenant(fake_cluster)
    yield tenant
    drop_tenant(fake_cluster, tenant)


@pytest.fixture(scope="module")
def revoked_key(fake_cluster: c.Cluster) -> str:
    made = c.new_project(fake_cluster)
    key_id, secret = made.new_key("admin")
    assert made.cluster.http(secret).get("/v1/sandboxes").status_code == 200
    answer = fake_cluster.http(fake_cluster.admin_key).delete(f"/v1/keys/{key_id}")
    assert answer.status_code == 204, answer.text
    # A control plane may trust a key it has just seen for a few seconds (settings auth_cache_s, meant for
    # *other* replicas); once that has passed the key must be refused everywhere. Whether the replica that
    # revoked it refuses it at once is test_revocation_takes_effect_at_once.
    client = made.cluster.http(secret)
    c.wait_for(lambda: client.get("/v1/sandboxes").status_code == 401, timeout=15, what="revoked key refused")
    return secret


# -- 401 ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_every_route_needs_a_key(fake_cluster: c.Cluster, victim: Tenant, route: Route) -> None:
    ids = victim.ids | {"key": new_api_key_id()}
    for headers in (
        {},
        {"Authorization": fake_cluster.admin_key},  # no "Bearer "
        {"Authorization": f"Basic {fake_cluster.admin_key}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer space_{secrets.token_urlsafe(30)}"},  # well formed, unknown
        {"Authorization": f"Bearer {fake_cluster.admin_key}x"},
    ):
        client = fake_cluster.http(headers=headers)
        assert_error(route.send(client, **ids), 401, "unauthenticated")


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_a_revoked_key_is_refused_everywhere(
    fake_cluster: c.Cluster, victim: Tenant, revoked_key: str, route: Route
) -> None:
    assert_error(route.send(fake_cluster.http(revoked_key), **fake_ids()), 401, "unauthenticated")


def test_nothing_happened_to_the_victim_without_credentials(fake_cluster: c.Cluster, victim: Tenant) -> None:
    untouched(fake_cluster, victim)


# -- another project's sandbox is a sandbox that does not exist ---------------------------------------------
@pytest.mark.parametrize("route", SANDBOX_ROUTES, ids=[str(r) for r in SANDBOX_ROUTES])
def test_another_projects_sandbox_looks_like_a_missing_one(
    fake_cluster: c.Cluster, victim: Tenant, project: c.Project, route: Route
) -> None:
    client = project.http()
    missing = victim.ids | {"sb": new_sandbox_id()}
    foreign = route.send(client, **victim.ids)
    absent = route.send(client, **missing)
    assert foreign.status_code == absent.status_code, (foreign.text, absent.text)
    assert foreign.json() == c_swap(absent.json(), missing["sb"], victim.sandbox_id)
    if route.path.endswith("/suspend"):
        # This cluster has no object store: suspend is refused before any lookup, the same for everyone.
        assert_error(foreign, 400, "invalid_argument")
    else:
        assert_error(foreign, 404, "not_found")


def c_swap(value: Any, old: str, new: str) -> Any:
    """`value` with every occurrence of the string `old` replaced by `new` (in nested JSON)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: c_swap(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [c_swap(v, old, new) for v in value]
    return value


def test_another_projects_sandbox_is_not_listed_and_untouched(
    fake_cluster: c.Cluster, victim: Tenant, project: c.Project
) -> None:
    client = project.http()
    assert client.get("/v1/sandboxes").json() == {"sandboxes": []}
    assert [p["id"] for p in client.get("/v1/projects").json()["projects"]] == [project.id]
    # The org admin key acts in "default" unless told otherwise, and never sees B's sandbox there either.
    admin = fake_cluster.http(fake_cluster.admin_key)
    assert_error(admin.get(f"/v1/sandboxes/{victim.sandbox_id}"), 404, "not_found")
    named = admin.get(f"/v1/sandboxes/{victim.sandbox_id}", headers={"X-Space-Project": victim.project.name})
    assert named.status_code == 200 and named.json()["id"] == victim.sandbox_id
    untouched(fake_cluster, victim)


# -- read-only keys --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def readonly(fake_cluster: c.Cluster) -> Iterator[tuple[Tenant, str, str]]:
    tenant = make_tenant(fake_cluster)
    key_id, secret = tenant.project.new_key("read-only")
    yield tenant, key_id, secret
    drop_tenant(fake_cluster, tenant)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_read_only_keys_read_but_never_change(
    fake_cluster: c.Cluster, readonly: tuple[Tenant, str, str], route: Route
) -> None:
    tenant, key_id, secret = readonly
    answer = route.send(fake_cluster.http(secret), **(tenant.ids | {"key": key_id}))
    if route.mutating:
        assert_error(answer, 403, "permission_denied")
    else:
        assert answer.status_code == 200, answer.text
    untouched(fake_cluster, tenant)


def test_read_only_key_sees_its_project(fake_cluster: c.Cluster, readonly: tuple[Tenant, str, str]) -> None:
    tenant, _key_id, secret = readonly
    client = fake_cluster.http(secret)
    assert [sb["id"] for sb in client.get("/v1/sandboxes").json()["sandboxes"]] == [tenant.sandbox_id]
    assert client.get(f"/v1/sandboxes/{tenant.sandbox_id}/files?path=a.txt").content == b"original"


# -- projects and keys ---------------------------------------------------------------------------------------
def test_only_org_admin_keys_create_projects(fake_cluster: c.Cluster, project: c.Project) -> None:
    _id, project_admin = project.new_key("admin")
    for key in (project.key, project_admin):
        assert_error(
            fake_cluster.http(key).post("/v1/projects", json={"name": "nope"}), 403, "permission_denied"
        )
    names = {p.name for p in fake_cluster.store.list_projects(fake_cluster.org_id)}
    assert "nope" not in names


def test_project_admins_manage_only_their_own_keys(
    fake_cluster: c.Cluster, project: c.Project, victim: Tenant
) -> None:
    _id, project_admin = project.new_key("admin")
    admin = fake_cluster.http(project_admin)
    member = project.http()
    # A member may not make keys at all.
    assert_error(member.post("/v1/keys", json={"project": project.name}), 403, "permission_denied")
    # A project admin makes keys for its project (by name or id) ...
    for ref in (project.name, project.id):
        made = admin.post("/v1/keys", json={"project": ref, "role": "read-only"})
        assert made.status_code == 201, made.text
        assert made.json()["project_id"] == project.id and made.json()["key"].startswith("space_")
    # ... never for another project: that project is as absent as one that does not exist.
    for ref in (victim.project.name, victim.project.id):
        foreign = admin.post("/v1/keys", json={"project": ref, "role": "admin"})
        absent = admin.post("/v1/keys", json={"project": "no-such-project", "role": "admin"})
        assert_error(foreign, 404, "not_found")
        assert_error(absent, 404, "not_found")
    # Revoking another project's key is a 404 like an unknown key id, and leaves the key working.
    victim_key_id, victim_key = victim.project.new_key("member")
    assert_error(admin.delete(f"/v1/keys/{victim_key_id}"), 404, "not_found")
    assert_error(admin.delete(f"/v1/keys/{new_api_key_id()}"), 404, "not_found")
    assert fake_cluster.http(victim_key).get("/v1/sandboxes").status_code == 200


def test_revocation_takes_effect_at_once(fake_cluster: c.Cluster, project: c.Project) -> None:
    """On the control plane that revoked it, a key stops working with the 204 (one replica here)."""
    key_id, secret = project.new_key("member")
    client = fake_cluster.http(secret)
    assert client.get("/v1/sandboxes").status_code == 200
    assert project.http().delete(f"/v1/keys/{key_id}").status_code == 403  # members may not revoke
    _admin_id, project_admin = project.new_key("admin")
    assert fake_cluster.http(project_admin).delete(f"/v1/keys/{key_id}").status_code == 204
    assert_error(client.get("/v1/sandboxes"), 401, "unauthenticated")
    # Revoking again is harmless.
    assert fake_cluster.http(project_admin).delete(f"/v1/keys/{key_id}").status_code == 204


# -- the PTY WebSocket ---------------------------------------------------------------------------------------
def ws_refusal(cluster: c.Cluster, sandbox_id: str, key: str | None) -> int:
    """How the PTY WebSocket refuses: the HTTP status of the refused handshake, or the close code."""
    url = cluster.url.replace("http://", "ws://") + f"/v1/sandboxes/{sandbox_id}/pty?cmd=/bin/sh"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with connect(url, additional_headers=headers, open_timeout=10, close_timeout=2) as ws:
            with contextlib.suppress(Exception):
                ws.recv(timeout=10)
            assert ws.close_code is not None, "the PTY of a refused request stayed open"
            return int(ws.close_code)
    except InvalidStatus as exc:
        return int(exc.response.status_code)


def test_pty_websocket_is_authenticated_and_scoped(
    fake_cluster: c.Cluster, victim: Tenant, readonly: tuple[Tenant, str, str], project: c.Project
) -> None:
    refusals = {
        "no key": ws_refusal(fake_cluster, victim.sandbox_id, None),
        "revoked/unknown key": ws_refusal(fake_cluster, victim.sandbox_id, "space_" + "x" * 40),
        "read-only key": ws_refusal(fake_cluster, readonly[0].sandbox_id, readonly[2]),
        "another project": ws_refusal(fake_cluster, victim.sandbox_id, project.key),
        "missing sandbox": ws_refusal(fake_cluster, new_sandbox_id(), project.key),
    }
    # Every refusal must be one (never an open terminal), and must say why like the HTTP routes do, as the
    # status of the refused handshake (401) or as the close code (4401): unauthenticated, permission
    # denied, and the same "not found" for another project's sandbox as for a missing one.
    kinds = {why: 4000 + code % 1000 for why, code in refusals.items()}
    assert kinds == {
        "no key": 4401,
        "revoked/unknown key": 4401,
        "read-only key": 4403,
        "another project": 4404,
        "missing sandbox": 4404,
    }, f"PTY refusals (HTTP status or close code): {refusals}"
    untouched(fake_cluster, victim)
