"""A fake SPACE server for SDK and CLI unit tests: routes (METHOD, path) to canned answers over
httpx.MockTransport and records every request; plus the JSON shapes the tests answer with.

Invariants:
- A route given several answers replays them in order and then keeps answering with the last one.
- A request to a route nobody set up is answered 404 `not_found` (as the real server does), never raised.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from space.cli import _common
from space.cli.main import app
from space.sdk import Space

URL = "http://space.test"
KEY = "sk-test"

Handler = Callable[[httpx.Request], httpx.Response]


def sandbox_json(sandbox_id: str = "sb-1", state: str = "running", **extra: Any) -> dict[str, Any]:
    return {
        "id": sandbox_id,
        "project_id": "prj-1",
        "template": "python",
        "state": state,
        "desired_state": state,
        "generation": 1,
        "node_id": "node-1",
        "env": {},
        "created_at": "2024-01-01T00:00:00Z",
        **extra,
    }


def error_response(status: int, code: str, message: str, **details: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, "details": details}})


def ndjson(*events: dict[str, Any]) -> httpx.Response:
    body = "".join(json.dumps(e) + "\n" for e in events).encode()
    return httpx.Response(200, content=body, headers={"Content-Type": "application/x-ndjson"})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _replay(answer: httpx.Response) -> Handler:
    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    return handler


class FakeServer:
    """Routes (METHOD, path) to handlers and records every request (body read)."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler | list[Handler]] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, *answers: httpx.Response | Handler) -> None:
        handlers: list[Handler] = []
        for answer in answers:
            handlers.append(_replay(answer) if isinstance(answer, httpx.Response) else answer)
        self.routes[(method, path)] = handlers if len(handlers) > 1 else handlers[0]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = (request.method, request.url.raw_path.split(b"?")[0].decode())
        self.requests.append(request)
        route = self.routes.get(key)
        if route is None:
            return error_response(404, "not_found", f"no route {key}")
        if not isinstance(route, list):
            return route(request)
        return (route.pop(0) if len(route) > 1 else route[0])(request)

    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, index: int = -1) -> Any:
        return json.loads(self.requests[index].content)


class LazyMockTransport(httpx.MockTransport):
    """MockTransport that hands the handler the request body unread (httpx's reads it first)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.handler(request)  # type: ignore[return-value]


# ---- the CLI over the fake server ---------------------------------------------------------------------

runner = CliRunner()


def serve_the_cli(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    """A FakeServer behind every client the `space` command makes; `.made` lists their (url, key)."""
    fake = FakeServer()
    made: list[tuple[str | None, str | None]] = []

    def factory(url: str | None, api_key: str | None) -> Space:
        made.append((url, api_key))
        return Space(
            url=url or "http://space.test",
            api_key=api_key or "k",
            transport=httpx.MockTransport(fake),
            retry_backoff=0,
        )

    monkeypatch.setattr(_common.state, "factory", factory)
    fake.made = made  # type: ignore[attr-defined]
    return fake


@pytest.fixture
def cli_server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    """The fake API server behind the `space` command; a test module or conftest binds it
    (`cli_server = sdk_server.cli_server`)."""
    return serve_the_cli(monkeypatch)


def invoke(*args: str, input: bytes | str | None = None) -> Any:
    return runner.invoke(app, list(args), input=input)
