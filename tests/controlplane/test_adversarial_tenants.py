"""Two tenants, one attacker: every public operation, generated from `/openapi.json`, called by tenant B
with tenant A's ids must answer exactly as for ids that do not exist (404 where B may act at all) and
change nothing of A's; path parameters of the data plane fuzzed with encodings (dot segments, encoded
slashes, backslashes, overlong UTF-8, NUL, double slashes) sent on a raw socket, so that the encodings
reach the server as written; the streaming routes and the PTY WebSocket by hand; idempotency keys of an
org key kept apart per project. The oracle that nothing reached A's sandbox is the node's own record of
A's last data-plane activity, which any request relayed to it would move. Last, the same through a REAL
runsc node: B never reads the file A wrote. (Issue 9; ADR 0020.)

A new operation in the OpenAPI document that the generator cannot classify fails
`test_every_operation_is_classified`, so new routes get attacked from the day they appear.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from space.core.ids import new_api_key_id, new_sandbox_id, new_snapshot_id, new_template_id
from tests.support import cluster as c
from tests.support.mcp_clients import over_http

fake_cluster = c.fake_cluster
real_cluster = c.real_cluster

SECRET = b"tenant-A-secret-" + secrets.token_hex(8).encode()
MISSING_PROCESS = "0123456789abcdef"

# -- what each path or query parameter names -----------------------------------------------------------------
#: Parameters that name a resource of a tenant: the attacker puts the victim's there.
RESOURCE_PARAMETERS = {
    "sandbox_id": "sandbox",
    "process_id": "process",
    "snapshot_id": "snapshot",
    "key_id": "key",
    "name": "credential",
    "project": "project",
    "template": "template",  # a template's id or name (ADR 0055)
    "credential": "credential",  # the login credential a browser's page fill names (ADR 0066)
}
#: Operations without a resource parameter: they act on the caller's own scope (checked for leaks below).
COLLECTIONS = {
    "GET /v1/sandboxes",
    "POST /v1/sandboxes",
    "GET /v1/projects",
    "POST /v1/projects",
    "POST /v1/keys",
    "GET /v1/templates",
    "POST /v1/templates",
    "GET /v1/org/encryption-key",
    "PUT /v1/org/encryption-key",
    "POST /v1/org/encryption-key/rotate",
    "POST /v1/org/encryption-key/revoke",
    # The web console's reads (ADR 0061): the caller's key, its project's live list (its scoping is
    # tests/controlplane/test_console_serving.py's), the nodes (org admin keys only).
    "GET /v1/whoami",
    "GET /v1/sandbox-updates",
    "GET /v1/cluster/nodes",
}
#: Operations on a name IN THE CALLER'S OWN SCOPE: PUT creates or replaces the attacker's own credential of
#: that name (or is refused by role); the audit is a query by name there (an empty list for any name the
#: scope never used). What must hold: the same answer as for a missing name, and the victim's untouched.
#: Every other operation with a resource must answer 404.
#: A list's `template` filter is such a query too: another project's template lists what a missing one does
#: (nothing), and the foreign and missing answers must still be the same (ADR 0055).
#: The project's snapshot list filters by name the same way (ADR 0060).
NAMED_IN_OWN_SCOPE = {
    "PUT /v1/credentials/{name}",
    "GET /v1/credentials/{name}/audit",
    "GET /v1/sandboxes",
    "GET /v1/snapshots",
}
#: Answers that are not 404 for a reason that has nothing to do with the ids (the same for a missing id).
NOT_404 = {
    # this cluster has no object store: suspend is refused before any lookup
    "POST /v1/sandboxes/{sandbox_id}/suspend": 400,
}
#: Non-resource parameters the generator must fill to make a request valid (else a 422 would hide
#: whether the ids were looked up).
FILLERS: dict[str, Any] = {
    "path": "a.txt",
    "src": "a.txt",
    "dst": "moved-by-attacker.txt",
    "cmd": "echo pwned > pwned.txt",
    "code": "open('pwned.txt', 'w').write('pwned')",  # run_code (ADR 0058)
    "signal": "SIGKILL",
    "rows": 5,
    "cols": 5,
    "attribute": "user.pwned",
    "value_b64": "cHduZWQ=",
    "allowed_private_networks": [],
    "timeout_s": 0,  # the most harmful deadline: now (the victim's sandbox would be deleted)
}
#: Optional body fields filled all the same (an exec needs one of cmd/argv, which the schema cannot say).
ALWAYS_FILLED = {"cmd"}


@dataclass
class Tenant:
    project: c.Project
    admin_key: str
    sandbox_id: str
    snapshot_id: str
    process_id: str
    key_id: str
    credential: str
    template_id: str

    def values(self) -> dict[str, str]:
        return {
            "sandbox": self.sandbox_id,
            "process": self.process_id,
            "snapshot": self.snapshot_id,
            "key": self.key_id,
            "credential": self.credential,
            "project": self.project.name,
            "template": self.template_id,
        }


def missing_values() -> dict[str, str]:
    return {
        "sandbox": new_sandbox_id(),
        "process": MISSING_PROCESS,
        "snapshot": new_snapshot_id(),
        "key": new_api_key_id(),
        "credential": f"no-such-{secrets.token_hex(4)}",
        "project": f"no-such-{secrets.token_hex(4)}",
        "template": new_template_id(),
    }


def make_tenant(cluster: c.Cluster) -> Tenant:
    made = c.new_project(cluster)
    _admin_id, admin_key = made.new_key("admin")
    key_id, _secret = made.new_key("read-only")
    credential = f"cred-{secrets.token_hex(3)}"
    answer = made.http(admin_key).put(
        f"/v1/credentials/{credential}",
        json={"value": "v-" + secrets.token_hex(8), "hosts": ["api.example.com"]},
    )
    assert answer.status_code in {200, 201}, answer.text
    with made.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
        sb.files.write("a.txt", SECRET)
        snap = sb.snapshots.create()
        process = sb.processes.start("sleep 600")
    # A template of the tenant's own, recorded as a build in flight (held by no control plane of the cluster,
    # so it stays so): what an attack could read, upload to or delete.
    template = cluster.store.create_template(
        made.id, f"t-{secrets.token_hex(4)}", spec={"from": "python", "steps": []}, source="python",
        node_id=None, lease_owner="adversarial-test", lease_s=3600,
    )  # fmt: skip
    return Tenant(made, admin_key, sb.id, snap.id, process.id, key_id, credential, template.id)


def drop_tenant(cluster: c.Cluster, tenant: Tenant) -> None:
    with tenant.project.sdk() as sp, contextlib.suppress(Exception):
        sp.sandboxes.get(tenant.sandbox_id).processes.signal(tenant.process_id, "SIGKILL")
    c.delete_all(cluster, tenant.project)
    for template in cluster.store.list_templates(tenant.project.id):
        cluster.store.mark_template_deleting(tenant.project.id, template.id)
        cluster.store.purge_template(template.id)


@pytest.fixture(scope="module")
def tenants(fake_cluster: c.Cluster) -> Iterator[tuple[Tenant, Tenant]]:
    victim, attacker = make_tenant(fake_cluster), make_tenant(fake_cluster)
    try:
        yield victim, attacker
    finally:
        drop_tenant(fake_cluster, victim)
        drop_tenant(fake_cluster, attacker)


@dataclass
class Picture:
    """Everything of a tenant an attack could change, as its owner sees it (and the store)."""

    sandbox: dict[str, Any]
    snapshots: list[str]
    files: dict[str, bytes]
    processes: list[str]
    egress: dict[str, Any]
    credentials: list[dict[str, Any]]
    sandboxes_in_store: list[str]
    keys_in_store: list[str] = field(default_factory=list)
    templates_in_store: list[str] = field(default_factory=list)


def picture(cluster: c.Cluster, tenant: Tenant) -> Picture:
    client = tenant.project.http(tenant.admin_key)
    sandbox = client.get(f"/v1/sandboxes/{tenant.sandbox_id}").json()
    keep = (
        "id",
        "state",
        "desired_state",
        "generation",
        "node_id",
        "env",
        "limits",
        "snapshot_policy",
        "error",
        "metadata",
        "expires_at",
        "on_timeout",
    )
    names = [
        e["name"]
        for e in client.get(f"/v1/sandboxes/{tenant.sandbox_id}/files/list?path=.").json()["entries"]
    ]
    files = {
        name: client.get(f"/v1/sandboxes/{tenant.sandbox_id}/files", params={"path": name}).content
        for name in sorted(names)
    }
    processes = client.get(f"/v1/sandboxes/{tenant.sandbox_id}/processes").json()["processes"]
    credentials = client.get("/v1/credentials").json()["credentials"]
    for entry in credentials:
        for volatile in ("last_used_at", "uses", "expires_in_s"):
            entry.pop(volatile, None)
    return Picture(
        sandbox={k: sandbox.get(k) for k in keep},
        snapshots=sorted(
            s["id"] for s in client.get(f"/v1/sandboxes/{tenant.sandbox_id}/snapshots").json()["snapshots"]
        ),
        files=files,
        processes=sorted(p["process_id"] for p in processes if p.get("running")),
        egress=client.get(f"/v1/sandboxes/{tenant.sandbox_id}/egress").json(),
        credentials=sorted(credentials, key=lambda e: json.dumps(e, sort_keys=True)),
        # A sandbox an earlier test deleted finishes its teardown in the background (ADR 0073): being
        # `deleting` is not the attacker's doing, and one the attacker deleted would vanish from this list.
        sandboxes_in_store=sorted(
            sb.id for sb in cluster.store.list_sandboxes(tenant.project.id) if sb.state.value != "deleting"
        ),
        templates_in_store=sorted(
            f"{t.id}:{t.status}:{t.source}:{t.log_bytes}"
            for t in cluster.store.list_templates(tenant.project.id)
        ),
        keys_in_store=sorted(
            f"{k.id}:{k.role}:{k.revoked_at}"
            for k in cluster.store.list_api_keys(cluster.org_id, tenant.project.id)
        ),
    )


def node_activity(cluster: c.Cluster, sandbox_id: str) -> Any:
    """The node's record of the sandbox's last data-plane request: moves with any request relayed to it."""
    return cluster.node.sandboxes()[sandbox_id].get("last_activity_at")


# -- the generator -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operation:
    method: str
    path: str  # the OpenAPI template, e.g. /v1/sandboxes/{sandbox_id}/files
    path_params: tuple[str, ...]
    query: tuple[dict[str, Any], ...]
    body_schema: dict[str, Any] | None

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def resources(self) -> list[str]:
        names = [*self.path_params, *(q["name"] for q in self.query)]
        return [n for n in names if n in RESOURCE_PARAMETERS]


def operations(schema: dict[str, Any]) -> list[Operation]:
    found = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method not in {"get", "put", "post", "patch", "delete"}:
                continue
            params = op.get("parameters", [])
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
            found.append(
                Operation(
                    method.upper(),
                    path,
                    tuple(p["name"] for p in params if p["in"] == "path"),
                    tuple(p for p in params if p["in"] == "query"),
                    body,
                )
            )
    return found


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        node = schema["components"]["schemas"][name]
    return node


def minimal_body(schema: dict[str, Any], node: dict[str, Any], values: dict[str, str]) -> Any:
    """The smallest body the schema accepts, with resource fields set from `values`."""
    node = resolve(schema, node)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        return minimal_body(schema, options[0], values) if options else None
    kind = node.get("type")
    if kind == "object":
        body: dict[str, Any] = {}
        properties = node.get("properties", {})
        for name in [*node.get("required", []), *(n for n in properties if n in ALWAYS_FILLED)]:
            if name in body:
                continue
            if name in RESOURCE_PARAMETERS:
                body[name] = values[RESOURCE_PARAMETERS[name]]
            elif name in FILLERS:
                body[name] = FILLERS[name]
            else:
                body[name] = minimal_body(schema, properties[name], values)
        return body
    if "enum" in node:
        return node["enum"][0]
    if "default" in node:
        return node["default"]
    return {"string": "x", "integer": 1, "number": 1, "boolean": False, "array": []}.get(str(kind))


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    query: dict[str, Any]
    body: Any

    def send(self, client: httpx.Client) -> httpx.Response:
        kwargs: dict[str, Any] = {"params": self.query}
        if self.body is not None:
            kwargs["json"] = self.body
        elif self.method in {"POST", "PUT", "PATCH"}:
            kwargs["content"] = b"attacker bytes"
        return client.request(self.method, self.path, **kwargs)


def calls(op: Operation, schema: dict[str, Any], values: dict[str, str]) -> list[Call]:
    """The operation with `values` in every resource position: the path's, then each optional resource
    query parameter in turn (with scope=sandbox where a scope says what a sandbox_id means)."""
    path = op.path
    for name in op.path_params:
        path = path.replace("{" + name + "}", values[RESOURCE_PARAMETERS[name]])
    required: dict[str, Any] = {}
    for q in op.query:
        if q.get("required"):
            required[q["name"]] = (
                values[RESOURCE_PARAMETERS[q["name"]]]
                if q["name"] in RESOURCE_PARAMETERS
                else FILLERS[q["name"]]
            )
    body = minimal_body(schema, op.body_schema, values) if op.body_schema is not None else None
    # Without a resource in its path (only optional ones in its query), the bare call is a collection's.
    path_has_resource = any(name in RESOURCE_PARAMETERS for name in op.path_params)
    variants = [Call(op.method, path, required, body)] if path_has_resource else []
    for q in op.query:
        name = q["name"]
        if name in RESOURCE_PARAMETERS and name not in required:
            query = required | {name: values[RESOURCE_PARAMETERS[name]]}
            if name == "sandbox_id" and any(p["name"] == "scope" for p in op.query):
                query["scope"] = "sandbox"
            variants.append(Call(op.method, path, query, body))
    return variants


def swap(value: Any, old: dict[str, str], new: dict[str, str]) -> Any:
    """`value` with each of `old`'s values replaced by `new`'s (in nested JSON)."""
    if isinstance(value, str):
        for kind, text in old.items():
            value = value.replace(text, new[kind])
        return value
    if isinstance(value, dict):
        return {k: swap(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [swap(v, old, new) for v in value]
    return value


@pytest.fixture(scope="module")
def schema(fake_cluster: c.Cluster) -> dict[str, Any]:
    answer = fake_cluster.http().get("/openapi.json")
    assert answer.status_code == 200
    return dict(answer.json())


def test_every_operation_is_classified(schema: dict[str, Any]) -> None:
    ops = operations(schema)
    assert len(ops) >= 40, [o.key for o in ops]  # the document was read (guards against attacking nothing)
    unclassified = []
    for op in ops:
        unknown = [p for p in op.path_params if p not in RESOURCE_PARAMETERS]
        if unknown:
            unclassified.append(f"{op.key}: path parameter(s) {unknown} name no known resource")
        elif not op.resources and op.key not in COLLECTIONS:
            unclassified.append(f"{op.key}: no resource parameter and not a known collection")
        for q in op.query:
            if q.get("required") and q["name"] not in RESOURCE_PARAMETERS and q["name"] not in FILLERS:
                unclassified.append(f"{op.key}: required query parameter {q['name']!r} has no filler")
    assert unclassified == [], "classify these operations for the adversarial generator:\n" + "\n".join(
        unclassified
    )
    for key in [*COLLECTIONS, *NAMED_IN_OWN_SCOPE, *NOT_404]:
        assert key in {o.key for o in ops}, f"{key} is classified but no longer in /openapi.json"


@pytest.mark.parametrize("role", ["member", "admin"])
def test_the_other_tenants_ids_are_missing_ids_on_every_operation(
    fake_cluster: c.Cluster, schema: dict[str, Any], tenants: tuple[Tenant, Tenant], role: str
) -> None:
    victim, attacker = tenants
    key = attacker.project.key if role == "member" else attacker.admin_key
    client = fake_cluster.http(key)
    before = picture(fake_cluster, victim)
    activity = node_activity(fake_cluster, victim.sandbox_id)
    foreign_values = victim.values()
    attacked = 0
    problems: list[str] = []
    for op in operations(schema):
        if not op.resources:
            continue
        for foreign_call in calls(op, schema, foreign_values):
            absent_values = missing_values()
            absent_call = swap(foreign_call.__dict__, foreign_values, absent_values)
            foreign = foreign_call.send(client)
            absent = Call(**absent_call).send(client)
            where = f"{op.key} {foreign_call.query} as B's {role}"
            if foreign.status_code != absent.status_code:
                problems.append(
                    f"{where}: {foreign.status_code} for A's ids, {absent.status_code} for missing ones"
                )
                continue
            is_json = foreign.headers.get("content-type", "").startswith("application/json")
            if is_json and swap(foreign.json(), foreign_values, absent_values) != absent.json():
                problems.append(f"{where}: answers differ: {foreign.text} vs {absent.text}")
            expected = NOT_404.get(op.key, 404)
            if op.key in NAMED_IN_OWN_SCOPE:
                pass  # its own scope: any answer, as long as A's resource is untouched (below)
            elif foreign.status_code == 403 and foreign.json()["error"]["code"] == "permission_denied":
                pass  # refused by role before any lookup (the same for a missing id, checked above)
            elif foreign.status_code != expected:
                problems.append(f"{where}: {foreign.status_code} (wanted {expected}): {foreign.text[:300]}")
            if SECRET in foreign.content:
                problems.append(f"{where}: A's file content in the answer")
            attacked += 1
    assert problems == [], "\n".join(problems)
    assert attacked >= 40
    assert node_activity(fake_cluster, victim.sandbox_id) == activity, "a request reached A's sandbox"
    assert picture(fake_cluster, victim) == before


# -- streams and the PTY, by hand ----------------------------------------------------------------------------
def test_streams_of_the_other_tenant_do_not_open(
    fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]
) -> None:
    victim, attacker = tenants
    client = fake_cluster.http(attacker.admin_key)
    before = picture(fake_cluster, victim)
    activity = node_activity(fake_cluster, victim.sandbox_id)
    sb, pid = victim.sandbox_id, victim.process_id
    streams = [
        ("POST", f"/v1/sandboxes/{sb}/exec", {"json": {"cmd": "cat a.txt; sleep 30", "stream": True}}),
        ("GET", f"/v1/sandboxes/{sb}/processes/{pid}/output", {"params": {"offset": 0, "follow": "true"}}),
        ("GET", f"/v1/sandboxes/{sb}/files/watch", {"params": {"path": ".", "recursive": "true"}}),
        ("GET", f"/v1/sandboxes/{sb}/files", {"params": {"path": "a.txt"}}),
        ("POST", f"/v1/sandboxes/{sb}/processes/{pid}/stdin", {"content": iter([b"streamed ", b"input"])}),
        (
            "PUT",
            f"/v1/sandboxes/{sb}/files",
            {"params": {"path": "a.txt"}, "content": iter([b"over", b"written"])},
        ),
    ]
    for method, path, kwargs in streams:
        with client.stream(method, path, timeout=15, **kwargs) as answer:
            body = answer.read()  # a refusal is small and ends; a stream that opened would block here
            assert answer.status_code == 404, (method, path, answer.status_code, body[:200])
            assert answer.json()["error"]["code"] == "not_found"
            assert SECRET not in body
    assert node_activity(fake_cluster, victim.sandbox_id) == activity
    assert picture(fake_cluster, victim) == before


def pty_refusal(cluster: c.Cluster, path_and_query: str, key: str) -> int:
    url = cluster.url.replace("http://", "ws://") + path_and_query
    try:
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=10) as ws:
            with contextlib.suppress(Exception):
                ws.recv(timeout=10)
            assert ws.close_code is not None, f"a PTY opened for {path_and_query}"
            return int(ws.close_code)
    except InvalidStatus as exc:
        return int(exc.response.status_code)


def test_the_pty_of_the_other_tenant_does_not_open(
    fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]
) -> None:
    victim, attacker = tenants
    activity = node_activity(fake_cluster, victim.sandbox_id)
    a, b = victim.sandbox_id, attacker.sandbox_id
    refusals = {
        "foreign": pty_refusal(fake_cluster, f"/v1/sandboxes/{a}/pty?cmd=/bin/sh", attacker.admin_key),
        "missing": pty_refusal(
            fake_cluster, f"/v1/sandboxes/{new_sandbox_id()}/pty?cmd=/bin/sh", attacker.admin_key
        ),
        "dot segments": pty_refusal(fake_cluster, f"/v1/sandboxes/{b}/%2e%2e/{a}/pty", attacker.admin_key),
        "encoded slash": pty_refusal(fake_cluster, f"/v1/sandboxes/{b}%2f..%2f{a}/pty", attacker.admin_key),
        "NUL": pty_refusal(fake_cluster, f"/v1/sandboxes/{a}%00/pty", attacker.admin_key),
        "bad rows": pty_refusal(fake_cluster, f"/v1/sandboxes/{b}/pty?rows=-1", attacker.admin_key),
        "unknown parameter": pty_refusal(
            fake_cluster, f"/v1/sandboxes/{b}/pty?sandbox_id={a}", attacker.admin_key
        ),
    }
    codes = {why: 4000 + code % 1000 for why, code in refusals.items()}
    assert codes["foreign"] == codes["missing"] == 4404, refusals
    for why in ("dot segments", "encoded slash", "NUL"):
        assert codes[why] in {4400, 4403, 4404}, refusals
    assert codes["bad rows"] == codes["unknown parameter"] == 4400, refusals
    assert node_activity(fake_cluster, victim.sandbox_id) == activity


# -- path fuzzing on a raw socket ----------------------------------------------------------------------------
def raw_request(base_url: str, method: str, target: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with `target` sent byte for byte (no client normalizes or re-encodes it). The
    hundreds of attempts exceed the key's request rate: a 429 is waited out (its Retry-After) and the same
    bytes sent again, so every encoding is judged by the router, not by the rate limiter."""
    for _attempt in range(30):
        status, answer = _raw_request_once(base_url, method, target, key, body)
        if status != 429:
            return status, answer
        retry_after = re.search(rb"(?im)^retry-after:\s*(\d+)", answer)
        time.sleep(float(retry_after.group(1)) if retry_after else 1.0)
    raise AssertionError(f"{method} {target}: still rate-limited after 30 attempts")


