"""The SDK puts SPACE under its caller's OpenTelemetry trace (ADR 0072): a request made while the caller
has a current span carries that span as a W3C traceparent (never baggage); without one, no header."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider

from space.sdk import Space
from tests.support.sdk_server import KEY, URL, FakeServer, sandbox_json


@pytest.fixture
def served() -> Iterator[tuple[Space, FakeServer]]:
    server = FakeServer()
    server.on("GET", "/v1/sandboxes/sb-1", httpx.Response(200, json=sandbox_json("sb-1")))
    server.on(
        "GET", "/v1/sandboxes/sb-1/traces", httpx.Response(200, json={"sandbox_id": "sb-1", "traces": []})
    )
    client = Space(url=URL, api_key=KEY, transport=httpx.MockTransport(server), retry_backoff=0)
    yield client, server
    client.close()


def test_the_callers_span_travels_as_traceparent(served: tuple[Space, FakeServer]) -> None:
    sp, server = served
    tracer = TracerProvider().get_tracer("the caller's app")  # the caller's own provider, not SPACE's
    token = otel_context.attach(baggage.set_baggage("user", "private"))
    try:
        with tracer.start_as_current_span("agent step") as span:
            sp.sandboxes.get("sb-1")
    finally:
        otel_context.detach(token)
    ctx = span.get_span_context()
    headers = server.last().headers
    version_ids, flags = headers["traceparent"].rsplit("-", 1)
    assert version_ids == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
    assert int(flags, 16) & 1, "sampled"
    assert "baggage" not in headers


def test_no_span_no_header(served: tuple[Space, FakeServer]) -> None:
    sp, server = served
    assert sp.sandboxes.ref("sb-1").traces(limit=3) == []
    assert "traceparent" not in server.last().headers
    assert server.last().url.params["limit"] == "3"
