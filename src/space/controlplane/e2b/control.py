"""The E2B control API as one ASGI app (`create_control_app`), served on its own port by the control
plane (space.controlplane.e2b.serve) over the control plane's own Services.

Routes (E2B's paths; the SDK's base URL is E2B_API_URL):
  POST /sandboxes, POST /v2/sandboxes            create (sandboxes.py)
  GET /sandboxes/{id}, DELETE /sandboxes/{id}    get_info, kill
  POST /sandboxes/{id}/timeout|pause|connect     set_timeout, pause, connect (also POST /v2/.../connect)
  GET /v2/sandboxes, GET /sandboxes              list (listing.py)
  POST /sandboxes/{id}/fork|snapshots            fork, create_snapshot (snapshots.py)
  GET /snapshots, DELETE /templates/{id}         list_snapshots, delete_snapshot
  PUT /sandboxes/{id}/network, GET .../metrics   network rules, metrics (network.py)
  GET /templates/aliases/{alias}                 Template.exists (templates.py)
  GET /health                                    liveness (no key)

Invariants:
- Every route but /health authenticates a SPACE key before it does anything (auth.py), and every body
  is bounded (SPACE_API_JSON_BODY_BYTES) before it is parsed: a larger Content-Length is a 413 at once, a
  chunked body is read to the bound and refused there (413, the connection closed).
- Each key's requests are rate-limited as on SPACE's API (auth.py), in buckets of this app's own.
- Every failure is E2B's `{"code", "message"}` (errors.py); there is no OpenAPI document or docs page.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.controlplane.api.deps import Services
from space.controlplane.api.limits import TokenBuckets
from space.controlplane.e2b import errors as e2b_errors
from space.controlplane.e2b import listing, network, sandboxes, snapshots, templates
from space.rest.request_id import RequestIdMiddleware


def create_control_app(services: Services) -> FastAPI:
    app = FastAPI(title="SPACE E2B control API", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.services = services
    settings = services.settings
    app.state.request_buckets = TokenBuckets(
        settings.api_requests_per_s, settings.api_request_burst, settings.api_max_tracked_keys
    )  # auth.py: per key, as on SPACE's API
    e2b_errors.install(app)
    for router in (sandboxes.router, listing.router, snapshots.router, network.router, templates.router):
        app.include_router(router)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_middleware(BodyLimit, limit=services.settings.api_json_body_bytes)
    app.add_middleware(RequestIdMiddleware, issue=True, quiet=r"^/health$")  # as SPACE's API (ADR 0071)
    return app


async def _health() -> dict[str, Any]:
    return {"status": "ok"}


class BodyLimit:
    """Bounds every request body (module invariants), answering E2B's 413. The bodies of this API are
    small JSON documents, so a body is read whole (up to the bound) before the route sees it; a larger
    one is refused without being read further."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def whole_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, whole_body, send)

    async def _too_large(self, send: Send) -> None:
        body = f'{{"code":413,"message":"request body exceeds {self.limit} bytes"}}'.encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