def _raw_request_once(
    base_url: str, method: str, target: str, key: str, body: bytes = b""
) -> tuple[int, bytes]:
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + body)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    answer = b"".join(chunks)
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), answer[:200]
    return int(status_line.split()[1]), answer


def climbs(own: str, target: str) -> list[str]:
    """Ways to write "go from `own` to `target`" in one path parameter position."""
    return [
        target,
        f"{own}/../{target}",
        f"{own}/%2e%2e/{target}",
        f"{own}/%2E./{target}",
        f"{own}/.%2e/{target}",
        f"{own}%2f..%2f{target}",
        f"{own}%2F%2E%2E%2F{target}",
        f"{own}%252f..%252f{target}",
        f"{own}%255c..%255c{target}",
        f"{own}\\..\\{target}",
        f"{own}%5c..%5c{target}",
        f"{own}/%c0%ae%c0%ae/{target}",
        f"{own}%c0%af..%c0%af{target}",
        f"{own}/%e0%80%ae%e0%80%ae/{target}",
        f"{target}%00",
        f"{own}%00/../{target}",
        f"{own}//..//{target}",
        f"/{target}",
        f"{own}/./../{target}",
        f"{own};/../{target}",
        f"{own}%3f/../{target}",
        f"{own}%23/../{target}",
    ]


