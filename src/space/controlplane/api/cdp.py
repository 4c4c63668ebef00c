"""The DevTools protocol of a `browser` sandbox's Chromium through SPACE (ADR 0064).

`GET /v1/sandboxes/{id}/cdp` (WebSocket) is Chromium's browser endpoint, relayed message for message to the
node (space.node.agent.routes.cdp) and from there through the sandbox's channel to 127.0.0.1:9222 inside;
`GET /v1/sandboxes/{id}/cdp/json/version` is Chromium's discovery document with its
`webSocketDebuggerUrl` rewritten to that WebSocket, so Playwright's `connect_over_cdp` works with either
URL (the API key in a header, as for every request). Two calls run a CDP conversation of the control
plane's own: `POST .../browser/screenshot` (ADR 0064) and `POST .../browser/login` (ADR 0066: a page's
login form filled with a bound login credential's placeholders and submitted).

Invariants:
- CDP is full control of the browser (every page, cookie and download in it), so it needs a member key
  of the sandbox's project; another project's sandbox is 404 as everywhere; a request without a key is
  refused before the WebSocket handshake completes (the real status and error body).
- Nothing outside the sandbox connects to its network: the bytes travel in the sandbox's channel.
- The rewritten URL is built from this request's own base URL and the validated sandbox id only.
- The page fill types placeholders only, into a form of the credential's origin (space.core.cdp_login);
  each fill, done or refused, is in the credential's audit log.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, WebSocket
from pydantic import BaseModel, ConfigDict, Field

from space.controlplane.api.data_plane import relay_websocket
from space.controlplane.api.deps import (
    Auth,
    Services,
    Svc,
    authenticate,
    authorization_of,
    node_of,
    running_sandbox,
    services_of,
)
from space.controlplane.api.login_binding import audit_login, bound_login
from space.controlplane.credentials.spec import validate_name
from space.controlplane.store.records import SandboxRecord
from space.core import cdp_login, cdp_screenshot, errors
from space.core.cdp_conversation import Receive, Send
from space.core.ids import parse_sandbox_id
from space.node.agent.routes.cdp import no_browser, relay_argv
from space.rest import errors as rest_errors

router = APIRouter(tags=["browser"])
T = TypeVar("T")
Conversing = Callable[[Send, Receive], Awaitable[T]]


class CdpVersion(BaseModel):
    """Chromium's /json/version document (its other fields, e.g. `Protocol-Version`, pass through)."""

    model_config = ConfigDict(extra="allow")

    Browser: str = ""
    webSocketDebuggerUrl: str  # Chromium's name, which CDP clients read


@router.websocket("/sandboxes/{sandbox_id}/cdp")
async def cdp(websocket: WebSocket, sandbox_id: str) -> None:
    """Chromium's DevTools protocol: authenticate like any request, then relay messages to the node."""
    services = services_of(websocket)
    try:
        who = await authenticate(
            services,
            authorization_of(websocket.headers, websocket=True),
            websocket.headers.get("x-space-project"),
        )
        who.require("member")
        parse_sandbox_id(sandbox_id, field="sandbox_id")
        sb = await running_sandbox(services, who, sandbox_id)
    except errors.SpaceError as exc:
        await websocket.send_denial_response(rest_errors.error_response(exc))
        return
    await websocket.accept()
    node = services.nodes.client(node_of(sb))
    async with node.cdp(sb.id) as upstream:
        await relay_websocket(websocket, upstream, keep_close_code=True)


@router.get("/sandboxes/{sandbox_id}/cdp/json/version", response_model=CdpVersion)
@router.get("/sandboxes/{sandbox_id}/cdp/json/version/", response_model=CdpVersion, include_in_schema=False)
async def cdp_version(sandbox_id: str, request: Request, who: Auth, *, services: Svc) -> dict[str, Any]:
    """Chromium's /json/version (started if needed), its `webSocketDebuggerUrl` this API's CDP WebSocket."""
    who.require("member")
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    sb = await running_sandbox(services, who, sandbox_id)
    answer = await services.nodes.client(node_of(sb)).exec(sb.id, relay_argv("version"), timeout=60)
    if answer.exit_code != 0:
        raise no_browser(answer.stderr.strip() or f"the relay exited with {answer.exit_code}")
    try:
        document = json.loads(answer.stdout.splitlines()[0])
        if not isinstance(document, dict):
            raise ValueError("not an object")
    except (ValueError, IndexError) as exc:
        raise no_browser("the DevTools endpoint answered no JSON document") from exc
    base = str(request.base_url).rstrip("/")
    base = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    document["webSocketDebuggerUrl"] = f"{base}/v1/sandboxes/{sb.id}/cdp"
    return document


class ScreenshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    timeout_s: float = 60.0


