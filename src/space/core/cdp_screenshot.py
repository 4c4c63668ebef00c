"""The DevTools (CDP) conversation of one screenshot, over any message transport (ADR 0064).

`screenshot(send, recv, url)`: with a URL, a page of its own is created, navigated and awaited (`load`),
captured as PNG and closed; without one, the browser's first page is captured as it is (a blank page is
created, and closed, when there is none). The pages an agent has open are never navigated.

Invariants:
- Only the caller's deadline bounds the conversation (the caller wraps it in one); answers and events as
  in space.core.cdp_conversation (a `load` before the answer to `Page.navigate` is not lost).
"""

from __future__ import annotations

import base64

from space.core.cdp_conversation import Conversation, Receive, Send
from space.core.errors import InvalidArgument

MAX_URL = 8192


def check_url(url: object) -> str | None:
    if url is None:
        return None
    if not isinstance(url, str) or not url or len(url) > MAX_URL or any(ch in url for ch in "\0\r\n"):
        raise InvalidArgument(f"url must be 1-{MAX_URL} characters without NUL or line breaks", field="url")
    return url


async def screenshot(send: Send, recv: Receive, url: str | None) -> bytes:
    """PNG bytes of `url` in a page of its own, or of the first page as it is (see the module)."""
    cdp = Conversation(send, recv)
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
