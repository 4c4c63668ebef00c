"""`space sandbox create --isolation`, the SDK's `isolation=` and `Sandbox.isolation` (issue 15, ADR 0076),
through typer's CliRunner against the fake API: what is sent, what is shown."""

from __future__ import annotations

import httpx

from space.sdk import Space
from tests.support.sdk_server import FakeServer, invoke, sandbox_json


def test_create_sends_the_isolation_only_when_asked(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-vm", isolation="microvm")))
    result = invoke("sandbox", "create", "--isolation", "microvm")
    assert result.exit_code == 0, result.output
    assert server.body()["isolation"] == "microvm"
    plain = invoke("sandbox", "create")
    assert plain.exit_code == 0 and "isolation" not in server.body()  # the server's default: gvisor


def test_get_shows_the_isolation(server: FakeServer) -> None:
    server.on(
        "GET", "/v1/sandboxes/sb-vm", httpx.Response(200, json=sandbox_json("sb-vm", isolation="microvm"))
    )
    result = invoke("sandbox", "get", "sb-vm")
    assert result.exit_code == 0, result.output
    assert any(line.split() == ["isolation", "microvm"] for line in result.stdout.splitlines()), result.stdout


def test_the_sdk_property_defaults_to_gvisor_for_an_older_server(server: FakeServer) -> None:
    server.on(
        "GET", "/v1/sandboxes/sb-old", httpx.Response(200, json=sandbox_json("sb-old")),
        httpx.Response(200, json=sandbox_json("sb-old", isolation="microvm")),
    )  # fmt: skip
    with Space(url="http://space.test", api_key="k", transport=httpx.MockTransport(server)) as sp:
        assert sp.sandboxes.get("sb-old").isolation == "gvisor"
        assert sp.sandboxes.get("sb-old").isolation == "microvm"