FUZZED = [
    # (method, template, body): {sb} and {pid} are fuzzed one position at a time; {rest} is a position
    # that used to be a catch-all ({rest:path}) and must now match nothing.
    ("GET", "/v1/sandboxes/{sb}/files?path=a.txt", b""),
    ("GET", "/v1/sandboxes/{sb}/files/list?path=.", b""),
    ("GET", "/v1/sandboxes/{sb}/files/stat?path=a.txt", b""),
    ("PUT", "/v1/sandboxes/{sb}/files?path=pwned.txt", b"pwned"),
    ("DELETE", "/v1/sandboxes/{sb}/files?path=a.txt", b""),
    ("POST", "/v1/sandboxes/{sb}/files/mkdir", b'{"path": "pwned-dir"}'),
    ("POST", "/v1/sandboxes/{sb}/exec", b'{"cmd": "cat a.txt; echo pwned > pwned.txt"}'),
    ("GET", "/v1/sandboxes/{sb}/processes", b""),
    ("GET", "/v1/sandboxes/{sb}/processes/{pid}/output?offset=0&follow=false", b""),
    ("POST", "/v1/sandboxes/{sb}/processes/{pid}/signal", b'{"signal": "SIGKILL"}'),
    ("POST", "/v1/sandboxes/{sb}/processes/{pid}/stdin?eof=true", b"input"),
    ("GET", "/v1/sandboxes/{own}/files/{rest}?path=a.txt", b""),
    ("GET", "/v1/sandboxes/{own}/processes/{rest}", b""),
    ("POST", "/v1/sandboxes/{own}/{rest}", b'{"cmd": "cat a.txt"}'),
]


