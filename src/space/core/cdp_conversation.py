"""One DevTools (CDP) conversation over any message transport: calls matched to their answers by id, and
the page events the control plane's browser calls wait for (ADR 0064, 0066).

Invariants:
- Only the caller's deadline bounds a conversation (the caller wraps it in one); every answer is matched
  by its id, an error answer is a SpaceError naming CDP's message.
- Events are noted while waiting for any answer, so a `load` (or a main frame's navigation) that arrives
  before the answer to the call that caused it is not lost.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from space.core.errors import SpaceError

Send = Callable[[str], Awaitable[None]]
Receive = Callable[[], Awaitable[str | bytes]]


class Conversation:
    def __init__(self, send: Send, recv: Receive) -> None:
        self.send, self.recv = send, recv
        self.next_id = 0
        #: Sessions whose page fired `load` (since their last main-frame navigation, when one was noted).
        self.loaded: set[str] = set()
        #: Sessions whose main frame navigated since `forget_navigation`.
        self.navigated: set[str] = set()

    def _note(self, raw: str | bytes) -> dict[str, Any]:
        message = json.loads(raw)
        if not isinstance(message, dict):
            raise SpaceError("browser: a DevTools message that is not an object")
        session = message.get("sessionId")
        if session and message.get("method") == "Page.loadEventFired":
            self.loaded.add(session)
        elif session and message.get("method") == "Page.frameNavigated":
            frame = (message.get("params") or {}).get("frame") or {}
            if not frame.get("parentId"):  # the main frame: its document is replaced
                self.navigated.add(session)
                self.loaded.discard(session)
        return message

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

    def forget_navigation(self, session: str) -> None:
        """Start watching for a new navigation of `session`'s page (see `until_navigated`)."""
        self.navigated.discard(session)
        self.loaded.discard(session)

    async def until_navigated(self, session: str) -> None:
        """Until the page's main frame navigated (after `forget_navigation`) and the new page fired `load`."""
        while not (session in self.navigated and session in self.loaded):
            self._note(await self.recv())
