"""The DevTools (CDP) conversation of one screenshot, over any message transport (ADR 0064).

`screenshot(send, recv, url)`: with a URL, a page of its own is created, navigated and awaited (`load`),
captured as PNG and closed; without one, the browser's first page is captured as it is (a blank page is
created, and closed, when there is none). The pages an agent has open are never navigated.

Invariants:
- Only the caller's deadline bounds the conversation (the caller wraps it in one); every answer is
  matched by its id, an error answer is a SpaceError naming CDP's message.
- A `load` event that arrives before the answer to `Page.navigate` is not lost.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from space.core.errors import InvalidArgument, SpaceError

MAX_URL = 8192


def check_url(url: object) -> str | None:
    if url is None:
        return None
    if not isinstance(url, str) or not url or len(url) > MAX_URL or any(ch in url for ch in "\0\r\n"):
        raise InvalidArgument(f"url must be 1-{MAX_URL} characters without NUL or line breaks", field="url")
    return url


class _Conversation:
    def __init__(self, send: Callable[[str], Awaitable[None]], recv: Callable[[], Awaitable[str | bytes]]):
        self.send, self.recv = send, recv
        self.next_id = 0
        self.loaded: set[str] = set()

    def _note(self, raw: str | bytes) -> dict[str, Any]:
        message = json.loads(raw)
        if message.get("method") == "Page.loadEventFired" and message.get("sessionId"):
            self.loaded.add(message["sessionId"])
        return dict(message)

    async def call(
        self, method: str, params: Mapping[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self.next_id += 1
        wanted = self.next_id
        request: dict[str, Any] = {"id": wanted, "method": method, "params": dict(params or {})}
        if session is not None:
            request["sessionId"] = session
        await self.send(json.dumps(request))
        while True:
            message = self._note(await self.recv())
            if message.get("id") != wanted:
                continue
            if "error" in message:
                error = message["error"]
                raise SpaceError(
                    f"browser: {error.get('message', error) if isinstance(error, dict) else error}"
                )
            return dict(message.get("result") or {})

    async def until_loaded(self, session: str) -> None:
        while session not in self.loaded:
            self._note(await self.recv())


async def screenshot(
    send: Callable[[str], Awaitable[None]], recv: Callable[[], Awaitable[str | bytes]], url: str | None
) -> bytes:
    """PNG bytes of `url` in a page of its own, or of the first page as it is (see the module)."""
    cdp = _Conversation(send, recv)
    created = target = None
    if url is None:
        pages = (await cdp.call("Target.getTargets"))["targetInfos"]
        target = next((t["targetId"] for t in pages if t.get("type") == "page"), None)
    if target is None:
        target = created = (await cdp.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
    session = (await cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
    if url is not None:
        await cdp.call("Page.enable", session=session)
        await cdp.call("Page.navigate", {"url": url}, session=session)
        await cdp.until_loaded(session)
    shot = await cdp.call("Page.captureScreenshot", {"format": "png"}, session=session)
    if created is not None:
        await cdp.call("Target.closeTarget", {"targetId": created})
    return base64.b64decode(shot["data"])
