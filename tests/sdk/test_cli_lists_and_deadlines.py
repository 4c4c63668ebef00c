"""`space sandbox create --metadata/--on-timeout`, `space sandbox list` filters and pages, and `space sandbox
timeout`, through typer's CliRunner against the fake API (what the SDK sends, what the CLI prints)."""

from __future__ import annotations

import json

import httpx

from tests.support.sdk_server import FakeServer, invoke, sandbox_json


def test_create_sends_metadata_and_on_timeout(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-new")))
    result = invoke(
        "sandbox", "create", "--metadata", "team=ml", "-m", "q=a=b", "--on-timeout", "pause", "--ttl", "60"
    )
    assert result.exit_code == 0, result.output
    body = server.body()
    assert (body["metadata"], body["on_timeout"], body["ttl_s"]) == ({"team": "ml", "q": "a=b"}, "pause", 60)
    plain = invoke("sandbox", "create")
    assert plain.exit_code == 0 and "metadata" not in server.body() and "on_timeout" not in server.body()
    assert invoke("sandbox", "create", "--metadata", "novalue").exit_code == 2


def test_list_filters_and_follows_every_page(server: FakeServer) -> None:
    first = {
        "sandboxes": [sandbox_json("sb-a", expires_at="2030-01-01T00:00:00+00:00")],
        "next_page_token": "T1",
    }
    last = {"sandboxes": [sandbox_json("sb-b", state="paused", expires_at=None)]}
    server.on("GET", "/v1/sandboxes", httpx.Response(200, json=first), httpx.Response(200, json=last))
    result = invoke(
        "sandbox", "list", "--state", "running", "--state", "paused", "-t", "python", "-m", "env=prod",
        "-m", "q=a=b&c", "--oldest-first",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATE", "TEMPLATE", "NODE", "CREATED", "EXPIRES"]
    assert lines[1].split()[0] == "sb-a" and lines[1].split()[-1] == "2030-01-01T00:00:00+00:00"
    assert lines[2].split()[0] == "sb-b"
    asked = [request.url.params for request in server.requests]
    assert len(asked) == 2
    for params in asked:
        assert params.get_list("state") == ["running", "paused"]
        assert params.get_list("metadata") == ["env=prod", "q=a=b&c"]  # each pair one parameter, encoded
        assert (params["template"], params["order"]) == ("python", "asc")
    assert "page_token" not in asked[0] and asked[1]["page_token"] == "T1"  # the same filters, the next page


def test_timeout_sets_the_deadline(server: FakeServer) -> None:
    answer = sandbox_json("sb-x", expires_at="2030-01-01T00:00:30+00:00", on_timeout="pause")
    server.on("POST", "/v1/sandboxes/sb-x/timeout", httpx.Response(200, json=answer))
    result = invoke("sandbox", "timeout", "sb-x", "30", "--extend-only")
    assert result.exit_code == 0, result.output
    assert server.body() == {"timeout_s": 30, "extend_only": True}
    assert result.stdout == "sb-x expires 2030-01-01T00:00:30+00:00 (pause)\n"
    as_json = invoke("sandbox", "timeout", "sb-x", "0", "--json")
    assert json.loads(as_json.stdout)["id"] == "sb-x"
    assert server.body() == {"timeout_s": 0, "extend_only": False}
    sent = len(server.requests)
    assert invoke("sandbox", "timeout", "sb-x", "-5").exit_code == 2
    assert len(server.requests) == sent  # refused before any request
