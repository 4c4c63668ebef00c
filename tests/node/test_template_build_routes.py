"""The template routes under attack (hostile names, oversized and endless specs, a missing token) and the
build's bounded log, its sources and its clean-up of the node's CA, without a real node (FakeDriver: the
requests are refused before anything would be built). The real builds are test_template_build_runsc.py."""

from __future__ import annotations

import asyncio
import base64
import json
import pathlib
from typing import Any

import httpx
import pytest

from space.core.template_spec import MAX_FILE_BYTES
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.egress_sandbox import with_node_ca
from space.node.agent.template_build_sources import BuildSources
from space.node.agent.template_build_steps import MAX_LOG_LINE, MAX_LOG_TOTAL, LogSink, without_node_ca
from space.node.drivers.fake import FakeDriver

TOKEN = "route-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Any:
    return create_app(NodeAgent(FakeDriver(tmp_path / "node")), TOKEN)


async def _call(app: Any, method: str, path: str, *, content: bytes | None = None,
                headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return await client.request(method, path, content=content, headers={**AUTH, **(headers or {})})


def _post(app: Any, name: str, spec: Any) -> httpx.Response:
    body = spec if isinstance(spec, bytes) else json.dumps(spec).encode()
    return asyncio.run(_call(app, "POST", f"/node/v1/templates/{name}/build", content=body))


@pytest.mark.parametrize(
    ("name", "statuses"),
    [
        ("%2e%2e", {400, 404}),
        ("..", {400, 404}),
        ("tpl-..%2Fx", {404}),
        ("tpl-../x", {404}),
        ("TPL-ABC", {400}),
        ("tpl-" + "a" * 60, {400}),
        ("python", {400}),
        ("base", {400}),
    ],
)
def test_hostile_names_are_refused(app: Any, name: str, statuses: set[int]) -> None:
    response = _post(app, name, {"from": "python"})
    assert response.status_code in statuses, response.text
    assert app.state.template_builds.building == {}


def test_hostile_specs_are_refused_before_anything_is_built(app: Any) -> None:
    name = "tpl-0123456789abcdef"
    many = _post(app, name, {"from": "python", "steps": [{"run": "true"}] * 10_000})
    assert many.status_code == 400 and many.json()["error"]["code"] == "invalid_argument"
    assert _post(app, name, b"{not json").status_code == 400
    assert (
        _post(app, name, {"from": "python", "steps": [{"apt": ["--allow-unauthenticated"]}]}).status_code
        == 400
    )
    over_file = {"path": "/big", "content_b64": base64.b64encode(b"x" * (MAX_FILE_BYTES + 1)).decode()}
    assert _post(app, name, {"from": "python", "steps": [{"file": over_file}]}).status_code == 413
    # a 100 MB file step: the body is refused once it passes the bound, before it is parsed
    huge = (
        b'{"from": "python", "steps": [{"file": {"path": "/x", "content_b64": "'
        + b"A" * (100 << 20)
        + b'"}}]}'
    )
    response = _post(app, name, huge)
    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"
    assert app.state.template_builds.building == {}
    # a valid request gets past every check: this node (FakeDriver, no helper) cannot build
    assert _post(app, name, {"from": "python"}).status_code == 503
    assert app.state.template_builds.building == {}


def test_a_declared_oversized_body_is_refused_unread(app: Any) -> None:
    response = asyncio.run(
        _call(app, "POST", "/node/v1/templates/tpl-0123456789abcdef/build", content=b"{}",
              headers={"Content-Length": str(100 << 20)})
    )  # fmt: skip
    assert response.status_code == 413


def test_the_routes_need_the_node_token(app: Any) -> None:
    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return [
                (await client.get("/node/v1/templates")).status_code,
                (await client.delete("/node/v1/templates/tpl-0123456789abcdef")).status_code,
                (await client.post("/node/v1/templates/tpl-0123456789abcdef/build", json={})).status_code,
            ]

    assert asyncio.run(scenario()) == [401, 401, 401]
    deleted = asyncio.run(_call(app, "DELETE", "/node/v1/templates/python"))
    assert deleted.status_code == 400
    assert asyncio.run(_call(app, "DELETE", "/node/v1/templates/Bad..Name")).status_code == 400


def test_the_log_is_bounded_per_line_and_in_all() -> None:
    lines: list[str] = []
    sink = LogSink(lines.append)
    sink.feed(None, b"a" * (MAX_LOG_LINE * 3) + b"\nshort\npartial")
    sink.flush()
    assert all(len(line) <= MAX_LOG_LINE + 64 for line in lines)
    assert "line cut" in lines[0] and lines[-2:] == ["short", "partial"]
    endless = LogSink(lines.append)
    for _ in range(MAX_LOG_TOTAL // 1000 + 10):
        endless.feed(None, b"b" * 999 + b"\n")
    assert endless.total <= MAX_LOG_TOTAL and endless.dropped > 0
    assert sum(1 for line in lines if line.startswith("[log truncated")) == 1
    assert len(endless.tail) <= 2048


def test_sources_allow_exactly_their_hosts() -> None:
    sources = BuildSources(
        apt_sources=(
            "deb [trusted=yes] http://mirror.test/debian ./\ndeb https://deb.example.com/d bookworm main\n"
        ),
        pip_index="http://index.test:8080/simple/",
    )
    assert sources.allow_hosts() == ["mirror.test", "deb.example.com", "index.test"]
    assert sources.pip_trusted_host() == "index.test"
    assert (
        BuildSources(apt_sources="", pip_index="https://pkgs.example.com/simple").pip_trusted_host() is None
    )
    assert BuildSources(apt_sources="", pip_index="file:///opt/simple").allow_hosts() == []


def test_the_node_ca_block_is_removed_and_the_rest_kept() -> None:
    system = b"-----BEGIN CERTIFICATE-----\nROOT\n-----END CERTIFICATE-----\n"
    ca = b"-----BEGIN CERTIFICATE-----\nNODE\n-----END CERTIFICATE-----\n"
    assert without_node_ca(with_node_ca(system, ca)) == system
    assert without_node_ca(system) == system
    # a ca-certificates trigger copied the CA into the bundle without markers
    assert without_node_ca(system + ca + with_node_ca(b"", ca), ca) == system
