"""The public API's OpenAPI document: every answer typed, and docs/api.md listing exactly its routes.

The document comes from an in-process control plane (SQLite in a temporary directory, no reconciler, no
network): the routes and their models are the same as a served one's.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
from fastapi.routing import APIRoute

from space.controlplane.api import node_admin
from space.controlplane.api.app import create_app
from space.controlplane.store import Store, migrate, sqlite_url

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
METHODS = {"get", "put", "post", "patch", "delete"}
#: Public operations whose 2xx answer is not one JSON document, and why.
UNTYPED_ANSWERS = {
    ("delete", "/v1/keys/{key_id}"): "204, no body",
    ("get", "/v1/sandboxes/{sandbox_id}/files"): "the file's bytes, streamed",
    ("get", "/v1/sandboxes/{sandbox_id}/files/watch"): "NDJSON events",
    ("get", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/output"): "NDJSON events",
    ("get", "/v1/templates/{template}/logs"): "NDJSON log lines, then the template",
    ("post", "/v1/sandboxes/{sandbox_id}/code"): "NDJSON events of the execution",
    ("get", "/v1/sandbox-updates"): "Server-Sent Events (the console's live list)",
}
#: A table row of docs/api.md that names routes: | METHOD[ / METHOD] | /v1/path[?query][, /v1/path] | ...
DOC_ROW = re.compile(r"^\|\s*([A-Z][A-Z /]*?)\s*\|\s*(/v1/[^|]*?)\s*\|")


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data_dir = tmp_path_factory.mktemp("openapi")
    url = sqlite_url(data_dir)
    migrate(url)
    store = Store(url)
    try:
        return create_app(store, node_token="t" * 32, run_reconciler=False, data_dir=data_dir).openapi()
    finally:
        store.close()


def hidden_public_routes() -> set[tuple[str, str]]:
    """Public routes served but left out of /openapi.json: the org admin's node routes (ADR 0065; the
    adversarial generator has no tenant's node to name)."""
    assert node_admin.router.include_in_schema is False
    return {
        (method.lower(), normalized("/v1" + route.path))
        for route in node_admin.router.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }


def operations(schema: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method, path): op
        for path, item in schema["paths"].items()
        for method, op in item.items()
        if method in METHODS
    }


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/components/schemas/")
        node = schema["components"]["schemas"][name]
    return node


def is_typed(schema: dict[str, Any], node: dict[str, Any] | None) -> bool:
    """An object schema that names its fields (an empty object only if nothing else is allowed)."""
    if not node:
        return False
    target = resolve(schema, node)
    if target.get("type") != "object" or "properties" not in target:
        return False
    return bool(target["properties"]) or target.get("additionalProperties") is False


def test_every_public_answer_is_typed(schema: dict[str, Any]) -> None:
    ops = operations(schema)
    assert len(ops) >= 40, sorted(ops)  # the document was read
    untyped = []
    for key, op in sorted(ops.items()):
        if key in UNTYPED_ANSWERS:
            continue
        answers = {code: r for code, r in op["responses"].items() if code.startswith("2")}
        json_schemas = [
            ((r.get("content") or {}).get("application/json") or {}).get("schema") for r in answers.values()
        ]
        if not answers or not all(is_typed(schema, s) for s in json_schemas):
            untyped.append(f"{key[0].upper()} {key[1]}: {answers}")
    assert untyped == [], "public operations without a typed answer:\n" + "\n".join(untyped)
    for key in UNTYPED_ANSWERS:
        assert key in ops, f"{key} is listed as untyped but is no longer in /openapi.json"


#: Operations whose body is raw bytes (streamed to the sandbox), not JSON.
RAW_BODIES = {
    ("put", "/v1/sandboxes/{sandbox_id}/files"),
    ("post", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin"),
}


def test_every_public_request_body_is_typed(schema: dict[str, Any]) -> None:
    loose = []
    raw = set()
    for key, op in sorted(operations(schema).items()):
        content = (op.get("requestBody") or {}).get("content", {})
        body = content.get("application/json")
        if body is not None and not is_typed(schema, body.get("schema")):
            loose.append(f"{key[0].upper()} {key[1]}")
        if "application/octet-stream" in content:
            raw.add(key)
    assert loose == []
    assert raw == RAW_BODIES


def normalized(path: str) -> str:
    """A path without its query, its parameters unnamed: /v1/sandboxes/{id} == /v1/sandboxes/{sandbox_id}."""
    return re.sub(r"\{[^}]*\}", "{}", path.split("?", 1)[0].strip())


def documented_routes() -> set[tuple[str, str]]:
    found = set()
    for line in DOCS.read_text().splitlines():
        match = DOC_ROW.match(line)
        if match is None or "WEBSOCKET" in match.group(1).upper():
            continue  # the PTY is a WebSocket: not an OpenAPI operation
        for method in match.group(1).split("/"):
            for path in match.group(2).split(","):
                found.add((method.strip().lower(), normalized(path)))
    return found


def test_docs_list_exactly_the_public_routes(schema: dict[str, Any]) -> None:
    served = {(method, normalized(path)) for method, path in operations(schema)} | hidden_public_routes()
    documented = documented_routes()
    assert sorted(served - documented) == [], "served but not in docs/api.md"
    assert sorted(documented - served) == [], "in docs/api.md but not served"