def fuzz_targets(victim: Tenant, attacker: Tenant) -> list[tuple[str, str, bytes, str]]:
    own_sb, own_pid = attacker.sandbox_id, attacker.process_id
    a_sb, a_pid = victim.sandbox_id, victim.process_id
    found = []
    for method, template, body in FUZZED:
        if "{rest}" in template:
            tails = [
                f"..%2f..%2f{a_sb}%2ffiles", f"%2e%2e/%2e%2e/{a_sb}/files", f"..%2f..%2f..%2f{a_sb}%2fexec",
                f"../../{a_sb}/exec", f"%2e%2e%2f{a_sb}%2fprocesses%2f{a_pid}%2fsignal", "..%5c..%5c" + a_sb,
                f"%c0%ae%c0%ae/{a_sb}/files", f"{a_pid}%00", f"{a_pid}/../../../{a_sb}/exec",
            ]  # fmt: skip
            for tail in tails:
                found.append((method, template.replace("{own}", own_sb).replace("{rest}", tail), body, tail))
            continue
        for position, own, target in (("{sb}", own_sb, a_sb), ("{pid}", own_pid, a_pid)):
            if position not in template:
                continue
            for payload in climbs(own, target):
                path = template.replace(position, payload).replace("{sb}", own_sb).replace("{pid}", own_pid)
                found.append((method, path, body, payload))
        if "{pid}" in template:  # the process position climbing out to the victim's sandbox
            for payload in climbs(own_pid, f"../../{a_sb}/processes/{a_pid}"):
                found.append(
                    (method, template.replace("{sb}", own_sb).replace("{pid}", payload), body, payload)
                )
    return found


