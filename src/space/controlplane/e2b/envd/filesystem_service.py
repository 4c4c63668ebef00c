"""envd's `filesystem.Filesystem` service over SPACE's node calls (E2B's generated service class).

Invariants:
- Every RPC resolves the caller and its running sandbox first (`caller.target_of`); reading needs a
  read-only key, changing (MakeDir, Move, Remove) a member key or the sandbox's envd token.
- envd's semantics on SPACE's calls: Stat follows a symlink (the target's type and size, the link's
  absolute target); MakeDir of an existing directory is `already_exists`, of an existing file
  `invalid_argument`, and creates parents; Move creates the destination's parents and answers the
  destination's entry; Remove removes recursively and succeeds when nothing is there; ListDir lists
  `depth` levels below the path (0 counts as 1, at most MAX_DEPTH) in lexical walk order, never following
  symlinks; a listing longer than MAX_ENTRIES is refused (`resource_exhausted`), never cut; a missing
  path is `not_found`, a file where a directory is needed `invalid_argument`.
- WatchDir answers `start` once the watch is in place, then events (`watchers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as fpb
from e2b.envd.filesystem.filesystem_connect import Filesystem
from protobuf import Oneof

from space.controlplane.api.deps import Services
from space.controlplane.e2b.envd.caller import Target, target_of
from space.controlplane.e2b.envd.entries import entry_info
from space.controlplane.e2b.envd.keepalive import interval_of, with_keepalive
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.e2b.envd.rpc_errors import translated, translated_stream
from space.controlplane.e2b.envd.watchers import EntryOf, Watchers, filesystem_events
from space.core import errors

_WatchStart = Oneof[Literal["start"], fpb.WatchDirResponse.StartEvent]
_WatchEvent = Oneof[Literal["filesystem"], fpb.FilesystemEvent]
_WatchKeepAlive = Oneof[Literal["keepalive"], fpb.WatchDirResponse.KeepAlive]

#: The daemon's own bounds (space.guest.fileinfo): deeper or longer listings are refused, not cut.
MAX_DEPTH = 16
MAX_ENTRIES = 50_000
MAX_PATH = 4096


def _path(value: str, field: str = "path") -> str:
    if not value or len(value) > MAX_PATH or "\x00" in value:
        raise errors.InvalidArgument(f"{field} must be a path of 1..{MAX_PATH} characters", field=field)
    return value


async def stat_followed(target: Target, path: str) -> fpb.EntryInfo:
    """envd's Stat: a symlink reports its target's type and size (followed inside the sandbox)."""
    return entry_info(await target.node.stat(target.sandbox_id, path, follow=True, xattrs=True))


async def _directory(target: Target, path: str) -> fpb.EntryInfo:
    info = await stat_followed(target, path)
    if info.type != fpb.FileType.DIRECTORY:
        raise errors.InvalidArgument(f"{path} is not a directory", field="path")
    return info


class FilesystemService(Filesystem):
    def __init__(self, services: Services, limits: EnvdLimits, watchers: Watchers) -> None:
        self.services = services
        self.limits = limits
        self.watchers = watchers

    async def _target(self, ctx: RequestContext[Any, Any], *, mutating: bool) -> Target:
        return await target_of(self.services, self.limits, ctx.request_headers, mutating=mutating)

    @translated
    async def stat(
        self, request: fpb.StatRequest, ctx: RequestContext[fpb.StatRequest, fpb.StatResponse], /
    ) -> fpb.StatResponse:
        path = _path(request.path)
        target = await self._target(ctx, mutating=False)
        return fpb.StatResponse(entry=await stat_followed(target, path))

    @translated
    async def make_dir(
        self, request: fpb.MakeDirRequest, ctx: RequestContext[fpb.MakeDirRequest, fpb.MakeDirResponse], /
    ) -> fpb.MakeDirResponse:
        path = _path(request.path)
        target = await self._target(ctx, mutating=True)
        try:
            existing = await stat_followed(target, path)
        except errors.NotFound:
            existing = None
        if existing is not None:
            if existing.type == fpb.FileType.DIRECTORY:
                raise errors.AlreadyExists(f"directory {path} already exists")
            raise errors.InvalidArgument(f"{path} exists and is not a directory", field="path")
        await target.node.mkdir(target.sandbox_id, path, parents=True, mode=0o755, user=target.user)
        return fpb.MakeDirResponse(entry=await stat_followed(target, path))

    @translated
    async def move(
        self, request: fpb.MoveRequest, ctx: RequestContext[fpb.MoveRequest, fpb.MoveResponse], /
    ) -> fpb.MoveResponse:
        source = _path(request.source, "source")
        destination = _path(request.destination, "destination")
        target = await self._target(ctx, mutating=True)
        moved = await target.node.rename(target.sandbox_id, source, destination, parents=True)
        return fpb.MoveResponse(entry=entry_info(moved))

    @translated
    async def remove(
        self, request: fpb.RemoveRequest, ctx: RequestContext[fpb.RemoveRequest, fpb.RemoveResponse], /
    ) -> fpb.RemoveResponse:
        path = _path(request.path)
        target = await self._target(ctx, mutating=True)
        with contextlib.suppress(errors.NotFound):  # envd removes like RemoveAll: nothing there is success
            await target.node.remove(target.sandbox_id, path, recursive=True)
        return fpb.RemoveResponse()

    @translated
    async def list_dir(
        self, request: fpb.ListDirRequest, ctx: RequestContext[fpb.ListDirRequest, fpb.ListDirResponse], /
    ) -> fpb.ListDirResponse:
        path = _path(request.path)
        depth = request.depth or 1
        if depth > MAX_DEPTH:
            raise errors.InvalidArgument(f"depth must be at most {MAX_DEPTH}", field="depth")
        target = await self._target(ctx, mutating=False)
        listing = await target.node.list_dir(target.sandbox_id, path, depth=depth, limit=MAX_ENTRIES)
        if listing.truncated:
            raise errors.ResourceExhausted(f"the listing of {path} exceeds {MAX_ENTRIES} entries")
        return fpb.ListDirResponse(entries=[entry_info(entry) for entry in listing.entries])

    def watch_dir(
        self, request: fpb.WatchDirRequest, ctx: RequestContext[fpb.WatchDirRequest, fpb.WatchDirResponse], /
    ) -> AsyncIterator[fpb.WatchDirResponse]:
        return self._watch_dir(request, ctx)

    @translated_stream
    async def _watch_dir(
        self, request: fpb.WatchDirRequest, ctx: RequestContext[fpb.WatchDirRequest, fpb.WatchDirResponse]
    ) -> AsyncIterator[fpb.WatchDirResponse]:
        path = _path(request.path)
        target = await self._target(ctx, mutating=False)
        stream = await self._events(target, path, request.recursive, request.include_entry)

        def keepalive() -> fpb.FilesystemEvent | None:
            return _KEEPALIVE

        async for event in with_keepalive(stream, interval_of(ctx.request_headers), keepalive):
            if event is _KEEPALIVE:
                yield fpb.WatchDirResponse(
                    event=Oneof[Literal["keepalive"], fpb.WatchDirResponse.KeepAlive](
                        "keepalive", fpb.WatchDirResponse.KeepAlive()
                    )
                )
            elif event is None:
                yield fpb.WatchDirResponse(
                    event=Oneof[Literal["start"], fpb.WatchDirResponse.StartEvent](
                        "start", fpb.WatchDirResponse.StartEvent()
                    )
                )
            else:
                yield fpb.WatchDirResponse(
                    event=Oneof[Literal["filesystem"], fpb.FilesystemEvent]("filesystem", event)
                )

    async def _events(
        self, target: Target, path: str, recursive: bool, include_entry: bool
    ) -> AsyncIterator[fpb.FilesystemEvent | None]:
        root = await _directory(target, path)
        entry_of: EntryOf | None = None
        if include_entry:

            async def entry_of(changed: str) -> fpb.EntryInfo | None:
                try:
                    return entry_info(await target.node.stat(target.sandbox_id, changed))
                except errors.NotFound:
                    return None

        items = target.node.watch(target.sandbox_id, root.path, recursive=recursive)
        return filesystem_events(items, root.path, entry_of)

    @translated
    async def create_watcher(
        self,
        request: fpb.CreateWatcherRequest,
        ctx: RequestContext[fpb.CreateWatcherRequest, fpb.CreateWatcherResponse],
        /,
    ) -> fpb.CreateWatcherResponse:
        path = _path(request.path)
        target = await self._target(ctx, mutating=False)
        stream = await self._events(target, path, request.recursive, request.include_entry)
        watcher_id = await self.watchers.create(_owner(target), stream)
        return fpb.CreateWatcherResponse(watcher_id=watcher_id)

    @translated
    async def get_watcher_events(
        self,
        request: fpb.GetWatcherEventsRequest,
        ctx: RequestContext[fpb.GetWatcherEventsRequest, fpb.GetWatcherEventsResponse],
        /,
    ) -> fpb.GetWatcherEventsResponse:
        target = await self._target(ctx, mutating=False)
        return fpb.GetWatcherEventsResponse(
            events=await self.watchers.drain(_owner(target), request.watcher_id)
        )

    @translated
    async def remove_watcher(
        self,
        request: fpb.RemoveWatcherRequest,
        ctx: RequestContext[fpb.RemoveWatcherRequest, fpb.RemoveWatcherResponse],
        /,
    ) -> fpb.RemoveWatcherResponse:
        target = await self._target(ctx, mutating=False)
        self.watchers.remove(_owner(target), request.watcher_id)
        return fpb.RemoveWatcherResponse()


def _watch_response(event: fpb.FilesystemEvent | None) -> fpb.WatchDirResponse:
    if event is _KEEPALIVE:
        return fpb.WatchDirResponse(event=_WatchKeepAlive("keepalive", fpb.WatchDirResponse.KeepAlive()))
    if event is None:
        return fpb.WatchDirResponse(event=_WatchStart("start", fpb.WatchDirResponse.StartEvent()))
    return fpb.WatchDirResponse(event=_WatchEvent("filesystem", event))


#: The keep-alive marker in a watch stream (a FilesystemEvent nobody else produces).
_KEEPALIVE = fpb.FilesystemEvent(name="\x00keepalive")


def _owner(target: Target) -> tuple[str, str]:
    return (target.who.project_id, target.sandbox_id)
