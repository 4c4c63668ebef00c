"""The browser of a `browser` sandbox (ADR 0064): its DevTools URL for Playwright & co., and screenshots.

    browser = sandbox.browser
    pw_browser = playwright.chromium.connect_over_cdp(browser.cdp_url(), headers=browser.cdp_headers())
    png = browser.screenshot("http://127.0.0.1:8000/")   # or None: the first open page as it is

Invariants:
- The API key travels in the Authorization header only, never in a URL.
- `screenshot(url)` opens a page of its own and closes it afterwards: the pages an agent has open are not
  navigated. `screenshot()` without a URL shows the first page target as it is (a blank one if none).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from space.core.errors import SpaceError
from space.sdk.errors import error_from_response

DEFAULT_TIMEOUT_S = 60.0


def _ws_url(base_url: str, sandbox_id: str) -> str:
    base = base_url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    return f"{base}/v1/sandboxes/{sandbox_id}/cdp"


def _refusal(exc: InvalidStatus) -> SpaceError:
    """The typed error of a refused handshake (404 another project's or a missing sandbox, 401 no key)."""
    response = exc.response
    return error_from_response(response.status_code, bytes(response.body or b""), dict(response.headers))


class _Steps:
    """The CDP conversation of one screenshot, independent of how messages travel."""

    def __init__(self) -> None:
        self.next_id = 0
        self.loaded: set[str] = (
            set()
        )  # sessions whose page fired `load` (it may come before navigate's answer)

    def request(
        self, method: str, params: Mapping[str, Any] | None = None, session: str | None = None
    ) -> tuple[int, str]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": dict(params or {})}
        if session is not None:
            message["sessionId"] = session
        return self.next_id, json.dumps(message)

    def answer(self, raw: str | bytes, wanted: int) -> dict[str, Any] | None:
        message = json.loads(raw)
        if message.get("method") == "Page.loadEventFired" and message.get("sessionId"):
            self.loaded.add(message["sessionId"])
        if message.get("id") != wanted:
            return None
        if "error" in message:
            raise SpaceError(f"browser: {message['error'].get('message', message['error'])}")
        return dict(message.get("result") or {})


class SyncBrowser:
    def __init__(self, base_url: str, headers: Mapping[str, str], sandbox_id: str) -> None:
        self._url = _ws_url(base_url, sandbox_id)
        self._headers = {k: v for k, v in headers.items() if k.lower() == "authorization"}

    def cdp_url(self) -> str:
        """The sandbox's DevTools WebSocket (Playwright: `connect_over_cdp(url, headers=cdp_headers())`)."""
        return self._url

    def cdp_headers(self) -> dict[str, str]:
        """The headers a CDP client must send (the API key)."""
        return dict(self._headers)

    def _call(self, ws: ClientConnection, steps: _Steps, method: str, params: Mapping[str, Any] | None = None,
              *, session: str | None = None, deadline: float = 0.0) -> dict[str, Any]:  # fmt: skip
        wanted, text = steps.request(method, params, session)
        ws.send(text)
        while True:
            got = steps.answer(ws.recv(timeout=max(0.1, deadline - time.monotonic())), wanted)
            if got is not None:
                return got

    def screenshot(self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """A PNG of `url` loaded in a page of its own, or (None) of the browser's first page as it is."""
        deadline = time.monotonic() + timeout
        steps = _Steps()
        try:
            with connect(
                self._url, additional_headers=self._headers, max_size=None, open_timeout=timeout
            ) as ws:
                created = None
                target = None
                if url is None:
                    pages = self._call(ws, steps, "Target.getTargets", deadline=deadline)["targetInfos"]
                    target = next((t["targetId"] for t in pages if t.get("type") == "page"), None)
                if target is None:
                    target = created = self._call(
                        ws, steps, "Target.createTarget", {"url": "about:blank"}, deadline=deadline
                    )["targetId"]
                session = self._call(
                    ws,
                    steps,
                    "Target.attachToTarget",
                    {"targetId": target, "flatten": True},
                    deadline=deadline,
                )["sessionId"]
                if url is not None:
                    self._call(ws, steps, "Page.enable", session=session, deadline=deadline)
                    self._call(ws, steps, "Page.navigate", {"url": url}, session=session, deadline=deadline)
                    while session not in steps.loaded:
                        steps.answer(ws.recv(timeout=max(0.1, deadline - time.monotonic())), 0)
                shot = self._call(ws, steps, "Page.captureScreenshot", {"format": "png"}, session=session,
                                  deadline=deadline)  # fmt: skip
                if created is not None:
                    self._call(ws, steps, "Target.closeTarget", {"targetId": created}, deadline=deadline)
        except TimeoutError as exc:
            raise SpaceError(f"browser: no screenshot within {timeout:g} s") from exc
        except InvalidStatus as exc:
            raise _refusal(exc) from exc
        return base64.b64decode(shot["data"])


class AsyncBrowser:
    def __init__(self, base_url: str, headers: Mapping[str, str], sandbox_id: str) -> None:
        self._url = _ws_url(base_url, sandbox_id)
        self._headers = {k: v for k, v in headers.items() if k.lower() == "authorization"}

    def cdp_url(self) -> str:
        """The sandbox's DevTools WebSocket (Playwright: `connect_over_cdp(url, headers=cdp_headers())`)."""
        return self._url

    def cdp_headers(self) -> dict[str, str]:
        """The headers a CDP client must send (the API key)."""
        return dict(self._headers)

    async def _call(
        self, ws: AsyncConnection, steps: _Steps, method: str, params: Mapping[str, Any] | None = None,
        *, session: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        wanted, text = steps.request(method, params, session)
        await ws.send(text)
        while True:
            got = steps.answer(await ws.recv(), wanted)
            if got is not None:
                return got

    async def screenshot(self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """A PNG of `url` loaded in a page of its own, or (None) of the browser's first page as it is."""
        import asyncio

        async def shoot() -> bytes:
            steps = _Steps()
            async with async_connect(self._url, additional_headers=self._headers, max_size=None) as ws:
                created = None
                target = None
                if url is None:
                    pages = (await self._call(ws, steps, "Target.getTargets"))["targetInfos"]
                    target = next((t["targetId"] for t in pages if t.get("type") == "page"), None)
                if target is None:
                    target = created = (
                        await self._call(ws, steps, "Target.createTarget", {"url": "about:blank"})
                    )["targetId"]
                attach = {"targetId": target, "flatten": True}
                session = (await self._call(ws, steps, "Target.attachToTarget", attach))["sessionId"]
                if url is not None:
                    await self._call(ws, steps, "Page.enable", session=session)
                    await self._call(ws, steps, "Page.navigate", {"url": url}, session=session)
                    while session not in steps.loaded:
                        steps.answer(await ws.recv(), 0)
                shot = await self._call(
                    ws, steps, "Page.captureScreenshot", {"format": "png"}, session=session
                )
                if created is not None:
                    await self._call(ws, steps, "Target.closeTarget", {"targetId": created})
            return base64.b64decode(shot["data"])

        try:
            return await asyncio.wait_for(shoot(), timeout)
        except TimeoutError as exc:
            raise SpaceError(f"browser: no screenshot within {timeout:g} s") from exc
        except InvalidStatus as exc:
            raise _refusal(exc) from exc