def test_encoded_paths_never_reach_another_sandbox(
    fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]
) -> None:
    victim, attacker = tenants
    before = picture(fake_cluster, victim)
    activity = node_activity(fake_cluster, victim.sandbox_id)
    targets = fuzz_targets(victim, attacker)
    assert len(targets) > 250
    wrong = []
    for method, target, body, payload in targets:
        status, answer = raw_request(fake_cluster.url, method, target, attacker.admin_key, body)
        if status not in {400, 404, 405, 422} or SECRET in answer:
            wrong.append(f"{method} {target} ({payload!r}): {status} {answer[-300:]!r}")
    assert wrong == [], f"{len(wrong)} encoded requests were not refused:\n" + "\n".join(wrong[:40])
    assert node_activity(fake_cluster, victim.sandbox_id) == activity, (
        "an encoded request reached A's sandbox"
    )
    assert picture(fake_cluster, victim) == before
    # the oracle is alive: A's own requests (picture reads A's files) do move it
    assert activity is not None and node_activity(fake_cluster, victim.sandbox_id) != activity
    # the attacker's own sandbox still answers: the refusals were about the paths, not a broken gateway
    status, answer = raw_request(
        fake_cluster.url, "GET", f"/v1/sandboxes/{attacker.sandbox_id}/files?path=a.txt", attacker.admin_key
    )
    assert status == 200 and SECRET in answer  # (B's own file: make_tenant writes the same bytes)


