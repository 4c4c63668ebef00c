"""The node RPC's Idempotency-Key memory for its non-idempotent verbs (snapshot, fork).

Invariants:
- The same key with the same body runs once; concurrent repeats wait for that one run and get its result.
  The same key with another body is a Conflict; a key longer than 128 characters is InvalidArgument.
- A failed or cancelled run is not remembered: the caller's retry runs the work again.
- Memory only (lost on restart) and bounded: the oldest keys are forgotten first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from space.core import errors


class Replays:
    """In-memory Idempotency-Key memory for the non-idempotent verbs (snapshot, fork): the same key with the
    same body runs once (concurrent repeats wait for it); another body is a conflict. Lost on restart."""

    def __init__(self, memory: int) -> None:
        #: How many keys are remembered (NodeAgentSettings.idempotency_memory).
        self.memory = memory
        self._entries: OrderedDict[str, tuple[str, asyncio.Task[Any]]] = OrderedDict()

    async def run(self, key: str | None, scope: str, body: Any, work: Callable[[], Awaitable[Any]]) -> Any:
        if key is None:
            return await work()
        if len(key) > 128:
            raise errors.InvalidArgument("Idempotency-Key is at most 128 characters", field="Idempotency-Key")
        full_key = f"{scope}\0{key}"
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
        entry = self._entries.get(full_key)
        if entry is not None:
            if entry[0] != digest:
                raise errors.Conflict("Idempotency-Key reused with another body", field="Idempotency-Key")
            return await asyncio.shield(entry[1])
        task: asyncio.Task[Any] = asyncio.ensure_future(work())
        self._entries[full_key] = (digest, task)
        while len(self._entries) > self.memory:
            self._entries.popitem(last=False)
        try:
            return await asyncio.shield(task)
        except BaseException:
            # A failed attempt is not remembered: the caller's retry runs the work again.
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._entries.pop(full_key, None)
            raise
