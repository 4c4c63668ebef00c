"""E2B's code-interpreter API (the SDK's port 49999) over SPACE's kernel bridge (ADR 0058).

Requests reach the in-sandbox front like envd's, with `E2b-Sandbox-Port: 49999` (envd/app.py dispatches
on it). Routes, as `e2b_code_interpreter` calls them:
    POST   /execute                {"code", "context_id"?, "language"?, "env_vars"?} -> NDJSON events
    POST   /contexts               {"language"?, "cwd"?} -> {"id", "language", "cwd"}
    GET    /contexts               -> [{"id", "language", "cwd"}, ...]
    DELETE /contexts/{id}          -> 204
    POST   /contexts/{id}/restart  -> 204
    GET    /health                 -> 204

Invariants:
- Callers resolve like envd's (`caller.target_of`): `X-Access-Token`, or, since the SDK's context calls
  send only `E2B-Traffic-Access-Token`, that header (the create answer's `trafficAccessToken`, which is the
  sandbox's envd token: the same rights, in that one sandbox); SPACE keys work too. Everything here
  runs code or changes kernels, so it needs a member key or the sandbox's token.
- The front never opens a connection to the sandbox: `code_runs.KernelBridge` runs the template's bridge
  through the node's process calls.
- Errors are plain text with E2B's statuses (400 for `context_id` with `language`, or anything malformed;
  404 for an unknown context or sandbox), as E2B's server answers.
- An execution holds one of the caller's stream slots while it streams, is bounded by code_runs, and is
  interrupted when its client goes away (the response is cancelled; code_runs stops the bridge).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from space.controlplane.api.deps import Services
from space.controlplane.code_runs import KernelBridge, check_context_id
from space.controlplane.e2b.envd.caller import Target, target_of
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.e2b.envd.rpc_errors import rest_status
from space.core import errors

PORT = 49999
PORT_HEADER = "e2b-sandbox-port"
TRAFFIC_HEADER = "e2b-traffic-access-token"
MAX_BODY_BYTES = 2 << 20
NDJSON = "application/x-ndjson"


def is_code_interpreter(scope: Scope) -> bool:
    """Whether a request is for the code interpreter's port (`E2b-Sandbox-Port: 49999`)."""
    for name, value in scope.get("headers", ()):
        if name == PORT_HEADER.encode():
            return bool(value.strip() == str(PORT).encode())
    return False


def _headers(request: Request) -> dict[str, str]:
    found = dict(request.headers.items())
    traffic = found.get(TRAFFIC_HEADER, "").strip()
    if traffic and not found.get("x-access-token"):
        found["x-access-token"] = traffic
    return found


async def _json_body(request: Request) -> dict[str, Any]:
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise errors.TooLarge(f"a request body of more than {MAX_BODY_BYTES} bytes", limit=MAX_BODY_BYTES)
    try:
        found = json.loads(data or b"{}")
    except ValueError as exc:
        raise errors.InvalidArgument("the body is not JSON", field="body") from exc
    if not isinstance(found, dict):
        raise errors.InvalidArgument("the body must be a JSON object", field="body")
    return found


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise errors.InvalidArgument(f"{key} must be a string", field=key)
    return value or None


class CodeInterpreterFront:
    def __init__(self, services: Services, limits: EnvdLimits) -> None:
        self.services = services
        self.limits = limits

    async def _bridge(self, request: Request) -> tuple[Target, KernelBridge]:
        target = await target_of(self.services, self.limits, _headers(request), mutating=True)
        return target, KernelBridge(target.node, target.sandbox_id, target.sandbox.template)

    async def execute(self, request: Request) -> Response:
        body = await _json_body(request)
        context_id = _optional_str(body, "context_id")
        language = _optional_str(body, "language")
        if context_id and language:
            raise errors.InvalidArgument("give context_id or language, not both", field="context_id")
        if language not in (None, "python"):
            raise errors.InvalidArgument(
                f"language {language!r} is not supported (python only)", field="language"
            )
        code = body.get("code")
        if not isinstance(code, str):
            raise errors.InvalidArgument("code must be a string", field="code")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict):
            raise errors.InvalidArgument("env_vars must be an object", field="env_vars")
        target, bridge = await self._bridge(request)
        slot = self.limits.stream(target.who)
        await slot.__aenter__()
        try:
            events = await bridge.execute(code, context_id=context_id, env_vars=env)
        except BaseException as exc:
            await slot.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return StreamingResponse(_ndjson(events, slot), media_type=NDJSON)

    async def create_context(self, request: Request) -> Response:
        body = await _json_body(request)
        language = _optional_str(body, "language") or "python"
        cwd = _optional_str(body, "cwd")
        _target, bridge = await self._bridge(request)
        request_body: dict[str, Any] = {"id": str(uuid.uuid4()), "language": language}
        if cwd is not None:
            request_body["cwd"] = cwd
        made = await bridge.call("start", request_body)
        return JSONResponse(_context_view(made))

    async def list_contexts(self, request: Request) -> Response:
        _target, bridge = await self._bridge(request)
        found = await bridge.call("list", {})
        return JSONResponse([_context_view(item) for item in found])

    async def remove_context(self, request: Request, context_id: str) -> Response:
        _target, bridge = await self._bridge(request)
        await bridge.call("remove", {"id": check_context_id(context_id)})
        return Response(status_code=204)

    async def restart_context(self, request: Request, context_id: str) -> Response:
        _target, bridge = await self._bridge(request)
        await bridge.call("restart", {"id": check_context_id(context_id)})
        return Response(status_code=204)


def _context_view(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise errors.Internal("the kernel bridge answered a malformed context")
    return {"id": str(item.get("id")), "language": str(item.get("language")), "cwd": str(item.get("cwd"))}


async def _ndjson(events: AsyncIterator[dict[str, Any]], slot: Any) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            if event.get("type") == "timeout":
                continue  # SPACE's own API shows it; E2B's client times out on its own side
            yield json.dumps(event, separators=(",", ":")).encode() + b"\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        await slot.__aexit__(None, None, None)


def code_interpreter_app(services: Services, limits: EnvdLimits) -> ASGIApp:
    front = CodeInterpreterFront(services, limits)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await _route(front, request)
        except errors.SpaceError as exc:
            response = PlainTextResponse(exc.message, status_code=rest_status(exc))
        await response(scope, receive, send)

    return app


async def _route(front: CodeInterpreterFront, request: Request) -> Response:
    path, method = request.url.path, request.method
    parts = path.split("/")
    if path == "/health":
        return Response(status_code=204)
    handler = _ROUTES.get((method, path))
    if handler is not None:
        return await handler(front, request)
    if len(parts) == 3 and parts[1] == "contexts" and method == "DELETE":
        return await front.remove_context(request, parts[2])
    if len(parts) == 4 and parts[1] == "contexts" and parts[3] == "restart" and method == "POST":
        return await front.restart_context(request, parts[2])
    return PlainTextResponse("not found", status_code=404)


_ROUTES: dict[tuple[str, str], Callable[[CodeInterpreterFront, Request], Awaitable[Response]]] = {
    ("POST", "/execute"): CodeInterpreterFront.execute,
    ("POST", "/contexts"): CodeInterpreterFront.create_context,
    ("GET", "/contexts"): CodeInterpreterFront.list_contexts,
}