def test_query_and_body_values_are_typed(fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]) -> None:
    """What is not a path is typed too: no query value or header reaches the node unvalidated."""
    _victim, attacker = tenants
    client = fake_cluster.http(attacker.admin_key)
    sb = attacker.sandbox_id
    for path, params in (
        (f"/v1/sandboxes/{sb}/files", {"path": "a.txt", "offset": "-1"}),
        (f"/v1/sandboxes/{sb}/files", {"path": "a.txt", "length": "x"}),
        (f"/v1/sandboxes/{sb}/files", {"path": ""}),
        (f"/v1/sandboxes/{sb}/files", {"path": "a" * 5000}),
        (f"/v1/sandboxes/{sb}/files/watch", {"path": ".", "recursive": "maybe"}),
        (f"/v1/sandboxes/{sb}/processes/{attacker.process_id}/output", {"offset": "1e9"}),
        (f"/v1/sandboxes/{sb}/files/list", {"path": ".", "depth": "17"}),
        (f"/v1/sandboxes/{sb}/files/list", {"path": ".", "depth": "0"}),
        (f"/v1/sandboxes/{sb}/files/list", {"path": ".", "limit": "1000000000"}),
        (f"/v1/sandboxes/{sb}/files/stat", {"path": "a.txt", "follow": "maybe"}),
        (f"/v1/sandboxes/{sb}/files/xattrs/value", {"path": "a.txt", "attribute": "trusted.overlay"}),
        (f"/v1/sandboxes/{sb}/files/xattrs/value", {"path": "a.txt", "attribute": "user." + "n" * 300}),
    ):
        assert client.get(path, params=params).status_code == 422, (path, params)
    assert (
        client.put(
            f"/v1/sandboxes/{sb}/files", params={"path": "x", "mode": "99999"}, content=b""
        ).status_code
        == 422
    )
    for body in (
        {"path": "a.txt", "attribute": "security.capability", "value_b64": "AA=="},
        {"path": "a.txt", "attribute": "user.k", "value_b64": "A" * 100_000},
        {"path": "a.txt", "attribute": "user.k", "value_b64": "not base64!"},
    ):
        assert client.put(f"/v1/sandboxes/{sb}/files/xattrs", json=body).status_code == 422, body
    resize = f"/v1/sandboxes/{sb}/processes/{attacker.process_id}/resize"
    for size in ({"rows": 0, "cols": 80}, {"rows": 24, "cols": 10**9}, {"rows": "24", "cols": 80}):
        assert client.post(resize, json=size).status_code == 422, size
    # A forged capability header from the client is not relayed (the node would refuse it anyway).
    forged = {"X-Space-Capability": f"{_victim.sandbox_id}.9999999999.{'0' * 64}"}
    answer = client.get(f"/v1/sandboxes/{sb}/files", params={"path": "a.txt"}, headers=forged)
    assert answer.status_code == 200, answer.text