class ScreenshotAnswer(BaseModel):
    png_b64: str
    bytes: int


MAX_SCREENSHOT_TIMEOUT_S = 300.0


async def _converse(
    services: Services, sb: SandboxRecord, timeout_s: float, what: str, conversation: Conversing[T]
) -> T:
    """Run `conversation(send, recv)` on the sandbox's CDP within `timeout_s` (504 after it); the node's
    refusal (no browser) and a closed connection are the typed 409 of a sandbox without a browser."""
    from websockets.exceptions import ConnectionClosed

    node = services.nodes.client(node_of(sb))
    try:
        async with asyncio.timeout(timeout_s), node.cdp(sb.id) as ws:

            async def recv() -> str | bytes:
                message = await ws.recv()
                try:
                    error = json.loads(message)
                except ValueError:
                    return message
                if isinstance(error, dict) and error.get("type") == "error":  # the node's refusal
                    raise no_browser(str((error.get("error") or {}).get("message", "")))
                return message

            return await conversation(ws.send, recv)
    except TimeoutError as exc:
        raise errors.Timeout(f"no {what} within {timeout_s:g} s") from exc
    except ConnectionClosed as exc:
        raise no_browser("the browser connection ended") from exc


@router.post("/sandboxes/{sandbox_id}/browser/screenshot", response_model=ScreenshotAnswer)
async def screenshot(sandbox_id: str, body: ScreenshotRequest, who: Auth, *, services: Svc) -> dict[str, Any]:
    """A PNG of `url` in a page of its own (or of the first page as it is), taken over the sandbox's CDP."""
    who.require("member")
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    url = cdp_screenshot.check_url(body.url)
    _check_timeout(body.timeout_s)
    sb = await running_sandbox(services, who, sandbox_id)

    async def shoot(send: Send, recv: Receive) -> bytes:
        return await cdp_screenshot.screenshot(send, recv, url)

    png = await _converse(services, sb, body.timeout_s, "screenshot", shoot)
    return {"png_b64": base64.b64encode(png).decode(), "bytes": len(png)}


def _check_timeout(timeout_s: float) -> None:
    if not 0 < timeout_s <= MAX_SCREENSHOT_TIMEOUT_S:
        raise errors.InvalidArgument(
            f"timeout_s must be in (0, {MAX_SCREENSHOT_TIMEOUT_S:g}]", field="timeout_s"
        )


class BrowserLoginRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    credential: str = Field(description="A login credential bound to the sandbox (ADR 0063).")
    target_id: str | None = Field(
        default=None, description="The page (a DevTools target id); default: the first on the origin."
    )
    timeout_s: float = Field(default=30.0, description="How long to wait for the page after the submit.")


class BrowserLoginAnswer(BaseModel):
    credential: str
    origin: str
    target_id: str
    navigated: bool = Field(description="The page navigated and loaded after the submit within timeout_s.")
    url: str = Field(description="The page's URL after the submit (as the page reports it).")
    title: str


#: The page fill's steps before and after its navigation wait (attach, fill, read the page) are bounded
#: by this much on top of timeout_s.
LOGIN_STEPS_S = 30.0


@router.post("/sandboxes/{sandbox_id}/browser/login", response_model=BrowserLoginAnswer)
async def browser_login(
    sandbox_id: str, body: BrowserLoginRequest, who: Auth, *, services: Svc
) -> dict[str, Any]:
    """Fill a page's login form with a bound login credential's placeholders and submit it (ADR 0066);
    the egress gateway writes the real values into that origin's submission (ADR 0063)."""
    who.require("member")
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    validate_name(body.credential, field="credential")
    target_id = cdp_login.check_target_id(body.target_id)
    _check_timeout(body.timeout_s)
    sb = await running_sandbox(services, who, sandbox_id)
    bound = await bound_login(services, sb, body.credential)
    form = cdp_login.LoginForm(
        bound.form.origin, bound.form.username_field, bound.form.password_field, bound.form.form_action
    )

    async def fill(send: Send, recv: Receive) -> cdp_login.LoginFill:
        return await cdp_login.fill_login(
            send, recv, form, (bound.username_placeholder, bound.placeholder), target_id=target_id,
            navigation=lambda: asyncio.timeout(body.timeout_s),
        )  # fmt: skip

    try:
        done = await _converse(services, sb, body.timeout_s + LOGIN_STEPS_S, "login", fill)
    except errors.SpaceError as exc:
        await audit_login(services, who, bound, "login_fill_refused", {"error": exc.code, **exc.details})
        raise
    await audit_login(services, who, bound, "login_filled", {"navigated": done.navigated})
    return {
        "credential": body.credential, "origin": form.origin, "target_id": done.target_id,
        "navigated": done.navigated, "url": done.url, "title": done.title,
    }  # fmt: skip
