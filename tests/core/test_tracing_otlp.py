"""Spans exported over OTLP/HTTP when an endpoint is configured (ADR 0072): a real exporter (the `otlp`
extra) posting to a collector stand-in on loopback; the allow-list holds in what leaves the process."""

from __future__ import annotations

import http.server
import secrets
import threading
from collections.abc import Iterator

import pytest

from space.core import tracing


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        _Collector.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        return None


@pytest.fixture
def collector() -> Iterator[str]:
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_spans_are_exported_to_the_configured_endpoint(collector: str) -> None:
    settings = tracing.TracingSettings(otlp_endpoint=collector)
    ring = tracing.SpanRing()
    provider = tracing.build_provider("space-test", settings, ring)
    secret = "sekret-" + secrets.token_hex(8)
    tracer = provider.get_tracer("space.test")
    with tracer.start_as_current_span(
        "exported-op", attributes=tracing.clean_attributes({"verb": "x", "env": secret})
    ):
        pass
    assert provider.force_flush(10_000)
    provider.shutdown()
    paths = [path for path, _body in _Collector.received]
    assert paths and set(paths) == {"/v1/traces"}
    body = b"".join(b for _p, b in _Collector.received)
    assert b"exported-op" in body and b"space-test" in body
    assert secret.encode() not in body
    assert len(ring) == 1  # and kept in memory too