# -- idempotency keys of an org key --------------------------------------------------------------------------
def test_an_org_keys_idempotency_keys_are_per_project(
    fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]
) -> None:
    victim, attacker = tenants
    org = fake_cluster.http(fake_cluster.admin_key)
    idem = "same-key-" + secrets.token_hex(4)
    created = {}
    for tenant in (victim, attacker):
        answer = org.post(
            "/v1/sandboxes", json={"limits": c.SMALL, "wait": False},
            headers={"Idempotency-Key": idem, "X-Space-Project": tenant.project.name},
        )  # fmt: skip
        assert answer.status_code == 201, answer.text
        created[tenant.project.id] = answer.json()
    a, b = created[victim.project.id], created[attacker.project.id]
    assert a["id"] != b["id"], "project B got project A's answer (or id) for the same Idempotency-Key"
    assert (a["project_id"], b["project_id"]) == (victim.project.id, attacker.project.id)
    # a replay in each project gets that project's first answer
    for tenant in (victim, attacker):
        again = org.post(
            "/v1/sandboxes", json={"limits": c.SMALL, "wait": False},
            headers={"Idempotency-Key": idem, "X-Space-Project": tenant.project.name},
        )  # fmt: skip
        assert again.json()["id"] == created[tenant.project.id]["id"]
    for tenant in (victim, attacker):
        org.delete(
            f"/v1/sandboxes/{created[tenant.project.id]['id']}",
            headers={"X-Space-Project": tenant.project.name},
        )


# -- the MCP endpoint (JSON-RPC, not in /openapi.json: its tools are classified here) -----------------------
#: The arguments besides `id` of every MCP tool that takes a sandbox id (`{snapshot}`: A's snapshot id, or a
#: missing one). A new tool with an `id` that is not here fails the test, so it gets attacked too.
MCP_TOOL_ARGUMENTS: dict[str, dict[str, Any]] = {
    "delete_sandbox": {},
    "execute_command": {"command": "cat a.txt > pwned.txt"},
    "run_code": {"code": "print(open('a.txt').read())"},
    "read_file": {"path": "a.txt"},
    "write_file": {"path": "a.txt", "content": "overwritten"},
    "list_files": {"path": "."},
    "pause_sandbox": {},
    "resume_sandbox": {},
    "snapshot": {"kind": "full"},
    "list_snapshots": {},
    "rollback": {"snapshot_id": "{snapshot}"},
    "fork": {"count": 2},
    "set_egress_policy": {"allow": ["*.example.com"], "deny": []},
    "login_placeholders": {"credential": "site"},
    "screenshot": {},
    "browser_login": {"credential": "site"},
}


@pytest.mark.parametrize("role", ["member", "admin"])
def test_the_mcp_tools_answer_for_the_other_tenants_ids_as_for_missing_ones(
    fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant], role: str
) -> None:
    victim, attacker = tenants
    key = attacker.project.key if role == "member" else attacker.admin_key
    before = picture(fake_cluster, victim)
    activity = node_activity(fake_cluster, victim.sandbox_id)

    async def attack() -> list[str]:
        problems: list[str] = []
        async with over_http(fake_cluster.url, key) as mcp:
            listed = await mcp.client.list_tools()
            with_id = {t.name for t in listed.tools if "id" in (t.input_schema.get("properties") or {})}
            assert with_id == set(MCP_TOOL_ARGUMENTS), "classify the MCP tools that take a sandbox id"
            for name, arguments in MCP_TOOL_ARGUMENTS.items():
                answers = []
                for sandbox, snapshot in (
                    (victim.sandbox_id, victim.snapshot_id),
                    (new_sandbox_id(), new_snapshot_id()),
                ):
                    filled = {
                        k: v.replace("{snapshot}", snapshot) if isinstance(v, str) else v
                        for k, v in arguments.items()
                    }
                    is_error, text = await mcp.call(name, {"id": sandbox, **filled})
                    answers.append((is_error, text.replace(sandbox, "<id>").replace(snapshot, "<snap>")))
                if answers[0] != answers[1]:
                    problems.append(
                        f"{name} as B's {role}: {answers[0]} for A's ids, {answers[1]} for missing ones"
                    )
                elif not answers[0][0] or "not_found" not in answers[0][1]:
                    problems.append(f"{name} as B's {role}: not a not_found tool error: {answers[0]}")
                if SECRET.decode() in answers[0][1]:
                    problems.append(f"{name} as B's {role}: A's file content in the answer")
            assert victim.sandbox_id not in await mcp.ok("list_sandboxes")
        return problems

    assert asyncio.run(attack()) == []
    assert node_activity(fake_cluster, victim.sandbox_id) == activity, "a tool call reached A's sandbox"
    assert picture(fake_cluster, victim) == before


