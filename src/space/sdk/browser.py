"""The browser of a `browser` sandbox (ADR 0064): its DevTools URL for Playwright & co., and screenshots.

    browser = sandbox.browser
    pw_browser = playwright.chromium.connect_over_cdp(browser.cdp_url(), headers=browser.cdp_headers())
    png = browser.screenshot("http://127.0.0.1:8000/")   # or None: the first open page as it is

Invariants:
- The API key travels in the Authorization header only, never in a URL.
- `screenshot` is one API call (POST /v1/sandboxes/{id}/browser/screenshot: the control plane speaks CDP
  to the sandbox's Chromium), so it works over every transport the client has, the MCP server's
  in-process one included. `screenshot(url)` opens a page of its own and closes it afterwards: the pages
  an agent has open are not navigated.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

DEFAULT_TIMEOUT_S = 60.0


def _ws_url(base_url: str, sandbox_id: str) -> str:
    base = base_url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    return f"{base}/v1/sandboxes/{sandbox_id}/cdp"


def _auth(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


def _body(url: str | None, timeout: float) -> dict[str, Any]:
    return {"url": url, "timeout_s": timeout}


class _Base:
    def __init__(self, http: Any, sandbox_id: str) -> None:
        self._http = http
        self._sandbox_id = sandbox_id
        self._path = f"/v1/sandboxes/{sandbox_id}/browser/screenshot"

    def cdp_url(self) -> str:
        """The sandbox's DevTools WebSocket (Playwright: `connect_over_cdp(url, headers=cdp_headers())`)."""
        return _ws_url(self._http.url, self._sandbox_id)

    def cdp_headers(self) -> dict[str, str]:
        """The headers a CDP client must send (the API key)."""
        return _auth(self._http.headers)


class SyncBrowser(_Base):
    def screenshot(self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """A PNG of `url` loaded in a page of its own, or (None) of the browser's first page as it is."""
        answer = self._http.json(
            "POST", self._path, json_body=_body(url, timeout), timeout=self._http.timeout(timeout + 30)
        )
        return base64.b64decode(answer["png_b64"])


class AsyncBrowser(_Base):
    async def screenshot(self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """A PNG of `url` loaded in a page of its own, or (None) of the browser's first page as it is."""
        answer = await self._http.json(
            "POST", self._path, json_body=_body(url, timeout), timeout=self._http.timeout(timeout + 30)
        )
        return base64.b64decode(answer["png_b64"])
