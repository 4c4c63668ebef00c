"""The browser of a `browser` sandbox (ADR 0064): its DevTools URL for Playwright & co., screenshots, and
logins with a `login` credential (ADR 0066).

    browser = sandbox.browser
    pw_browser = playwright.chromium.connect_over_cdp(browser.cdp_url(), headers=browser.cdp_headers())
    png = browser.screenshot("http://127.0.0.1:8000/")   # or None: the first open page as it is
    page = browser.login("site")   # the open login page of the credential's origin, filled and submitted

Invariants:
- The API key travels in the Authorization header only, never in a URL.
- `screenshot` is one API call (POST /v1/sandboxes/{id}/browser/screenshot: the control plane speaks CDP
  to the sandbox's Chromium), so it works over every transport the client has, the MCP server's
  in-process one included. `screenshot(url)` opens a page of its own and closes it afterwards: the pages
  an agent has open are not navigated.
- `login` is one API call too (POST /v1/sandboxes/{id}/browser/login): SPACE types the credential's
  placeholders into the page's form and submits it; the egress gateway writes the real values into that
  origin's submission, so neither this client nor the sandbox ever holds them.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_LOGIN_TIMEOUT_S = 30.0


def _ws_url(base_url: str, sandbox_id: str) -> str:
    base = base_url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    return f"{base}/v1/sandboxes/{sandbox_id}/cdp"


def _auth(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


def _body(url: str | None, timeout: float) -> dict[str, Any]:
    return {"url": url, "timeout_s": timeout}


def _login_body(credential: str, target_id: str | None, timeout: float) -> dict[str, Any]:
    return {"credential": credential, "target_id": target_id, "timeout_s": timeout}


LOGIN_STEPS_S = 60.0  # the fill's steps besides the wait for the next page, and the network


class _Base:
    def __init__(self, http: Any, sandbox_id: str) -> None:
        self._http = http
        self._sandbox_id = sandbox_id
        self._path = f"/v1/sandboxes/{sandbox_id}/browser/screenshot"
        self._login_path = f"/v1/sandboxes/{sandbox_id}/browser/login"

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

    def login(
        self, credential: str, *, target_id: str | None = None, timeout: float = DEFAULT_LOGIN_TIMEOUT_S
    ) -> dict[str, Any]:
        """Log in with the bound `login` credential: its origin's open page (or `target_id`) gets the
        placeholders in its login form, which is submitted. Answers `{credential, origin, target_id,
        navigated, url, title}` of the page after the submit (waited for up to `timeout` seconds)."""
        answer: dict[str, Any] = self._http.json(
            "POST", self._login_path, json_body=_login_body(credential, target_id, timeout),
            timeout=self._http.timeout(timeout + LOGIN_STEPS_S),
        )  # fmt: skip
        return answer


class AsyncBrowser(_Base):
    async def screenshot(self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
        """A PNG of `url` loaded in a page of its own, or (None) of the browser's first page as it is."""
        answer = await self._http.json(
            "POST", self._path, json_body=_body(url, timeout), timeout=self._http.timeout(timeout + 30)
        )
        return base64.b64decode(answer["png_b64"])

    async def login(
        self, credential: str, *, target_id: str | None = None, timeout: float = DEFAULT_LOGIN_TIMEOUT_S
    ) -> dict[str, Any]:
        """Log in with the bound `login` credential: its origin's open page (or `target_id`) gets the
        placeholders in its login form, which is submitted. Answers `{credential, origin, target_id,
        navigated, url, title}` of the page after the submit (waited for up to `timeout` seconds)."""
        answer: dict[str, Any] = await self._http.json(
            "POST", self._login_path, json_body=_login_body(credential, target_id, timeout),
            timeout=self._http.timeout(timeout + LOGIN_STEPS_S),
        )  # fmt: skip
        return answer