def test_lists_show_only_ones_own(fake_cluster: c.Cluster, tenants: tuple[Tenant, Tenant]) -> None:
    victim, attacker = tenants
    client = fake_cluster.http(attacker.admin_key)
    paths = ("/v1/sandboxes", "/v1/projects", "/v1/credentials", "/v1/whoami")
    text = json.dumps([client.get(p).json() for p in paths])
    for value in (victim.sandbox_id, victim.project.id, victim.credential, victim.snapshot_id):
        assert value not in text


# -- a real runsc node ---------------------------------------------------------------------------------------
@pytest.mark.root
def test_on_a_real_node_tenant_b_never_reads_tenant_as_file(real_cluster: c.RealCluster) -> None:
    admin = httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=120,
        verify=False,
    )  # fmt: skip
    keys = {}
    for tenant in ("a", "b"):
        name = f"adv-{tenant}-{secrets.token_hex(3)}"
        assert admin.post("/v1/projects", json={"name": name}).status_code == 201
        made = admin.post("/v1/keys", json={"project": name, "role": "admin"})
        assert made.status_code == 201, made.text
        keys[tenant] = made.json()["key"]
    clients = {
        t: httpx.Client(
            base_url=real_cluster.url, headers={"Authorization": f"Bearer {k}"}, timeout=300, verify=False
        )
        for t, k in keys.items()
    }
    secret = b"real-node-secret-" + secrets.token_hex(8).encode()
    ids = {}
    try:
        for tenant, client in clients.items():
            answer = client.post("/v1/sandboxes", json={"limits": {"cpus": 0.5, "memory_mb": 256}})
            assert answer.status_code == 201, answer.text
            ids[tenant] = answer.json()["id"]
        a, b = ids["a"], ids["b"]
        wrote = clients["a"].put(
            f"/v1/sandboxes/{a}/files", params={"path": "/work/secret.txt"}, content=secret
        )
        assert wrote.status_code == 200, wrote.text
        assert (
            clients["a"].get(f"/v1/sandboxes/{a}/files", params={"path": "/work/secret.txt"}).content
            == secret
        )
        # B: A's id as such, then every climb from B's own sandbox, on a raw socket
        plain = clients["b"].get(f"/v1/sandboxes/{a}/files", params={"path": "/work/secret.txt"})
        assert plain.status_code == 404 and secret not in plain.content
        refused = []
        for payload in climbs(b, a):
            for target in (
                f"/v1/sandboxes/{payload}/files?path=/work/secret.txt",
                f"/v1/sandboxes/{b}/files/{payload.replace(b, '..%2f..')}?path=/work/secret.txt",
            ):
                status, answer = raw_request(real_cluster.url, "GET", target, keys["b"])
                assert secret not in answer, target
                refused.append(status)
            status, answer = raw_request(
                real_cluster.url, "POST", f"/v1/sandboxes/{payload}/exec", keys["b"],
                json.dumps({"cmd": "cat /work/secret.txt"}).encode(),
            )  # fmt: skip
            assert secret not in answer, payload
            refused.append(status)
        assert set(refused) <= {400, 404, 405, 422}, refused
        # inside its own sandbox, B finds no trace of A's file either (another kernel, another root)
        for path in ("/work/secret.txt", "/../../work/secret.txt", f"/../{a}/work/secret.txt"):
            answer = clients["b"].get(f"/v1/sandboxes/{b}/files", params={"path": path})
            assert secret not in answer.content, path
        # (a bracket, so the pattern does not find its own command line)
        where = "/work /tmp /root /home /var /srv /mnt /opt"
        search = {"cmd": f"grep -rsl 'real-node-secre[t]' {where} 2>/dev/null | head -5; true", "timeout": 99}
        found = clients["b"].post(f"/v1/sandboxes/{b}/exec", json=search)
        assert found.status_code == 200, found.text
        assert secret not in found.content and found.json()["stdout"] == "", found.json()
        # and A's file is still A's
        assert (
            clients["a"].get(f"/v1/sandboxes/{a}/files", params={"path": "/work/secret.txt"}).content
            == secret
        )
    finally:
        for tenant, sandbox_id in ids.items():
            clients[tenant].delete(f"/v1/sandboxes/{sandbox_id}")
        for client in clients.values():
            client.close()
        admin.close()
