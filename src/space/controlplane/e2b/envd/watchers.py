"""Directory watches for envd: SPACE's `files.watch` stream as envd `FilesystemEvent`s, and the polling
watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher) that E2B's synchronous SDK uses.

Invariants:
- Event names are relative to the watched directory (`nested/file.txt` in a recursive watch); SPACE's
  kinds map created -> CREATE, modified -> WRITE, deleted -> REMOVE, in the daemon's order, and the
  daemon's `cause` refines two of them as envd's inotify does: a path renamed away (deleted, "renamed")
  is RENAME under its old name (its new name is a CREATE), a metadata-only change (modified, "attrib":
  chmod, chown, touch) is CHMOD. The daemon's
  own temporary files (a write goes to `.<name>.spaced-<12 hex>.tmp`, renamed over `<name>` when complete)
  are not shown: an upload is seen as the CREATE of its file.
- A polling watcher is one SPACE watch stream held by this process, buffering at most MAX_EVENTS events
  (older ones are dropped first: a client that never polls costs bounded memory); GetWatcherEvents drains
  the buffer, waiting up to DRAIN_WAIT_S for a first event when it is empty (envd drains inotify before
  answering, so a poll right after a write sees that write). A caller holds at most MAX_WATCHERS per
  sandbox; a watcher is reachable only with its sandbox and project (another tenant's watcher id is
  "not found"), and ends with RemoveWatcher, with its stream, or after IDLE_S without a poll.
- Watchers live in the process that created them (one control plane; with several replicas behind one
  address a poll may reach another replica, which answers "not found": docs/adr/0051).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from e2b.envd.filesystem import filesystem_pb as fpb

from space.core import errors

MAX_EVENTS = 10_000
DRAIN_WAIT_S = 0.5
DRAIN_SETTLE_S = 0.1
MAX_WATCHERS = 16
IDLE_S = 600.0

_KINDS = {
    ("created", ""): fpb.EventType.CREATE,
    ("modified", ""): fpb.EventType.WRITE,
    ("modified", "attrib"): fpb.EventType.CHMOD,
    ("deleted", ""): fpb.EventType.REMOVE,
    ("deleted", "renamed"): fpb.EventType.RENAME,
}
#: The event types whose path still exists (an `entry` is added for them when asked).
_PRESENT = (fpb.EventType.CREATE, fpb.EventType.WRITE, fpb.EventType.CHMOD)

#: The daemon's temporary file of a write in progress (space.guest.files: `_write_replacing`).
_DAEMON_TEMP = re.compile(r"\..+\.spaced-[0-9a-f]{12}\.tmp")

#: Stats a path for an event's `entry` (None: gone meanwhile).
EntryOf = Callable[[str], Awaitable[fpb.EntryInfo | None]]


async def filesystem_events(
    items: AsyncIterator[dict[str, Any]], root: str, entry_of: EntryOf | None
) -> AsyncIterator[fpb.FilesystemEvent | None]:
    """None once the watch is in place, then one FilesystemEvent per change."""
    async for item in items:
        kind = item.get("type")
        if kind == "watching":
            yield None
        elif kind == "changes":
            for change in item.get("changes") or []:
                event = await _event(change, root, entry_of)
                if event is not None:
                    yield event
        elif kind == "error":
            body = item.get("error")
            raise errors.error_from_dict(body if isinstance(body, dict) else {})


async def _event(change: Any, root: str, entry_of: EntryOf | None) -> fpb.FilesystemEvent | None:
    if not isinstance(change, dict):
        return None
    path = str(change.get("path", ""))
    kind, cause = str(change.get("kind")), str(change.get("cause") or "")
    event_type = _KINDS.get((kind, cause), _KINDS.get((kind, "")))  # a cause not known here: its kind
    if event_type is None or not path:
        return None
    if _DAEMON_TEMP.fullmatch(posixpath.basename(path)):
        return None
    name = posixpath.relpath(path, root) if path.startswith(root) else path
    event = fpb.FilesystemEvent(name=name, type=event_type)
    if entry_of is not None and event_type in _PRESENT:
        entry = await entry_of(path)
        if entry is not None:
            event.entry = entry
    return event


@dataclass
class Watcher:
    owner: tuple[str, str]  # (project id, sandbox id)
    events: deque[fpb.FilesystemEvent] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    task: asyncio.Task[None] | None = None
    failure: errors.SpaceError | None = None
    polled_at: float = field(default_factory=time.monotonic)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class Watchers:
    """This process's polling watchers."""

    def __init__(self) -> None:
        self._watchers: dict[str, Watcher] = {}

    async def create(self, owner: tuple[str, str], stream: AsyncIterator[fpb.FilesystemEvent | None]) -> str:
        """Start a watcher on `stream`; returns once the watch is in place (or raises its error)."""
        self._expire()
        if sum(1 for w in self._watchers.values() if w.owner == owner) >= MAX_WATCHERS:
            raise errors.ResourceExhausted(f"at most {MAX_WATCHERS} watchers per sandbox")
        first = await anext(stream, None)  # the `watching` marker: the watch is in place
        del first
        watcher = Watcher(owner)
        watcher_id = secrets.token_hex(12)
        watcher.task = asyncio.create_task(self._collect(watcher, stream), name=f"envd-watcher-{watcher_id}")
        self._watchers[watcher_id] = watcher
        return watcher_id

    @staticmethod
    async def _collect(watcher: Watcher, stream: AsyncIterator[fpb.FilesystemEvent | None]) -> None:
        try:
            async for event in stream:
                if event is not None:
                    watcher.events.append(event)
                    watcher.arrived.set()
        except errors.SpaceError as exc:
            watcher.failure = exc
        watcher.arrived.set()

    def _get(self, owner: tuple[str, str], watcher_id: str) -> Watcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.owner != owner:
            raise errors.NotFound(f"watcher {watcher_id[:64]!r} not found")
        return watcher

    async def drain(self, owner: tuple[str, str], watcher_id: str) -> list[fpb.FilesystemEvent]:
        watcher = self._get(owner, watcher_id)
        watcher.polled_at = time.monotonic()
        if not watcher.events and watcher.failure is None:
            # envd drains inotify before it answers, so a poll right after a write sees that write: wait
            # briefly for what is in flight, then for the rest of its batch.
            watcher.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watcher.arrived.wait(), DRAIN_WAIT_S)
                await asyncio.sleep(DRAIN_SETTLE_S)
        events = list(watcher.events)
        watcher.events.clear()
        if not events and watcher.failure is not None:
            self.remove(owner, watcher_id)
            raise watcher.failure
        return events

    def remove(self, owner: tuple[str, str], watcher_id: str) -> None:
        watcher = self._get(owner, watcher_id)
        del self._watchers[watcher_id]
        if watcher.task is not None:
            watcher.task.cancel()

    def _expire(self) -> None:
        cutoff = time.monotonic() - IDLE_S
        for watcher_id, watcher in list(self._watchers.items()):
            if watcher.polled_at < cutoff:
                self.remove(watcher.owner, watcher_id)

    async def close(self) -> None:
        for watcher_id, watcher in list(self._watchers.items()):
            self.remove(watcher.owner, watcher_id)
            if watcher.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher.task
